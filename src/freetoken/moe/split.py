"""How many of a layer's cache misses to copy to the GPU; the rest run on the CPU at once.

With B_P' the PCIe fill bandwidth and B_H' the CPU expert bandwidth, both measured while the
two paths run together, filling q of m equal-sized misses takes q / B_P' and computing the
rest m - q / B_H'. Both finish together at q = m * B_P' / (B_P' + B_H').

The FreeToken paper's q* = m * B_P / B_H is the special case where the two paths fully
contend for host memory bandwidth: B_P' = B_P and B_H' = B_H - B_P. On the GPU host we
measured, they contend less (CPU GEMV 34 GB/s with a pinned copy at 54 GB/s at once, 40 and
55 alone), so we use the general form.
"""

from __future__ import annotations


def split_misses(
    misses: int,
    fill_bandwidth: float,
    cpu_bandwidth: float,
    max_fill: int | None = None,
    min_fill: int = 1,
) -> int:
    """Number of misses to fill (the rest run on the CPU).

    At least `min_fill` when there is any miss, so the cache keeps warming even when the CPU is
    faster; at most `max_fill` (`--moe-hybrid-max-fetch`, which must be >= `min_fill`) and
    never more than `misses`.
    """
    if misses <= 0:
        return 0
    if fill_bandwidth <= 0:
        q = 0
    elif cpu_bandwidth <= 0:
        q = misses
    else:
        q = round(misses * fill_bandwidth / (fill_bandwidth + cpu_bandwidth))
    q = max(q, min_fill)
    if max_fill is not None:
        q = min(q, max_fill)
    return min(q, misses)


def paper_split(misses: int, pcie_bandwidth: float, host_bandwidth: float) -> float:
    """The FreeToken paper's q* = m * B_P / B_H (full contention for host memory)."""
    return misses * pcie_bandwidth / host_bandwidth


class BandwidthTracker:
    """Exponential moving averages of the fill and CPU bandwidths observed while running, so
    the split follows another program competing for PCIe or memory bandwidth."""

    def __init__(self, fill_bandwidth: float, cpu_bandwidth: float, alpha: float = 0.05):
        self.fill = fill_bandwidth
        self.cpu = cpu_bandwidth
        self.alpha = alpha

    def observe_fill(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.fill += self.alpha * (nbytes / seconds - self.fill)

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.cpu += self.alpha * (nbytes / seconds - self.cpu)


class SplitOrFill:
    """Whether hybrid should split a decode step's misses at all, decided from measured steps.

    The split above balances the two paths' bandwidths, but the CPU path also has fixed costs
    per layer step (preparing the job, waking the CPU threads, bringing the partial back) that
    depend on the machine and on how many misses there are to share them. On the H200 machine
    they outweighed what the CPU saved at batch 1 (4-5 misses per layer: filling them all was
    25% faster) but not at batch 4 (16 misses: the split was up to 14% faster;
    benchmarks/results/2026-11-29-decode-offload-h200-graphs.md). So for each batch size this
    times whole decode steps both ways and keeps the faster, trying the other again every
    `explore_every` steps in case the machine's load changed. The first step timed each way is
    a warm-up and not counted (the first CPU job may, for one, compile the CPU kernel).
    """

    def __init__(self, explore_every: int = 32, alpha: float = 0.25):
        self.explore_every, self.alpha = explore_every, alpha
        self.seconds: dict[int, dict[bool, float]] = {}  # batch -> {split?: EMA step time}
        self.timed: dict[tuple[int, bool], int] = {}  # steps timed, warm-up included
        self.steps: dict[int, int] = {}

    def choose(self, batch: int) -> bool:
        """True: split the misses of this step's layers; False: fill them all."""
        seen = self.seconds.setdefault(batch, {})
        step = self.steps[batch] = self.steps.get(batch, 0) + 1
        for split in (True, False):  # each way measured before any comparison
            if split not in seen:
                return split
        best = seen[True] <= seen[False]
        return (not best) if step % self.explore_every == 0 else best

    def observe(self, batch: int, split: bool, seconds: float) -> None:
        timed = self.timed[batch, split] = self.timed.get((batch, split), 0) + 1
        if timed == 1:
            return  # the warm-up
        seen = self.seconds.setdefault(batch, {})
        old = seen.get(split)
        seen[split] = seconds if old is None else old + self.alpha * (seconds - old)
