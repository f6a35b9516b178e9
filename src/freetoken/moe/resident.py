"""`fused`'s layer step: every expert resident in its own slot (slot == flat id), so there is
no lookup, no host round trip and nothing to count but calls."""

from __future__ import annotations

import torch

from freetoken.kernels.grouped_experts import GROUPED_GEMM_FROM_ROUTES
from freetoken.moe.cache import ExpertCache
from freetoken.moe.cpu import CPUExpertExecutor, CPUJob
from freetoken.telemetry import MoETelemetry


class ResidentLayers:
    def __init__(
        self, cache: ExpertCache, cpu: CPUExpertExecutor | None, act: str, telemetry: MoETelemetry
    ):
        """`cpu`: the native kernel on a CPU-only machine, where the pool is the cache."""
        self.cache, self.cpu, self.act, self.telemetry = cache, cpu, act, telemetry
        self.num_experts = cache.store.num_experts

    def capturable(self, tokens: int, routes: int) -> bool:
        return self.cpu is None

    def foldable(self, tokens: int, routes: int) -> bool:
        return False  # nothing for a host phase to do

    def fold(self, telemetry: MoETelemetry) -> None:
        """(Every count is kept in the telemetry as it happens.)"""

    def __call__(self, moe_layer, x, ids, weights) -> torch.Tensor:
        self.telemetry.layers[moe_layer].calls += 1
        pairs = ids + moe_layer * self.num_experts
        t, k = ids.shape
        if self.cpu is not None and t * k < GROUPED_GEMM_FROM_ROUTES:
            # A CPU-only machine: decode-sized calls run on the native kernel (about twice
            # torch's bf16 GEMV), long chunks on torch's GEMMs.
            rows = torch.arange(t).repeat_interleave(k)
            job = CPUJob(x, rows, pairs.reshape(-1), weights.reshape(-1))
            return self.cpu.submit(job).result().out.to(x.dtype)
        return self.cache.compute(x, pairs, weights, self.act)
