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
from dataclasses import dataclass, field
from statistics import median_high

import numpy as np
import torch

from freetoken.config import MoEOptions
from freetoken.kernels.expert_fill import HostRows
from freetoken.moe.cache import ExpertCache, host_array


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
    mode = base_way(mode)
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
AHEAD = "+ahead"  # a way's suffix: with the prefetch on (moe/prefetch.py)


def base_way(mode: str) -> str:
    """The way of serving misses of `mode` (its prefetch suffix dropped)."""
    return mode.removesuffix(AHEAD)


class MissSplit:
    """Which of a host-decided layer step's misses are copied into the cache (the rest run on
    the CPU), and whether a step will likely give the CPU routes at all, before its routing is
    known (the CPU team is then woken early). A strategy chooses one (moe/strategies.py):
    this one fills nothing (`static`, `cpu`): every miss runs on the CPU, and no policy learns,
    the cache's contents being fixed."""

    def __init__(self, tracker: BandwidthTracker, options: MoEOptions, cpu_layers=()):
        self.tracker, self.options = tracker, options
        self.cpu_layers = frozenset(cpu_layers)  # the layers whose steps may give the CPU routes

    def choose(
        self,
        cache: ExpertCache | None,
        moe_layer: int,
        misses: np.ndarray,
        hits: int,
        tokens: int,
        mode: str | None,
    ) -> np.ndarray:
        """The misses to fill (distinct flat pairs), best first; `mode`: the step's way
        (StepModes), None outside a timed decode step."""
        return misses[:0]

    def observe(self, cache: ExpertCache | None, moe_layer: int, routed: np.ndarray) -> None:
        """A layer step's distinct routed pairs, once its fills are queued."""

    def expects_cpu(self, moe_layer: int, mode: str | None) -> bool:
        return moe_layer in self.cpu_layers


class FillEvery(MissSplit):
    """`offload`: every miss filled, as far as the slots this layer's hits leave go; the
    policy ranks which misses are worth a slot and learns from every step."""

    def choose(self, cache, moe_layer, misses, hits, tokens, mode) -> np.ndarray:
        q = self.count(len(misses), tokens, mode) if len(misses) else 0
        # Slots this layer's hits use cannot be given up; what does not fit runs on the CPU.
        q = max(0, min(q, cache.num_slots - hits))
        fill = misses[:q]
        if 0 < q < len(misses):  # the policy ranks which misses are worth a slot
            scores = host_array(cache.policy.pair_scores(moe_layer, misses))
            fill = misses[np.argsort(-scores, kind="stable")[:q]]
        return fill

    def count(self, misses: int, tokens: int, mode: str | None) -> int:
        return misses

    def observe(self, cache, moe_layer, routed) -> None:
        # After this layer's victims are chosen (from what the earlier visits taught), off
        # the path to the fills: the host waits for them or the CPU job next.
        cache.policy.observe(moe_layer, routed - moe_layer * cache.store.num_experts)

    def expects_cpu(self, moe_layer: int, mode: str | None) -> bool:
        return False


class BandwidthSplit(FillEvery):
    """`hybrid`: decode steps fill q of the m misses by the measured bandwidths
    (`split_misses`), or as the step's way says (StepModes: all, or none); long chunks fill
    every miss."""

    def count(self, misses: int, tokens: int, mode: str | None) -> int:
        if tokens >= self.options.fill_all_from_tokens:
            return misses
        mode = base_way(mode or SPLIT)
        if mode == CPU:
            return 0
        # A `fill` step gives the CPU no bandwidth: all filled, up to the fetch cap.
        cpu = self.tracker.cpu if mode != FILL else 0.0
        return split_misses(misses, self.tracker.fill, cpu, self.options.max_fetch)

    def expects_cpu(self, moe_layer: int, mode: str | None) -> bool:
        return base_way(mode or SPLIT) != FILL


