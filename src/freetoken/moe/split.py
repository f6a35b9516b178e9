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

import time
from collections import deque

import torch

from freetoken.kernels.expert_fill import HostRows


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


def split_parameters(
    mode: str, fill_bandwidth: float, cpu_bandwidth: float, max_fill: int | None = None
) -> tuple[float, float, float]:
    """`split_misses` for the device (moe/device_control.py), whose plan learns m only there:
    (f, lo, hi) such that q = clamp(floor(m * f + 0.5), min(lo, m), min(hi, m)), for a step
    of StepModes' `mode` (the split, every miss filled, or none)."""
    cap = float(max_fill or 2**30)
    if mode == CPU:
        return 0.0, 0.0, 0.0
    if mode == FILL or cpu_bandwidth <= 0:
        return 1.0, 0.0, cap
    if fill_bandwidth <= 0:
        return 0.0, 1.0, cap
    return fill_bandwidth / (fill_bandwidth + cpu_bandwidth), 1.0, cap


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


SPLIT, FILL, CPU = "split", "fill", "cpu"


class StepModes:
    """How hybrid serves a decode step's misses, decided from measured steps, per batch size:

    - `split`: the bandwidth split above (q filled, m - q on the CPU, at once);
    - `fill`: every miss copied into the cache (offload's way);
    - `cpu`: every miss computed on the CPU, none copied (static's way, with the cache as it
      stands; the policy keeps learning, and the other modes fill again when they are tried).

    The split balances the two paths' bandwidths, but each path also has fixed costs per
    layer step (preparing the CPU job and bringing its partial back; choosing victims and
    queuing copies) that depend on the machine and on how many misses there are to share
    them. On the H200 machine at batch 1 (4-5 misses per layer) `static`, every miss on the
    CPU, once ran 5-7% faster than the split, and before the CPU path was rebuilt filling
    everything beat both; at batch 4 the split won by 15-60%
    (benchmarks/results/2026-11-29-decode-offload-h200-fold.md; since the host path was cut,
    the split leads at batch 1 too: 2026-11-29-decode-offload-h200-host.md). So this times
    whole decode steps each way and keeps the fastest, trying the others again in turn every
    `explore_every` steps in case the machine's load changed.

    Each way keeps its last `window` step times and their medians are compared, after
    `min_samples` of each (the first step timed each way is a warm-up and not counted: the
    first CPU job may, for one, compile the CPU kernel). Those first samples are taken in
    turns (split, fill, cpu, split, ...), not each way's in a block: a transient of the first
    steps (the CPU team and its caches warming) then weighs on every way alike. (On the H200
    machine hybrid at a 37% cache once settled on the `cpu` way, q = 0.11 at 72.9 tok/s,
    while the same strategy built again split at 90.2; blocks would explain it, which that
    machine has not yet confirmed.) A median, because a step that also
    captures a decode graph (a batch size's second step)
    takes hundreds of milliseconds: a running average needed dozens of re-checks to forget one,
    and on the H200 machine hybrid kept filling everything at batch 1 for that reason.

    The way in use (the split at first) gives way only to one faster by more than `margin`:
    the ways are timed dozens of steps apart, and on the H200 machine a median of 5 steps
    moved by up to 15% between them, enough to send one run of the same code the `cpu` way
    at 56 tok/s while another split at 66.
    """

    MODES = (SPLIT, FILL, CPU)

    def __init__(
        self, explore_every: int = 32, window: int = 5, min_samples: int = 3, margin: float = 0.1
    ):
        self.explore_every, self.window, self.min_samples = explore_every, window, min_samples
        self.margin = margin
        self.samples: dict[int, dict[str, deque[float]]] = {}  # batch -> mode -> seconds
        self.timed: dict[tuple[int, str], int] = {}  # steps timed, warm-up included
        self.steps: dict[int, int] = {}
        self.current: dict[int, str] = {}  # batch -> the way in use

    def _samples(self, batch: int) -> dict[str, deque[float]]:
        if batch not in self.samples:
            self.samples[batch] = {mode: deque(maxlen=self.window) for mode in self.MODES}
        return self.samples[batch]

    def median(self, batch: int, mode: str) -> float | None:
        seen = sorted(self._samples(batch)[mode])
        return seen[len(seen) // 2] if seen else None

    def best(self, batch: int) -> str:
        """The way in use, replaced by the fastest when that is faster by more than
        `margin`."""
        current = self.current.get(batch, SPLIT)
        fastest = min(self.MODES, key=lambda mode: self.median(batch, mode))
        if self.median(batch, fastest) < (1.0 - self.margin) * self.median(batch, current):
            current = self.current[batch] = fastest
        return current

    def choose(self, batch: int) -> str:
        """The mode of this step's layers."""
        samples = self._samples(batch)
        step = self.steps[batch] = self.steps.get(batch, 0) + 1
        lacking = [mode for mode in self.MODES if len(samples[mode]) < self.min_samples]
        if lacking:  # each way measured before any comparison, in turns (see the class)
            return min(lacking, key=lambda mode: self.timed.get((batch, mode), 0))
        best = self.best(batch)
        if step % self.explore_every:
            return best
        others = [mode for mode in self.MODES if mode != best]
        return others[(step // self.explore_every) % len(others)]

    def observe(self, batch: int, mode: str, seconds: float) -> None:
        timed = self.timed[batch, mode] = self.timed.get((batch, mode), 0) + 1
        if timed > 1:  # the first is the warm-up
            self._samples(batch)[mode].append(seconds)


class StepClock:
    """Times decode steps decided on the device. On CUDA by the device's own clock, at no host
    cost: the first MoE layer's plan kernel stamps `%globaltimer` into `stamps[0]` as the
    step's MoE work begins, and the last layer's merge kernel, once the CPU's share is in,
    into `stamps[1]`; both are mapped pinned memory, which the host reads in place after the
    sampler's wait, with no driver call (events cost ~25 us of host time per record or query
    on the H200 machine: with the rest of `begin_step`, 0.19 ms of a hybrid step's 0.55).
    The layers between the stamps are all that StepModes' ways differ in. On the CPU, wall
    time from `start` to `stop`. One step at a time: its time is read before the next one."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start_stamp = self.end_stamp = None  # where the kernels stamp (CUDA)
        if self.cuda:
            self.stamps = torch.zeros(2, dtype=torch.int64, pin_memory=True)
            self._stamped = self.stamps.numpy()
            self.start_stamp, self.end_stamp = HostRows(self.stamps[:1]), HostRows(self.stamps[1:])
        self._last_end = 0

    def start(self) -> None:
        if not self.cuda:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if not self.cuda:
            self._stop = time.perf_counter()

    def seconds(self) -> float | None:
        """The last step's seconds, or None if no step was stamped whole since the last call."""
        if not self.cuda:
            return self._stop - self._start
        # the end first: a start read after it is this step's, or a later one's (then > end)
        end = int(self._stamped[1])
        start = int(self._stamped[0])
        if end <= start or end == self._last_end:
            return None
        self._last_end = end
        return (end - start) / 1e9
