"""Counters and timings the components report; snapshots feed `/v1/stats` and `/metrics`."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field


@dataclass
class LayerCounters:
    """Per MoE layer, summed over decode/prefill steps. Counts are of distinct (layer, expert)
    pairs per step, the unit the cache works in; `cpu_routes` counts (token, expert) routes."""

    calls: int = 0  # layer steps (one per forward through the layer)
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    fills: int = 0  # misses copied into the cache over PCIe and run on the GPU
    cpu: int = 0  # misses run on the CPU from host memory
    cpu_routes: int = 0
    prefetches: int = 0  # experts copied a layer ahead, on predicted routes (moe/prefetch.py)
    bytes_h2d: int = 0
    host_time_s: float = 0.0  # wall time the host spent in the layer's expert step
    sync_wait_s: float = 0.0  # of which: waiting for the device in round trips
    cpu_wait_s: float = 0.0  # of which: waiting for the CPU job after the GPU work was queued
    cpu_time_s: float = 0.0  # wall time of the layer's CPU jobs (on their own thread)
    # Of host_time_s, by phase (the rest: moving slots and the CPU partial to the device, and
    # in eager steps launching the GPU kernels):
    round_trip_s: float = 0.0  # routed pairs, x and weights to the host (sync_wait_s included)
    plan_s: float = 0.0  # lookup, split, ranking the misses
    cpu_start_s: float = 0.0  # preparing and starting the CPU job
    fill_s: float = 0.0  # choosing victims and queuing the copies
    policy_s: float = 0.0  # the policy's update with this visit


@dataclass
class MoETelemetry:
    layers: list[LayerCounters] = field(default_factory=list)

    @classmethod
    def for_layers(cls, n: int) -> MoETelemetry:
        return cls([LayerCounters() for _ in range(n)])

    def record(
        self,
        layer: int,
        *,
        calls: int = 1,
        accesses: int,
        hits: int,
        fills: int,
        cpu: int,
        cpu_routes: int,
        bytes_h2d: int,
        prefetches: int = 0,
    ) -> None:
        c = self.layers[layer]
        c.calls += calls
        c.accesses += accesses
        c.hits += hits
        c.misses += accesses - hits
        c.fills += fills
        c.cpu += cpu
        c.cpu_routes += cpu_routes
        c.prefetches += prefetches
        c.bytes_h2d += bytes_h2d

    def total(self) -> LayerCounters:
        t = LayerCounters()
        for c in self.layers:
            for k, v in asdict(c).items():
                setattr(t, k, getattr(t, k) + v)
        return t

    def snapshot(self) -> dict:
        total = self.total()
        calls = max(1, total.calls)
        return {
            "hit_rate": total.hits / total.accesses if total.accesses else 1.0,
            "mean_misses_per_layer_step": total.misses / calls,
            "mean_fills_per_layer_step": total.fills / calls,  # q
            "mean_cpu_per_layer_step": total.cpu / calls,  # m - q
            "mean_prefetches_per_layer_step": total.prefetches / calls,
            "total": asdict(total),
            "layers": [asdict(c) for c in self.layers],
        }

    def reset(self) -> None:
        self.layers = [LayerCounters() for _ in self.layers]


@dataclass
class PrefixReuseTelemetry:
    """Per request: prompt tokens, tokens reused from the prefix cache (KV pages, and for
    hybrid models the anchor's recurrent state), tokens recomputed, the anchor used."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    anchor_restores: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))

    def record(self, prompt_tokens: int, reused: int, anchor: int | None) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += reused
        self.recomputed_tokens += prompt_tokens - reused
        self.anchor_restores += anchor is not None
        self.recent.append(
            {
                "prompt_tokens": prompt_tokens,
                "reused_tokens": reused,
                "recomputed_tokens": prompt_tokens - reused,
                "anchor": anchor,
            }
        )

    def snapshot(self) -> dict:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "anchor_restores": self.anchor_restores,
            "recent": list(self.recent),
        }