class StepModes:
    """How hybrid serves a decode step's misses, decided from measured steps, by step size:

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
    (benchmarks/results/2026-11-29-decode-offload-h200-fold.md). So whole decode steps are
    timed each way and the fastest kept.

    The ways are compared in trials, each on fresh samples taken under the same conditions: a
    trial takes each way twice in a row, counting only the second step (the first pays for
    the switch: on the H200 machine a split step right after a fill step, the CPU idle for
    15 ms before it, took 13.4 ms against 9.8 after a split step, its cores not yet back to
    speed), for `rounds` rounds in turns, and keeps the way with the lowest median, the way in
    use giving way only to one faster by more than `margin` (medians of a few steps move by
    up to 15% there). The first trial starts after `warmup` steps of the split (a step
    size's first steps capture its graph, compile kernels and wake the CPU team: a split step
    among the first 16 measured up to twice its steady time); later ones every
    `retrial_every` steps, or once the way in use runs `drift` slower than in its trial (the
    machine's load changed). The runtime does not time a step that follows an idle gap (the
    CPU cold again). Comparing medians of samples taken far apart did not work: when the ways
    were re-checked one step in 32 amid the way in use, the split's median at 8 GiB, made of
    the first steps and two re-checks among fills, read 16.8 ms where the split steps in a
    row took 7.9, and hybrid filled every miss at 64.5 tok/s instead of splitting at 105.8.

    A way's cost in use can also run above its trial's for a reason no fresh trial shows:
    `cpu` fills nothing, so under a trained router's routes (which move on from token to
    token) its hit rate falls step by step, while each trial's fill and split steps have just
    refreshed the cache it is sampled with (on gpt-oss-20b's trace at a 25% cache, H200,
    hybrid ended on `cpu` with a 65% hit rate against offload's 72% and a 36% spread between
    rounds: benchmarks/results/2026-12-01-gpt-oss-trace-h200.md). So when a trial ends, the way
    in use is charged the median of its last steps in use where that is above its fresh
    samples, and the ratio between the two stays with the way (`in_use`) to scale its later
    trials' medians, halving towards 1 at each trial it is not in use (so it is tried in use
    again, in time).

    Steps are keyed by their tokens' power of two (a batch's plain steps, a verify step's
    1 + k tokens a sequence), each key learning its way apart: what the ways' fixed costs
    weigh against depends on how many misses share them. But a trial costs steps of the slower
    ways, and under speculative decoding the draft lengths spread a run's steps over several
    keys, each seen for a few dozen steps: on the H200 machine at batch 4, ~136 verify steps
    over four keys each began its own trial and the drafted run lost to the plain one
    (benchmarks/results/2026-12-07-speculative-hybrid-h100-h200.md). A key with a smaller
    one below it therefore takes no trial of its own while the nearest smaller key is
    unsettled or settled on the split: the split's saving over filling or computing every miss
    grows with the misses while the fixed costs stay, so a split that wins at fewer misses
    wins at more. Only below a key that settled on `fill` or `cpu` does a larger one try the
    ways itself, or once it has followed for `retrial_every` steps: a smaller key may stay
    unsettled for long (a server at batch 4 sees batch 1 only as requests end) or settle
    under another load, and a long run is worth a trial of its own.

    With a prefetch (`ahead`, moe/prefetch.py), each way is also tried with it on
    (`split+ahead`, ...): whether filling a layer's predicted misses ahead pays depends on how
    well the model's routes are predicted, which only the steps tell. Asked for, the prefetch
    is on from the first step (`split+ahead`) until a trial finds a way without it faster.
    """

    def __init__(
        self,
        warmup: int = 16,
        rounds: int = 3,
        retrial_every: int = 512,
        margin: float = 0.1,
        drift: float = 0.25,
        window: int = 5,
        ahead: bool = False,
    ):
        self.MODES = (SPLIT, FILL, CPU)
        self.first = SPLIT  # the way until the first trial
        if ahead:  # (asked for: on until a trial finds it slower)
            self.MODES += tuple(mode + AHEAD for mode in self.MODES)
            self.first = SPLIT + AHEAD
        self.warmup, self.rounds, self.retrial_every = warmup, rounds, retrial_every
        self.margin, self.drift, self.window = margin, drift, window
        self._keys: dict[int, _Ways] = {}  # step_key -> its ways

    def _ways(self, tokens: int) -> _Ways:
        key = step_key(tokens)
        if key not in self._keys:
            self._keys[key] = _Ways(deque(maxlen=self.window), current=self.first)
        return self._keys[key]

    def current(self, tokens: int) -> str:
        """The way in use for steps of this many tokens."""
        return self._ways(tokens).current

    def median(self, tokens: int, mode: str) -> float | None:
        """The way's median step time in the last trial (None before any)."""
        seen = self._ways(tokens).samples.get(mode)
        return median_high(seen) if seen else None

    def trials(self, tokens: int) -> int:
        """Trials finished for steps of this many tokens."""
        return self._ways(tokens).trials

    def _leader(self, tokens: int) -> _Ways | None:
        """The nearest smaller key's state where a key that has not tried the ways follows
        it: unsettled, or settled on the split (with the prefetch or without)."""
        key = step_key(tokens)
        below = [k for k in self._keys if k < key]
        if not below:
            return None
        leader = self._keys[max(below)]
        return leader if leader.trials == 0 or base_way(leader.current) == SPLIT else None

    def choose(self, tokens: int) -> str:
        """The way of this step's layers."""
        ways = self._ways(tokens)
        ways.steps += 1
        ways.pending = None
        new = not ways.trials and not ways.in_trial and ways.steps <= self.retrial_every
        leader = self._leader(tokens) if new else None
        if leader is not None:  # (not timed: it has no trial to compare with)
            ways.current = leader.current if leader.trials else self.first
            return ways.current
        if ways.steps <= self.warmup:
            return ways.current  # not timed
        if ways.in_trial and not ways.queue:
            self._decide(ways)
        if not ways.in_trial and self._trial_due(ways):
            ways.in_trial = True
            # each way twice in a row, the second counted
            ways.queue = deque(
                (mode, counted)
                for _ in range(self.rounds)
                for mode in self.MODES
                for counted in (False, True)
            )
            ways.samples = {mode: [] for mode in self.MODES}
        if ways.in_trial:
            ways.pending = ways.queue.popleft()
            return ways.pending[0]
        ways.pending = (ways.current, True)
        return ways.current

    def observe(self, tokens: int, mode: str, seconds: float) -> None:
        """The time of the last step chosen for this many tokens (before the next is chosen)."""
        ways = self._ways(tokens)
        if ways.pending is None or ways.pending[0] != mode or not ways.pending[1]:
            return  # a warm-up step, or not the one chosen last
        ways.pending = None
        if ways.in_trial:
            ways.samples[mode].append(seconds)
        else:
            ways.recent.append(seconds)

    def _trial_due(self, ways: _Ways) -> bool:
        if ways.trials == 0 or ways.steps - ways.settled_at >= self.retrial_every:
            return True
        return (
            len(ways.recent) == self.window
            and median_high(ways.recent) > (1.0 + self.drift) * ways.baseline
        )

    def _decide(self, ways: _Ways) -> None:
        medians = {mode: median_high(seen) for mode, seen in ways.samples.items() if seen}
        if medians:
            self._charge_use(ways, medians)
            figures = {mode: t * ways.in_use.get(mode, 1.0) for mode, t in medians.items()}
            fastest = min(figures, key=figures.get)
            held = figures.get(ways.current)
            if held is None or figures[fastest] < (1.0 - self.margin) * held:
                ways.current = fastest
            ways.baseline = figures.get(ways.current, float("inf"))
        ways.in_trial, ways.trials, ways.settled_at = False, ways.trials + 1, ways.steps
        ways.recent.clear()

    def _charge_use(self, ways: _Ways, medians: dict[str, float]) -> None:
        """Update `in_use`: the way in use's last steps in use against its fresh samples (where
        both are known and a full window was seen), the others' ratios halved towards 1."""
        for mode in list(ways.in_use):
            if mode != ways.current:
                ways.in_use[mode] = 1.0 + (ways.in_use[mode] - 1.0) / 2
        fresh = medians.get(ways.current)
        if len(ways.recent) == self.window and fresh:
            ways.in_use[ways.current] = max(1.0, median_high(ways.recent) / fresh)


