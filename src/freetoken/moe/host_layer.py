"""A layer step the host decides: `static`'s and `cpu`'s calls, and those `offload` and
`hybrid` cannot decide on the device (long prefill chunks, streamed layers, a cache smaller
than a call's routes, or device control off).

    pairs = moe_layer * E + ids                  flat (layer, expert) ids, on the device
    -- one host round trip: the routed pairs --  (moe/round_trip.py)
    slots = cache.slot_of[pairs]                 hits have a slot, misses -1 (host tables)
    misses M (distinct pairs); F = the misses    the strategy's miss split (moe/split.py)
      to fill, best first by the policy
    CPU  C = M - F: its job started              (moe/cpu_share.py) while the host
    fills: victims, copies queued                (moe/fills.py) waits for nothing
    GPU  hits + F, one grouped kernel by slot    after the fill event
    out = GPU partial + CPU partial              every route computed once, on one side

Eagerly (`__call__`), or split in two around a decode graph (engine/cuda_graphs.py): the
`host_phase` between two graph segments, the `device_phase` (the GPU kernel, reading what the
host phase left in device buffers) in the segment after it. Calls of `--prefill-stream-threshold`
tokens or more stream whole layers instead (moe/prefill.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.config import MoEOptions
from freetoken.kernels.grouped_experts import GROUPED_GEMM_FROM_ROUTES
from freetoken.moe.cache import ExpertCache
from freetoken.moe.cpu_share import HostCPUShare, StartedJob
from freetoken.moe.fills import Fills
from freetoken.moe.prefill import LayerStreamer
from freetoken.moe.round_trip import RoundTrip, pack_bytes
from freetoken.moe.split import MissSplit
from freetoken.moe.steps import UntimedSteps
from freetoken.moe.store import HostExpertStore
from freetoken.telemetry import MoETelemetry


@dataclass
class _LayerPlan:
    """What a layer step's host phase decided and started."""

    gpu_slots: np.ndarray | None = None  # [T, k] slot of each GPU route, -1 elsewhere
    cpu: StartedJob | None = None


