"""The CPU's share of a layer step: the routes whose experts run where they lie, in the host
pool, while the GPU computes the rest (moe/cpu.py runs them).

A host-decided step starts its CPU job as soon as the routing is known (`HostCPUShare.start`)
and waits for it after the GPU kernel is queued (`finish`). A step decided on the device
leaves its CPU routes where the plan wrote them; a strategy chooses how they are run:

    NoCPUShare       offload: the plan fills every miss, there are none
    TierCPUShare     hybrid on the CPU tier (the tests' twin): run at once, added to the output
    DoorbellShare    hybrid on CUDA: the plan rang the CPU team from inside the graph
                     (moe/doorbell.py); a merge kernel waits for its answer and adds it
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.moe.cpu import CPUExpertExecutor, CPUJob
from freetoken.moe.doorbell import SECONDS, CPUDoorbell
from freetoken.moe.split import BandwidthTracker, StepClock
from freetoken.telemetry import MoETelemetry


@dataclass
class StartedJob:
    """A host-decided layer step's CPU job under way."""

    handle: object  # the executor's handle (`.result()`)
    num_tokens: int  # rows of the layer's x
    tokens: np.ndarray  # the rows the job reads
    all_tokens: bool


class HostCPUShare:
    def __init__(self, cpu: CPUExpertExecutor, tracker: BandwidthTracker, telemetry: MoETelemetry):
        self.cpu, self.tracker, self.telemetry = cpu, tracker, telemetry

    def prepare(self) -> None:
        """Wake the team (while the host waits for the routing)."""
        self.cpu.prepare()

    def start(
        self, cpu_routes: np.ndarray, pairs: np.ndarray, x_h: torch.Tensor, weights_h: torch.Tensor
    ) -> StartedJob:
        """Start the CPU job of the routes marked in `cpu_routes` [T, k]; the tokens it reads
        are noted for the scatter of its partial."""
        num_tokens = len(pairs)
        rows, cols = np.nonzero(cpu_routes)
        all_tokens = True
        if num_tokens == 1:
            tokens, token_of_route = np.zeros(1, np.int64), rows
        else:
            tokens, token_of_route = np.unique(rows, return_inverse=True)
            all_tokens = len(tokens) == num_tokens
        x = x_h if all_tokens else x_h[torch.from_numpy(tokens)]
        job = CPUJob(x, token_of_route, pairs[rows, cols], weights_h.float().numpy()[rows, cols])
        return StartedJob(self.cpu.submit(job), num_tokens, tokens, all_tokens)

    def finish(self, moe_layer: int, job: StartedJob) -> torch.Tensor:
        """Wait for the layer's CPU share; its partial [T, H] (on the host)."""
        waited = time.perf_counter()
        result = job.handle.result()
        counters = self.telemetry.layers[moe_layer]
        counters.cpu_wait_s += time.perf_counter() - waited
        counters.cpu_time_s += result.seconds
        self.tracker.observe_cpu(result.weight_bytes, result.seconds)
        out = result.out
        if not job.all_tokens:
            shape = (job.num_tokens, out.shape[1])
            rows = torch.from_numpy(job.tokens)
            out = torch.zeros(shape, dtype=out.dtype).index_copy_(0, rows, out)
        return out


class NoCPUShare:
    doorbell: CPUDoorbell | None = None

    def signals(self, moe_layer: int, ids: torch.Tensor) -> tuple[int, object, object]:
        """What the plan and the merge need of this step: (the doorbell's shape word, where
        the plan stamps the step's start, where the merge stamps its end)."""
        return 0, None, None

    def merge(
        self,
        control,
        moe_layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        out: torch.Tensor,
        end_stamp,
    ) -> torch.Tensor:
        """The layer's output: the GPU's `out` plus the CPU's partial."""
        return out

    def check(self) -> None:
        """Between steps: fail if a layer step was computed without its CPU share."""

    def observe_bandwidth(self, tracker: BandwidthTracker) -> None:
        """Between decode steps: the last step's CPU bandwidth into the tracker."""

    def fold(self, telemetry: MoETelemetry) -> None:
        """The CPU's seconds per layer kept elsewhere, into the telemetry."""


class TierCPUShare(NoCPUShare):
    def __init__(self, cpu: CPUExpertExecutor, tracker: BandwidthTracker, telemetry: MoETelemetry):
        self.cpu, self.tracker, self.telemetry = cpu, tracker, telemetry

    def merge(self, control, moe_layer, x, ids, out, end_stamp) -> torch.Tensor:
        return out + self._run(control, moe_layer, x, ids.numel()).to(x.dtype)

    def _run(self, control, moe_layer: int, x: torch.Tensor, routes: int) -> torch.Tensor:
        """The routes the plan left to the CPU, run now (fp32)."""
        pairs = control.cpu_pairs[:routes]
        ours = pairs >= 0
        if not ours.any():
            return torch.zeros(x.shape, dtype=torch.float32)
        rows = torch.arange(routes) // (routes // x.shape[0])
        weights = control.cpu_weights[:routes][ours]
        result = self.cpu.submit(CPUJob(x, rows[ours], pairs[ours], weights)).result()
        self.tracker.observe_cpu(result.weight_bytes, result.seconds)
        self.telemetry.layers[moe_layer].cpu_time_s += result.seconds
        return result.out


class DoorbellShare(NoCPUShare):
    def __init__(self, doorbell: CPUDoorbell, clock: StepClock, num_layers: int, expert_bytes: int):
        """`clock`: the step clock's stamps, written by the first layer's plan and the last
        layer's merge (moe/steps.py `DeviceTimedSteps`)."""
        self.doorbell, self.clock = doorbell, clock
        self.last_layer, self.expert_bytes = num_layers - 1, expert_bytes
        self._errors = 0  # the listener's failures already reported

    def signals(self, moe_layer, ids) -> tuple[int, object, object]:
        shape = self.doorbell.shape_value(moe_layer, *ids.shape)
        start = self.clock.start_stamp if moe_layer == 0 else None
        end = self.clock.end_stamp if moe_layer == self.last_layer else None
        return shape, start, end

    def merge(self, control, moe_layer, x, ids, out, end_stamp) -> torch.Tensor:
        out = out.contiguous()
        self.doorbell.merge_(out, control.cpu_flag, end_stamp)
        return out

    def check(self) -> None:
        """A layer step the listener could not serve (no thread or memory for its job) was
        computed without its CPU share: fail the step after it rather than go on silently."""
        errors = self.doorbell.errors
        if errors != self._errors:
            missed, self._errors = errors - self._errors, errors
            raise RuntimeError(
                f"the CPU expert listener could not run {missed} layer step(s) (no thread or "
                "memory for the job): the last decode step lacked their CPU share"
            )

    def observe_bandwidth(self, tracker: BandwidthTracker) -> None:
        """The CPU share's bandwidth over the last step's layers, as one observation (per
        layer, the loop cost ~40 us of host time a step on the H200 machine); the CPU tier
        observes each job as it runs it."""
        seconds, experts = self.doorbell.totals()
        if seconds > 0:
            tracker.observe_cpu(int(experts * self.expert_bytes), seconds)

    def fold(self, telemetry: MoETelemetry) -> None:
        """The listener's seconds per layer into the telemetry (when it is read)."""
        for layer, seconds in enumerate(self.doorbell.fold()[:, SECONDS].tolist()):
            telemetry.layers[layer].cpu_time_s += seconds