def step_key(tokens: int) -> int:
    """StepModes' key for a step of `tokens` tokens: the power of two at or above."""
    return 1 << max(tokens - 1, 0).bit_length()


@dataclass
class _Ways:
    """StepModes' state for one key (step_key)."""

    recent: deque  # the way in use's last step times, once settled
    current: str = SPLIT
    steps: int = 0
    in_trial: bool = False
    queue: deque = field(default_factory=deque)  # the trial's (way, counted) still to take
    samples: dict = field(default_factory=dict)  # the last trial's step times by way
    pending: tuple | None = None  # (way, counted) of the step chosen last
    trials: int = 0
    settled_at: int = 0  # the step the last trial ended
    baseline: float = float("inf")  # the way in use's figure in its trial (median x in_use)
    in_use: dict = field(default_factory=dict)  # way -> its steps in use against its trials


class StepClock:
    """Times decode steps decided on the device. On CUDA by the device's own clock, at no host
    cost: the first MoE layer's plan kernel stamps `%globaltimer` into `stamps[0]` as the
    step's MoE work begins, and the last layer's merge kernel, once the CPU's share is in,
    into `stamps[1]`; both are mapped pinned memory, which the host reads in place after the
    sampler's wait, with no driver call (events cost ~25 us of host time per record or query
    on the H200 machine: with the rest of `begin_step`, 0.19 ms of a hybrid step's 0.55).
    The layers between the stamps are all that StepModes' ways differ in; the time from one
    step's end stamp to the next one's start tells a step that came after a pause. On the CPU,
    wall time from `start` to `stop`. One step at a time: its time is read before the next
    one."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start_stamp = self.end_stamp = None  # where the kernels stamp (CUDA)
        if self.cuda:
            self.stamps = torch.zeros(2, dtype=torch.int64, pin_memory=True)
            self._stamped = self.stamps.numpy()
            self.start_stamp, self.end_stamp = HostRows(self.stamps[:1]), HostRows(self.stamps[1:])
        else:
            self._start = self._stop = 0.0
        self._last_end = 0  # the device's end stamp of the last step read
        self._last_stop = float("-inf")  # the CPU's

    def start(self) -> None:
        if not self.cuda:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if not self.cuda:
            self._last_stop, self._stop = self._stop, time.perf_counter()

    def seconds(self) -> tuple[float, float] | None:
        """(the last step's seconds, the idle seconds between the step before it and it), or
        None if no step was stamped whole since the last call."""
        if not self.cuda:
            return self._stop - self._start, self._start - self._last_stop
        # the end first: a start read after it is this step's, or a later one's (then > end)
        end = int(self._stamped[1])
        start = int(self._stamped[0])
        if end <= start or end == self._last_end:
            return None
        gap = (start - self._last_end) / 1e9 if self._last_end else float("inf")
        self._last_end = end
        return (end - start) / 1e9, gap
