"""Per-layer orchestration of routed experts: cache lookup, miss split, CPU and GPU paths,
exact merge. Installed as the executor of every MoE block.

For one layer of one step (x [T, H], routed ids [T, k], gate weights [T, k]):

    pairs = moe_layer * E + ids                  flat (layer, expert) ids, on the device
    slots = cache.slot_of[pairs]                 hits have a slot, misses -1
    -- one host round trip: the routed pairs and their slots --
    misses M (distinct pairs); q = split(|M|)    strategy and measured bandwidths decide q
    fill F (q misses, best first by the policy)  host -> device slots on the copy stream
    CPU  C (the other misses)                    routes of C run on the CPU thread meanwhile
    GPU  hits + F, one grouped kernel by slot    after the fill event
    out = GPU partial + CPU partial              every route computed once, on one side

Strategies: `fused` (every expert resident), `offload` (every miss filled), `cpu` (every miss
on the CPU, no cache), `hybrid` (the split), `static` (a fixed set chosen at load stays on the
GPU, the rest always on the CPU: llama.cpp's and KTransformers' placement, kept as a
baseline), `auto` (fused when everything fits, else hybrid).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from freetoken.kernels.grouped_experts import grouped_expert_forward
from freetoken.moe.cache import ExpertCache
from freetoken.moe.cpu import CPUExpertExecutor, CPUJob
from freetoken.moe.split import BandwidthTracker, split_misses
from freetoken.moe.store import HostExpertStore
from freetoken.telemetry import MoETelemetry

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "fused", "offload", "cpu", "hybrid", "static")
# Bandwidths assumed until a profile (`ft bench bw`) or the running averages say otherwise:
# the pinned PCIe gen4/5 copy and torch's CPU GEMV measured on the GPU host, with both running.
DEFAULT_FILL_BANDWIDTH = 50e9
DEFAULT_CPU_BANDWIDTH = 34e9
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*$", re.IGNORECASE)
_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


@dataclass(frozen=True)
class MoEOptions:
    strategy: str = "auto"
    cache_size: str | None = None  # slots ("512") or bytes ("8GiB"); None: from the budget
    policy: str | None = None  # eviction policy name; None: the default
    max_fetch: int | None = None  # hybrid: at most this many fills per layer step
    cpu_threads: int | None = None
    # Chunks of at least this many tokens fill every miss they can: the CPU runs long chunks at
    # GEMM speed, far below the GPU, so splitting them loses (streamed prefill replaces this).
    fill_all_from_tokens: int = 32

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown MoE strategy {self.strategy!r}; use one of {STRATEGIES}")
        if self.max_fetch is not None and self.max_fetch < 1:
            raise ValueError("--moe-hybrid-max-fetch must be at least 1")


def parse_cache_size(value: str, expert_bytes: int) -> int:
    """`--moe-cache-size`: a slot count ("300") or a byte size ("8GiB", "512MB")."""
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"cannot read cache size {value!r}: use a slot count or e.g. 8GiB")
    if m[2] is None:
        return int(float(m[1]))
    return int(float(m[1]) * _UNITS[m[2].lower()]) // expert_bytes


class MoERuntime:
    def __init__(
        self,
        store: HostExpertStore,
        device: torch.device,
        strategy: str,
        cache: ExpertCache | None,
        cpu: CPUExpertExecutor | None,
        options: MoEOptions,
        act: str = "silu",
        tracker: BandwidthTracker | None = None,
    ):
        self.store, self.device, self.strategy = store, device, strategy
        self.cache, self.cpu, self.options, self.act = cache, cpu, options, act
        self.tracker = tracker or BandwidthTracker(DEFAULT_FILL_BANDWIDTH, DEFAULT_CPU_BANDWIDTH)
        self.telemetry = MoETelemetry.for_layers(store.num_layers)
        self._pending_fill_timing: list[tuple] = []

    # -- the executor --------------------------------------------------------------------

    def __call__(
        self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        pairs = ids + moe_layer * self.store.num_experts
        if self.strategy == "fused":
            # Every expert is resident: no lookup, no host round trip, nothing to count but calls.
            self.telemetry.layers[moe_layer].calls += 1
            return self._gpu(x, pairs, weights)
        return self._split_layer(moe_layer, x, pairs, weights)

    def _gpu(self, x, slots, weights) -> torch.Tensor:
        cache = self.cache
        return grouped_expert_forward(x, slots, weights, cache.w_gate_up, cache.w_down, self.act)

    def _split_layer(self, moe_layer, x, pairs, weights) -> torch.Tensor:
        cache, E = self.cache, self.store.num_experts
        self._drain_fill_timings()
        slots = cache.lookup(pairs) if cache is not None else torch.full_like(pairs, -1)
        # The one host round trip of the layer: which pairs are routed, which are cached.
        pairs_h, slots_h = torch.stack((pairs, slots)).cpu()
        routed = torch.unique(pairs_h)
        cached = torch.unique(pairs_h[slots_h >= 0])
        misses = torch.unique(pairs_h[slots_h < 0])
        if cache is not None and cache.policy is not None:
            cache.policy.observe(moe_layer, (routed - moe_layer * E).to(self.device))

        fill = self._choose_fills(moe_layer, misses, num_hits=len(cached), tokens=x.shape[0])
        on_cpu = misses[~torch.isin(misses, fill)] if len(fill) else misses
        events = None
        if len(fill):
            protected = slots[slots >= 0] if len(cached) else slots.new_empty(0)
            events = cache.fill(moe_layer, fill.tolist(), protected)

        future = None
        cpu_route_mask = torch.isin(pairs_h, on_cpu) if len(on_cpu) else None
        if cpu_route_mask is not None:
            rows_h, cols_h = cpu_route_mask.nonzero(as_tuple=True)
            tokens = torch.unique(rows_h)
            x_host = x[tokens.to(x.device)].cpu()
            local = torch.searchsorted(tokens, rows_h)  # row of x_host for each CPU route
            job_weights = weights[rows_h.to(weights.device), cols_h.to(weights.device)].cpu()
            future = self.cpu.submit(CPUJob(x_host, local, pairs_h[rows_h, cols_h], job_weights))

        out = None
        fill_bytes = len(fill) * self.store.shape.nbytes
        if len(cached) or len(fill):
            gpu_slots = cache.lookup(pairs)
            if cpu_route_mask is not None:
                gpu_slots = gpu_slots.masked_fill(cpu_route_mask.to(self.device), -1)
            if events is not None:
                torch.cuda.current_stream(self.device).wait_event(events[1])
                self._pending_fill_timing.append((*events, len(fill) * self.store.shape.nbytes))
            elif len(fill):
                self.tracker.observe_fill(
                    len(fill) * self.store.shape.nbytes, cache.last_fill_seconds
                )
            out = self._gpu(x, gpu_slots, weights)
        if future is not None:
            result = future.result()
            self.tracker.observe_cpu(result.weight_bytes, result.seconds)
            cpu_out = torch.zeros_like(x)
            cpu_out[tokens.to(x.device)] = result.out.to(x.device, non_blocking=True)
            out = cpu_out if out is None else out + cpu_out
            self.telemetry.layers[moe_layer].cpu_time_s += result.seconds
        self.telemetry.record(
            moe_layer,
            accesses=len(routed),
            hits=len(cached),
            fills=len(fill),
            cpu=len(on_cpu),
            cpu_routes=0 if cpu_route_mask is None else int(cpu_route_mask.sum()),
            bytes_h2d=fill_bytes,
        )
        return out

    def _choose_fills(self, moe_layer: int, misses: torch.Tensor, num_hits: int, tokens: int):
        """The misses to copy into the cache, best first by the eviction policy's ranking."""
        m, cache = len(misses), self.cache
        if m == 0 or cache is None or self.strategy in ("cpu", "static"):
            return misses[:0]
        if self.strategy == "offload" or tokens >= self.options.fill_all_from_tokens:
            q = m
        else:
            q = split_misses(m, self.tracker.fill, self.tracker.cpu, self.options.max_fetch)
        # Slots in use by this layer's hits cannot be given up; what does not fit runs on the CPU.
        q = min(q, cache.num_slots - num_hits)
        if q <= 0:
            return misses[:0]
        if q < m and cache.policy is not None:
            scores = cache.policy.pair_scores(moe_layer, misses.to(self.device)).cpu()
            return misses[torch.argsort(scores, descending=True, stable=True)[:q]]
        return misses[:q]

    def _drain_fill_timings(self) -> None:
        """Fold finished copies' measured bandwidth into the running average (no waiting)."""
        keep = []
        for start, done, nbytes in self._pending_fill_timing:
            if done.query():
                self.tracker.observe_fill(nbytes, start.elapsed_time(done) / 1e3)
            else:
                keep.append((start, done, nbytes))
        self._pending_fill_timing = keep


