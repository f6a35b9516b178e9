"""The step clock: which way (StepModes, moe/split.py) each decode step of `hybrid` takes, and
how long it took, for StepModes to keep the fastest way.

A runtime has one of three clocks, chosen at build:

    UntimedSteps       every strategy but hybrid: no ways, nothing timed
    LayerTimedSteps    hybrid deciding on the host: from the first MoE layer's round trip to
                       the last one's, which waits for all the work of the layers before it
    DeviceTimedSteps   hybrid deciding on the device: from begin_step to end_step, by the
                       device's own clock (StepClock); the step's split written where the
                       device's plans read it

`step` is the current decode step's (start, tokens, way), None outside one.
"""

from __future__ import annotations

import time

import numpy as np

from freetoken.config import MoEOptions
from freetoken.moe.split import AHEAD, BandwidthTracker, StepClock, StepModes, split_parameters

# A decode step whose MoE work starts this long after the last one's ended is not counted by
# StepModes: back to back, the gap (the last layers, the sampler, the next step's launch and
# first attention) is ~1 ms; after a longer pause (a prefill, no requests, another benchmark
# contender's turn) the CPU team's cores come back slowly (on the H200 machine a split step
# after 15 ms of CPU idleness took 37% longer).
IDLE_GAP_SECONDS = 3e-3


class UntimedSteps:
    def __init__(self, modes: StepModes | None = None):
        self.modes = modes or StepModes()
        self.step: tuple[float | None, int, str] | None = None

    @property
    def mode(self) -> str | None:
        """The current decode step's way, None outside a timed decode step."""
        return self.step[2] if self.step is not None else None

    def begin(self, tokens: int, decode: bool) -> None:
        """Before every forward."""

    def end(self, timed: bool) -> None:
        """After every forward was queued; `timed` False for a step whose time says nothing
        of its way (one that captured a decode graph)."""

    def at_layer(self, moe_layer: int, tokens: int) -> None:
        """At each host-decided layer step's round trip."""
        self.step = None


class LayerTimedSteps(UntimedSteps):
    def __init__(self, modes: StepModes, options: MoEOptions, num_layers: int):
        super().__init__(modes)
        self.fill_all_from_tokens, self.last_layer = options.fill_all_from_tokens, num_layers - 1

    def at_layer(self, moe_layer: int, tokens: int) -> None:
        if tokens >= self.fill_all_from_tokens:
            self.step = None
            return
        now = time.perf_counter()
        if moe_layer == 0:
            self.step = (now, tokens, self.modes.choose(tokens))
        elif moe_layer == self.last_layer and self.step is not None:
            start, step_tokens, mode = self.step
            if step_tokens == tokens:
                self.modes.observe(tokens, mode, now - start)


class DeviceTimedSteps(UntimedSteps):
    def __init__(
        self,
        modes: StepModes,
        clock: StepClock,
        split: np.ndarray,
        tracker: BandwidthTracker,
        options: MoEOptions,
        share,
        prefetch=None,
    ):
        """`split`: the (f, lo, hi) the plans read, as the host rewrites it (a view made once:
        numpy's write costs a microsecond, a tensor op 5-25); `share`: the device-decided
        CPU share (moe/cpu_share.py), checked and measured between steps; `prefetch`
        (moe/prefetch.py): switched on and off as each step's way says, or None."""
        super().__init__(modes)
        self.clock, self.split, self.tracker, self.options = clock, split, tracker, options
        self.share, self.prefetch = share, prefetch
        self._timed = None  # the last step, its clock stopped: (tokens, mode)

    def begin(self, tokens: int, decode: bool) -> None:
        """The last decode step's time given to `StepModes`, this step's way chosen and its
        split written where the plans read it."""
        self.share.check()
        self._observe_timed_step()
        self.step = None
        if not decode or tokens >= self.options.fill_all_from_tokens:
            return
        self.share.observe_bandwidth(self.tracker)
        mode = self.modes.choose(tokens)
        self.clock.start()
        self.step = (None, tokens, mode)  # (its start is the clock's)
        self.split[:] = split_parameters(
            mode, self.tracker.fill, self.tracker.cpu, self.options.max_fetch
        )
        if self.prefetch is not None:
            self.prefetch.switch(mode.endswith(AHEAD))

    def end(self, timed: bool) -> None:
        if self.step is not None and timed:
            self.clock.stop()
            self._timed = self.step[1:]

    def at_layer(self, moe_layer: int, tokens: int) -> None:
        pass  # whole steps are timed (begin, end)

    def _observe_timed_step(self) -> None:
        # (read after an untimed step too, a capture say: the clock then knows where it ended,
        # and the next step's gap is measured from there)
        timing = self.clock.seconds()
        if self._timed is not None:
            tokens, mode = self._timed
            # (a step after an idle gap is not counted: the CPU team's cores are slow to wake)
            if timing is not None and timing[1] < IDLE_GAP_SECONDS:
                self.modes.observe(tokens, mode, timing[0])
            self._timed = None
