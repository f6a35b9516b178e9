"""A layer step decided on the device (`offload`'s and `hybrid`'s decode calls): the plan
(moe/device_control.py), the fills it lists (moe/fills.py), the grouped kernel over hits and
fills, and the CPU's share as the strategy runs it (moe/cpu_share.py), all device work with no
host sync, so the step's CUDA graph holds the layer.

    (join)     a prefetch of this layer (moe/prefetch.py): its plan, before this plan
    plan       lookup, split, victims, tables and policy state updated; hybrid: the CPU's
               routes written for it, its doorbell rung
    (join)     the prefetch's copies, before anything reads or writes a slot
    fills      one launch copying rows from the pinned pool
    GPU        grouped_expert_forward over hits + fills | meanwhile the CPU team runs its routes
    merge      the CPU's fp32 partial added

Calls the plan cannot hold (`capturable` False) are decided on the host (moe/host_layer.py),
on the cache's host tables, brought up to date around them.
"""

from __future__ import annotations

import torch

from freetoken.kernels.grouped_experts import GROUPED_GEMM_FROM_ROUTES
from freetoken.moe.cache import ExpertCache
from freetoken.moe.cpu_share import NoCPUShare
from freetoken.moe.device_control import DeviceControl
from freetoken.moe.doorbell import CPUDoorbell
from freetoken.moe.fills import Fills
from freetoken.moe.host_layer import HostDecided
from freetoken.moe.prefetch import Prefetch
from freetoken.telemetry import MoETelemetry


def control_over(cache: ExpertCache, split, doorbell: CPUDoorbell | None) -> DeviceControl:
    """Device control over `cache` (at load, and after each re-size), its plans writing the
    CPU's share to the doorbell's buffers and ringing it, where there is one."""
    if doorbell is None:
        return DeviceControl(cache, cache.policy, split)
    return DeviceControl(cache, cache.policy, split, doorbell.inputs, doorbell.signal)


class DeviceDecided:
    def __init__(
        self,
        control: DeviceControl,
        fills: Fills,
        share: NoCPUShare,
        host: HostDecided,
        prefetch: Prefetch,
    ):
        """`prefetch`: a layer's predicted misses filled a layer ahead (moe/prefetch.py), its
        `experts` 0 for none."""
        self.control, self.fills, self.share, self.host = control, fills, share, host
        self.cache, self.act = host.cache, host.act
        self.num_experts = host.store.num_experts
        self.expert_bytes = host.store.shape.nbytes
        self.prefetch = prefetch

    def capturable(self, tokens: int, routes: int) -> bool:
        """Whether a call of this shape is decided here (a decode graph holds it)."""
        return (
            self.control.fits(routes)
            and routes < GROUPED_GEMM_FROM_ROUTES
            and not self.host.streams(tokens)
        )

    def __call__(self, moe_layer, x, ids, weights) -> torch.Tensor:
        if self.capturable(x.shape[0], ids.numel()):
            return self._decided(moe_layer, x, ids, weights)
        self.prefetch.join()
        with self.control.host_tables():  # the host decides this call
            return self.host(moe_layer, x, ids, weights)

    def prefetcher(self, tokens: int, routes: int) -> Prefetch | None:
        """The prefetch (`Prefetch.ahead`) where the next call, of this shape, will
        be decided here and a prefetch is on; else None."""
        if self.prefetch.experts <= 0 or not self.capturable(tokens, routes):
            return None
        if self.control.device.type == "cuda" and not self.control.fused_for(routes):
            return None  # (the torch plan reads p on the host: a graph would freeze it)
        return self.prefetch

    def _decided(self, moe_layer, x, ids, weights) -> torch.Tensor:
        """Decide, fill and compute on the device; the CPU's share meanwhile."""
        pairs = ids + moe_layer * self.num_experts
        control = self.control
        shape, start, end = self.share.signals(moe_layer, ids)
        self.prefetch.before_plan()
        slots, fill_pairs, fill_slots = control.plan(moe_layer, pairs, weights, x, shape, start)
        self.prefetch.join()
        self.fills.launch(fill_pairs, fill_slots)
        out = self.cache.compute(x, slots, weights, self.act)
        return self.share.merge(control, moe_layer, x, ids, out, end)

    def foldable(self, tokens: int, routes: int) -> bool:
        return self.host.foldable(tokens, routes)

    def host_phase(self, moe_layer, x, ids, weights, slots, partial, packed=None) -> None:
        """A folded call's host phase (one the plan cannot hold, in a decode graph): decided
        on the host tables, brought up to date around it as for `__call__`'s host calls."""
        self.prefetch.join()
        with self.control.host_tables():
            self.host.host_phase(moe_layer, x, ids, weights, slots, partial, packed)

    def rebuild_control(self) -> None:
        """Decide over the cache bound now (after a re-size)."""
        self.control = control_over(self.cache, self.control.split, self.share.doorbell)
        self.prefetch.rebind(self.control)

    def fold_counters(self, telemetry: MoETelemetry) -> None:
        """The counters the device keeps, into the telemetry."""
        counts = self.control.take_counters().tolist()
        for layer, (calls, accesses, hits, fills, cpu, cpu_routes, ahead) in enumerate(counts):
            telemetry.record(
                layer,
                calls=calls,
                accesses=accesses,
                hits=hits,
                fills=fills,
                cpu=cpu,
                cpu_routes=cpu_routes,
                prefetches=ahead,
                bytes_h2d=(fills + ahead) * self.expert_bytes,
            )

    def fold(self, telemetry: MoETelemetry) -> None:
        """Every count kept outside the telemetry: the device's, the CPU listener's."""
        self.fold_counters(telemetry)
        self.share.fold(telemetry)