def _policy(name: str | None):
    from freetoken.moe.policy import POLICIES, default_policy

    if name is None:
        return default_policy()
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; use one of {', '.join(sorted(POLICIES))}"
        ) from None


def resolve_strategy(
    options: MoEOptions, device: torch.device, store: HostExpertStore, cache_slots: int | None
) -> str:
    """`auto`: fused when the whole pool fits the cache budget (always on a CPU-only machine,
    where host memory is the device memory), otherwise hybrid."""
    if options.strategy != "auto":
        return options.strategy
    if device.type == "cpu" or cache_slots is None or cache_slots >= store.num_pairs:
        return "fused"
    return "hybrid"


def cache_slots_for(
    options: MoEOptions, device: torch.device, store: HostExpertStore, reserve_bytes: int
) -> int | None:
    """Slots the cache gets: `--moe-cache-size` if given, else what free device memory holds
    after `reserve_bytes` (activations, graphs); None on a CPU device (no separate tier)."""
    if options.cache_size is not None:
        slots = parse_cache_size(options.cache_size, store.shape.nbytes)
        if slots < 1:
            raise ValueError(
                f"--moe-cache-size {options.cache_size} holds no expert "
                f"({store.shape.nbytes / 2**20:.1f} MiB each)"
            )
        return min(slots, store.num_pairs)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, min(store.num_pairs, (free - reserve_bytes) // store.shape.nbytes))


def build_runtime(
    store: HostExpertStore,
    device: torch.device,
    options: MoEOptions,
    act: str = "silu",
    reserve_bytes: int = 2 * 2**30,
) -> MoERuntime:
    slots = cache_slots_for(options, device, store, reserve_bytes)
    strategy = resolve_strategy(options, device, store, slots)
    if strategy in ("offload", "hybrid", "static") and device.type == "cuda" and not store.pin():
        strategy = "cpu"
    if strategy == "fused":
        cache = ExpertCache.resident(store, device)
    elif strategy == "cpu" or not slots:
        strategy, cache = "cpu", None
    elif strategy == "static":
        cache = ExpertCache(store, slots, device)
        # llama.cpp's --n-cpu-moe keeps whole layers on the CPU from the first layer on; the
        # experts of the last layers stay on the GPU.
        cache.preload(range(store.num_pairs - slots, store.num_pairs))
    else:
        cache = ExpertCache(store, slots, device, policy=_policy(options.policy))
    cpu = None
    if strategy != "fused":
        cpu = CPUExpertExecutor(store, act, options.cpu_threads)
    log.info(
        "MoE strategy %s, expert cache %s slots of %d",
        strategy,
        cache.num_slots if cache is not None else 0,
        store.num_pairs,
    )
    return MoERuntime(store, device, strategy, cache, cpu, options, act)
