"""How many of a layer's cache misses to copy to the GPU; the rest run on the CPU at once.

With B_P' the PCIe fill bandwidth and B_H' the CPU expert bandwidth, both measured while the
two paths run together, filling q of m equal-sized misses takes q / B_P' and computing the
rest m - q / B_H'. Both finish together at q = m * B_P' / (B_P' + B_H').

The FreeToken paper's q* = m * B_P / B_H is the special case where the two paths fully
contend for host memory bandwidth: B_P' = B_P and B_H' = B_H - B_P. On the GPU host we
measured, they contend less (CPU GEMV 34 GB/s with a pinned copy at 54 GB/s at once, 40 and
55 alone), so we use the general form.

The CPU path also has a fixed cost per layer step, whatever it computes: preparing the job,
waking the CPU threads, bringing the result to the GPU and adding it: about 0.9 ms on the H200
machine (hybrid's batch-1 layer step was 0.5 ms slower than offload's while moving 0.4 ms of
PCIe work to 0.5 ms of CPU work), where a layer's misses cross PCIe in about 0.9 ms. With that
cost t0 the CPU side takes t0 + (m - q) / B_H', and sending it nothing can be the fastest split: at
batch 1 there, filling every miss beat any split, at batch 4 the split won
(benchmarks/results/2026-11-29-decode-offload-h200.md). The runtime measures t0 as it runs.
"""

from __future__ import annotations

import math


def split_misses(
    misses: int,
    fill_bandwidth: float,
    cpu_bandwidth: float,
    max_fill: int | None = None,
    min_fill: int = 1,
    cpu_overhead_s: float = 0.0,
    expert_bytes: int = 1,
) -> int:
    """Number of misses to fill (the rest run on the CPU).

    At least `min_fill` when there is any miss, so the cache keeps warming even when the CPU is
    faster; at most `max_fill` (`--moe-hybrid-max-fetch`, which must be >= `min_fill`) and
    never more than `misses`. With a fixed CPU-path cost `cpu_overhead_s` (experts of
    `expert_bytes` each), the q that finishes the layer soonest, which may be all of them.
    """
    if misses <= 0:
        return 0
    hi = misses if max_fill is None else max(0, min(misses, max_fill))
    lo = min(min_fill, hi)
    if fill_bandwidth <= 0:
        return lo
    if cpu_bandwidth <= 0:
        return hi
    share = fill_bandwidth / (fill_bandwidth + cpu_bandwidth)
    if cpu_overhead_s <= 0:
        return min(max(round(misses * share), lo), hi)
    fill_s, cpu_s = expert_bytes / fill_bandwidth, expert_bytes / cpu_bandwidth

    def finish(q: int) -> float:
        rest = misses - q
        return max(q * fill_s, cpu_overhead_s + rest * cpu_s if rest else 0.0)

    # Both paths end together at q * fill_s = t0 + (m - q) * cpu_s; or the CPU gets nothing.
    balanced = (cpu_overhead_s + misses * cpu_s) / (fill_s + cpu_s)
    candidates = {math.floor(balanced), math.ceil(balanced), misses}
    candidates = {min(max(q, lo), hi) for q in candidates}
    return min(sorted(candidates, reverse=True), key=finish)  # ties: fill more (warms the cache)


def paper_split(misses: int, pcie_bandwidth: float, host_bandwidth: float) -> float:
    """The FreeToken paper's q* = m * B_P / B_H (full contention for host memory)."""
    return misses * pcie_bandwidth / host_bandwidth


class BandwidthTracker:
    """Exponential moving averages of the fill and CPU bandwidths observed while running, so
    the split follows another program competing for PCIe or memory bandwidth."""

    def __init__(
        self,
        fill_bandwidth: float,
        cpu_bandwidth: float,
        alpha: float = 0.05,
        cpu_overhead_s: float = 0.0,
    ):
        self.fill = fill_bandwidth
        self.cpu = cpu_bandwidth
        self.alpha = alpha
        self.cpu_overhead = cpu_overhead_s  # fixed cost of the CPU path per layer step

    def observe_fill(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.fill += self.alpha * (nbytes / seconds - self.fill)

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.cpu += self.alpha * (nbytes / seconds - self.cpu)

    def observe_cpu_overhead(self, seconds: float) -> None:
        if seconds >= 0:
            self.cpu_overhead += self.alpha * (seconds - self.cpu_overhead)