@dataclass
class HostDecided:
    store: HostExpertStore
    device: torch.device
    cache: ExpertCache | None
    options: MoEOptions
    act: str
    telemetry: MoETelemetry
    split: MissSplit  # which misses are filled (the strategy's choice)
    fills: Fills
    cpu: HostCPUShare | None
    steps: UntimedSteps  # the step clock, told of each round trip and asked the step's way
    streamer: LayerStreamer | None = None

    def __post_init__(self):
        self.round_trip = RoundTrip(self.device)
        self._partial_dirty: set[int] = set()  # decode graphs' CPU partial buffers not zero

    def capturable(self, tokens: int, routes: int) -> bool:
        return False  # the host decides: a graph cannot hold the call

    def fold(self, telemetry: MoETelemetry) -> None:
        """(Every count is kept in the telemetry as it happens.)"""

    def streams(self, tokens: int) -> bool:
        """Whether a call of this many tokens streams whole expert layers (moe/prefill.py)."""
        threshold = self.options.prefill_stream_threshold
        return self.streamer is not None and threshold is not None and tokens >= threshold

    def __call__(self, moe_layer, x, ids, weights) -> torch.Tensor:
        """The layer eagerly: the GPU kernel is queued before waiting for the CPU share."""
        if self.streams(x.shape[0]):
            return self.streamer.forward(moe_layer, x, ids, weights)
        started = time.perf_counter()
        plan = self._start_layer(moe_layer, x, ids, weights)
        out = None
        if plan.gpu_slots is not None:
            slots = self.round_trip.to_device(plan.gpu_slots, "slots")
            out = self.cache.compute(x, slots, weights, self.act)
        if plan.cpu is not None:
            partial = self.cpu.finish(moe_layer, plan.cpu)
            cpu_out = self.round_trip.to_device(partial, "partial", x.dtype)
            out = cpu_out if out is None else out + cpu_out
        self.telemetry.layers[moe_layer].host_time_s += time.perf_counter() - started
        return out

    # -- split into a host phase and a capturable device phase (decode graphs) --------------

    def foldable(self, tokens: int, routes: int) -> bool:
        """Whether a decode graph may hold this layer's GPU work (`device_phase`), leaving
        the host only `host_phase`: with a cache, for calls that neither stream whole layers
        nor take the grouped-GEMM path."""
        return (
            self.cache is not None
            and not self.streams(tokens)
            and routes < GROUPED_GEMM_FROM_ROUTES
        )

    def pack_round_trip(self, x, ids, weights) -> torch.Tensor | None:
        """The bytes `host_phase` reads back, packed on the device: a decode graph computes
        this at the end of the segment before the layer, so the host phase only copies it
        (on the H200 machine the round trip's packing, copy and unpacking took 0.26 ms a layer)."""
        return pack_bytes([ids, x, weights]) if self.device.type == "cuda" else None

    def host_phase(
        self, moe_layer, x, ids, weights, slots: torch.Tensor, partial: torch.Tensor, packed=None
    ):
        """Everything of the layer but its GPU kernel: decide, queue the fills (the current
        stream waits for them), run the CPU share, and leave in the device buffers what
        `device_phase` reads: each route's slot (-1 where the CPU or nobody computes it) and
        the CPU partial (zeros without CPU routes). `packed`: `pack_round_trip`'s result."""
        started = time.perf_counter()
        plan = self._start_layer(moe_layer, x, ids, weights, packed)
        gpu_slots = plan.gpu_slots
        if gpu_slots is None:
            gpu_slots = np.full(ids.shape, -1, dtype=np.int64)
        slots.copy_(self.round_trip.pinned(gpu_slots, "slots"), non_blocking=True)
        if plan.cpu is not None:
            host = self.cpu.finish(moe_layer, plan.cpu)
            partial.copy_(self.round_trip.pinned(host, "partial", partial.dtype), non_blocking=True)
            self._partial_dirty.add(partial.data_ptr())
        elif partial.data_ptr() in self._partial_dirty:
            partial.zero_()
            self._partial_dirty.discard(partial.data_ptr())
        self.telemetry.layers[moe_layer].host_time_s += time.perf_counter() - started

    def device_phase(self, x, slots, weights, partial) -> torch.Tensor:
        """The layer's GPU work from `host_phase`'s buffers: the same sum as the eager path
        (adding zeros where one side has no routes changes nothing)."""
        return self.cache.compute(x, slots, weights, self.act) + partial

    # -- the host's decisions ---------------------------------------------------------------

    def expects_cpu_job(self, moe_layer: int, tokens: int, device: torch.device) -> bool:
        """Whether this layer step will likely hand routes to the CPU, before its routing is
        known (the team then wakes while the host waits for the routing): decode steps on a
        GPU (`device`), as the strategy's miss split says."""
        if (
            self.cpu is None
            or device.type != "cuda"  # no wait for the device to hide the wake-up in
            or tokens >= self.options.fill_all_from_tokens
        ):
            return False
        return self.split.expects_cpu(moe_layer, self.steps.mode)

    def _start_layer(self, moe_layer, x, ids, weights, packed=None) -> _LayerPlan:
        """The host round trip, the decisions, the fills and the CPU job's start."""
        cache, E, tokens = self.cache, self.store.num_experts, x.shape[0]
        self.fills.drain_timings()
        # The host round trip every layer makes: which pairs are routed. The decisions below
        # are numpy on a handful of ids (a microsecond an op; a torch op on a tiny tensor costs
        # 5-10, and on the H200 machine this phase once took 0.25 ms a layer).
        began = time.perf_counter()
        if self.expects_cpu_job(moe_layer, tokens, self.device):
            self.cpu.prepare()
        (ids_h, x_h, weights_h), sync_wait = self.round_trip.fetch([ids, x, weights], packed)
        self.steps.at_layer(moe_layer, tokens)
        fetched = time.perf_counter()
        pairs = ids_h.numpy() + moe_layer * E  # [T, k]
        missed, routed, misses = _lookup(cache, pairs)
        hits = len(routed) - len(misses)
        fill = self.split.choose(cache, moe_layer, misses, hits, tokens, self.steps.mode)
        cpu_routes = missed
        if len(fill):
            filled = (pairs[..., None] == fill).any(-1)  # np.isin costs ~10x on a few ids
            cpu_routes = missed & ~filled if len(fill) < len(misses) else None
        plan = _LayerPlan()
        planned = time.perf_counter()
        # The CPU job first, so the CPU works while the host chooses victims and queues fills.
        if cpu_routes is not None and cpu_routes.any():
            plan.cpu = self.cpu.start(cpu_routes, pairs, x_h, weights_h)
        started = time.perf_counter()
        if len(fill):
            self.fills.place(moe_layer, fill, cache.slot_of.numpy()[pairs[~missed]])
        filled = time.perf_counter()
        self.split.observe(cache, moe_layer, routed)
        counters = self.telemetry.layers[moe_layer]
        counters.round_trip_s += fetched - began
        counters.plan_s += planned - fetched
        counters.cpu_start_s += started - planned
        counters.fill_s += filled - started
        counters.policy_s += time.perf_counter() - filled
        if hits or len(fill):
            plan.gpu_slots = cache.slot_of.numpy()[pairs]
            if cpu_routes is not None:
                plan.gpu_slots[cpu_routes] = -1
        self.telemetry.record(
            moe_layer,
            accesses=len(routed),
            hits=hits,
            fills=len(fill),
            cpu=len(misses) - len(fill),
            cpu_routes=0 if cpu_routes is None else int(cpu_routes.sum()),
            bytes_h2d=len(fill) * self.store.shape.nbytes,
        )
        counters.sync_wait_s += sync_wait
        return plan


def _lookup(cache: ExpertCache | None, pairs: np.ndarray):
    """(missed [T, k]: the routes whose expert is not cached, the distinct routed pairs, the
    distinct missed ones) of the routed `pairs` [T, k]; with no cache, every route misses."""
    if cache is not None:
        missed = cache.slot_of.numpy()[pairs] < 0
    else:
        missed = np.ones(pairs.shape, dtype=bool)
    # distinct pairs: a token's routes are distinct already
    routed = pairs.reshape(-1) if len(pairs) == 1 else np.unique(pairs)
    misses = pairs[missed] if len(pairs) == 1 else np.unique(pairs[missed])
    return missed, routed, misses
