"""Per-layer orchestration of routed experts: cache lookup, miss split, CPU and GPU paths,
exact merge. Installed as the executor of every MoE block.

For one layer of one step (x [T, H], routed ids [T, k], gate weights [T, k]):

    pairs = moe_layer * E + ids                  flat (layer, expert) ids, on the device
    -- one host round trip: the routed pairs --
    slots = cache.slot_of[pairs]                 hits have a slot, misses -1 (host tables)
    misses M (distinct pairs); q = split(|M|)    strategy and measured bandwidths decide q
    fill F (q misses, best first by the policy)  host -> device slots on the copy stream
    CPU  C (the other misses)                    routes of C run on the CPU thread meanwhile
    GPU  hits + F, one grouped kernel by slot    after the fill event
    out = GPU partial + CPU partial              every route computed once, on one side

`offload`'s and `hybrid`'s decode calls skip the host entirely (moe/device_control.py): the
lookup, the split, the victims and the table updates are tensor ops on the device, the fills a
device-launched copy from the pinned pool (kernels/expert_fill.py), and hybrid's CPU share is
handed to the CPU team and collected through words of mapped memory (moe/doorbell.py), so the
layer, like `fused`'s, is captured in the step's CUDA graph. Calls the host must decide (long
prefill chunks, streamed layers, a cache smaller than a call's routes) work on the host
tables, synchronised with the device's around them.

Strategies (moe/strategies.py says what each does; the runtime reads that, not names):
`fused` (every expert resident), `offload` (every miss filled), `cpu` (every miss on the CPU,
no cache), `hybrid` (the split), `static` (a fixed set chosen at load stays on the GPU, the
rest always on the CPU: llama.cpp's and KTransformers' placement, kept as a baseline), `auto`
(fused when everything fits, else hybrid).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.config import MoEOptions, parse_size
from freetoken.kernels import cache_control
from freetoken.kernels.expert_fill import HostRows, fill_experts, fill_table
from freetoken.kernels.grouped_experts import GROUPED_GEMM_FROM_ROUTES, grouped_expert_forward
from freetoken.moe.bandwidth import BandwidthProfile, load_profile
from freetoken.moe.cache import ExpertCache, host_array
from freetoken.moe.cpu import CPUExpertExecutor, CPUJob
from freetoken.moe.device_control import DeviceControl
from freetoken.moe.doorbell import SECONDS, CPUDoorbell
from freetoken.moe.policy import ExpectedNextUsePolicy, default_policy, make_policy
from freetoken.moe.prefill import LayerStreamer
from freetoken.moe.split import (
    CPU,
    FILL,
    SPLIT,
    BandwidthTracker,
    StepClock,
    StepModes,
    split_misses,
    split_parameters,
)
from freetoken.moe.store import HostExpertStore
from freetoken.moe.strategies import KINDS
from freetoken.telemetry import MoETelemetry

log = logging.getLogger(__name__)

# When the split would fill this share of the misses anyway, the CPU path is not worth its cost:
# on the H200 host (B_P' 41-49 GB/s, B_H' 4-8 GB/s, 86% filled) each CPU job's fixed cost
# (handoff, waiting, ~0.7 ms) exceeded the PCIe time it saved, and hybrid ran 25-35% below
# offload (benchmarks/results/2026-11-29-decode-offload-h200.md).
OFFLOAD_FILL_FRACTION = 0.8
# A decode step whose MoE work starts this long after the last one's ended is not counted by
# StepModes: back to back, the gap (the last layers, the sampler, the next step's launch and
# first attention) is ~1 ms; after a longer pause (a prefill, no requests, another benchmark
# contender's turn) the CPU team's cores come back slowly (on the H200 machine a split step
# after 15 ms of CPU idleness took 37% longer).
IDLE_GAP_SECONDS = 3e-3
# Bandwidths assumed until a profile (`ft bench bw`) or the running averages say otherwise:
# the pinned PCIe gen4/5 copy and torch's CPU GEMV measured on the GPU host, with both running.
DEFAULT_FILL_BANDWIDTH = 50e9
DEFAULT_CPU_BANDWIDTH = 34e9


def parse_cache_size(value: str, expert_bytes: int) -> int:
    """`--moe-cache-size`: a slot count ("300") or a byte size ("8GiB", "512MB")."""
    try:
        number, is_bytes = parse_size(value)
    except ValueError:
        msg = f"cannot read cache size {value!r}: use a slot count or e.g. 8GiB"
        raise ValueError(msg) from None
    return int(number) // expert_bytes if is_bytes else int(number)


@dataclass
class _LayerPlan:
    """What a layer step's host phase decided and started."""

    num_tokens: int
    gpu_slots: np.ndarray | None = None  # [T, k] slot of each GPU route, -1 elsewhere
    cpu: object | None = None  # the CPU job's handle
    tokens: np.ndarray | None = None  # rows of x the CPU job reads
    all_tokens: bool = True


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
        streamer: LayerStreamer | None = None,
        control: DeviceControl | None = None,
        doorbell: CPUDoorbell | None = None,
    ):
        """`control`: decode calls decided on the device; with a split (hybrid's), whose CPU
        share runs through `doorbell` on CUDA and on the executor at once on the CPU tier."""
        self.store, self.device, self.strategy = store, device, strategy
        self.kind = KINDS[strategy]  # what the strategy does (moe/strategies.py)
        self.cpu, self.options, self.act = cpu, options, act
        self.tracker = tracker or BandwidthTracker(DEFAULT_FILL_BANDWIDTH, DEFAULT_CPU_BANDWIDTH)
        self._telemetry = MoETelemetry.for_layers(store.num_layers)
        self.control, self.doorbell = control, doorbell
        # the host pool as the device-launched fills read it (by address on CUDA)
        self._pool = store.banks
        if device.type == "cuda":
            self._pool = tuple(HostRows(bank) for bank in self._pool)
        self._doorbell_errors = 0  # the listener's failures already reported
        self.streamer = streamer
        self._bind_cache(cache)
        self._pending_fill_timing: list[tuple] = []
        self._pinned_buffers: dict[tuple, object] = {}  # see `_pinned` and `_fetch`
        self._partial_dirty: set[int] = set()  # decode graphs' CPU partial buffers not zero
        self.step_modes = StepModes()
        self._step: tuple[float | None, int, str] | None = None  # (start, tokens, mode)
        self._clock = StepClock(device)  # device-decided steps' times (begin_step, end_step)
        # the split the plans read, as the host rewrites it (a view made once: numpy's write
        # costs a microsecond, a tensor op 5-25)
        self._split_values = self._split.numpy() if self._split is not None else None
        self._timed = None  # the last such step, its clock stopped: (tokens, mode)
        # `static`'s placement never changes: the layers whose steps may give the CPU routes
        self._static_cpu_layers = set()
        if self.kind.fixed_placement:
            on_cpu = (cache.slot_of.numpy() < 0).reshape(store.num_layers, -1).any(1)
            self._static_cpu_layers = set(np.flatnonzero(on_cpu).tolist())

    @property
    def _split(self) -> torch.Tensor | None:
        """The (f, lo, hi) the device's plans read (hybrid deciding on the device), or None."""
        return self.control.split if self.control is not None else None

    def _bind_cache(self, cache: ExpertCache | None) -> None:
        """Make `cache` the one every path uses (the fills' destination, the streamer's)."""
        self.cache = cache
        if self.streamer is not None:
            self.streamer.cache = cache
        if cache is not None:
            self._fill_banks = tuple(zip(cache.banks, self._pool, strict=True))
            # the fill kernel's table, built here once (a graph capture could not build it)
            self._fill_table = fill_table(self._fill_banks) if cache.device.type == "cuda" else None

    @property
    def telemetry(self) -> MoETelemetry:
        """The counters, with those the device keeps (device-decided calls) folded in."""
        self._fold_device_counters()
        self._fold_cpu_share()
        return self._telemetry

    def _fold_device_counters(self) -> None:
        if self.control is not None:
            counts = self.control.take_counters().tolist()
            for layer, (calls, accesses, hits, fills, cpu, cpu_routes) in enumerate(counts):
                self._telemetry.record(
                    layer, calls=calls, accesses=accesses, hits=hits, fills=fills, cpu=cpu,
                    cpu_routes=cpu_routes, bytes_h2d=fills * self.store.shape.nbytes,
                )  # fmt: skip

    def _fold_cpu_share(self) -> None:
        """The doorbell listener's seconds per layer into the telemetry (when it is read)."""
        if self.doorbell is None:
            return
        for layer, seconds in enumerate(self.doorbell.fold()[:, SECONDS].tolist()):
            self._telemetry.layers[layer].cpu_time_s += seconds

    def _observe_cpu_bandwidth(self) -> None:
        """The CPU share's bandwidth over the last step's layers into the tracker, as one
        observation (per layer, the loop cost ~40 us of host time a step on the H200
        machine); the CPU tier observes each job as it runs it."""
        seconds, experts = self.doorbell.totals()
        if seconds > 0:
            self.tracker.observe_cpu(int(experts * self.store.shape.nbytes), seconds)

    def begin_step(self, tokens: int, decode: bool) -> None:
        """Called before every forward: for hybrid deciding on the device, the last decode
        step's time given to `StepModes`, this step's way chosen and its split written where
        the plans read it."""
        if self.cache is not None:
            self.cache.settle()  # (a warm start's fills, left running by the build)
        if self._split is None:
            return
        self._check_doorbell()
        self._observe_timed_step()
        self._step = None
        if not decode or tokens >= self.options.fill_all_from_tokens:
            return
        if self.doorbell is not None:
            self._observe_cpu_bandwidth()
        mode = self.step_modes.choose(tokens)
        self._clock.start()
        self._step = (None, tokens, mode)  # (its start is the clock's)
        self._split_values[:] = split_parameters(
            mode, self.tracker.fill, self.tracker.cpu, self.options.max_fetch
        )

    def _check_doorbell(self) -> None:
        """A layer step the listener could not serve (no thread or memory for its job) was
        computed without its CPU share: fail the step after it rather than go on silently."""
        if self.doorbell is None:
            return
        errors = self.doorbell.errors
        if errors != self._doorbell_errors:
            missed, self._doorbell_errors = errors - self._doorbell_errors, errors
            raise RuntimeError(
                f"the CPU expert listener could not run {missed} layer step(s) (no thread or "
                "memory for the job): the last decode step lacked their CPU share"
            )

    def end_step(self, timed: bool = True) -> None:
        """Called after every forward was queued; `timed` False for a step whose time says
        nothing of its way (one that captured a decode graph)."""
        if self._step is not None and self._split is not None and timed:
            self._clock.stop()
            self._timed = self._step[1:]

    def _observe_timed_step(self) -> None:
        # (read after an untimed step too, a capture say: the clock then knows where it ended,
        # and the next step's gap is measured from there)
        timing = self._clock.seconds()
        if self._timed is not None:
            tokens, mode = self._timed
            # (a step after an idle gap is not counted: the CPU team's cores are slow to wake)
            if timing is not None and timing[1] < IDLE_GAP_SECONDS:
                self.step_modes.observe(tokens, mode, timing[0])
            self._timed = None

    def resize_cache(self, num_slots: int) -> None:
        """Give the expert cache `num_slots` slots, between steps (the engine thread, no step
        in flight), keeping what the policy values most and, with `warm_cache`, filling new
        slots; the host pool is untouched. Decode graphs must be captured again after it (they
        hold the old banks). Only strategies that fill their cache on demand can."""
        if not self.kind.fills:
            raise ValueError(f"the {self.strategy} strategy's expert cache cannot be resized")
        num_slots = min(num_slots, self.store.num_pairs)
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        if self.control is not None:
            self.control.push_host_tables()
            self._fold_device_counters()  # before the control holding them is replaced
        refill = warm_order(self.store) if self.options.warm_cache else ()
        self._fill_banks = ()  # (the old banks may be freed before the new ones are made)
        try:
            resized = self.cache.resized(num_slots, refill)
        except Exception:
            if self.cache.w_gate_up is not None:
                self._bind_cache(self.cache)  # untouched: serving goes on with it
            raise
        self._bind_cache(resized)
        num_slots = resized.num_slots  # (fewer where the device held no more)
        if self.control is not None:
            self.control = _control_of(self.cache, self._split, self.doorbell)
        log.info("expert cache resized to %d slots of %d", num_slots, self.store.num_pairs)

    def capturable(self, tokens: int, routes: int) -> bool:
        """Whether a call of this shape runs on the device alone (a decode graph holds it)."""
        if self.kind.resident:
            return self.cpu is None
        return self._decided_on_device(tokens, routes)

    def _decided_on_device(self, tokens: int, routes: int) -> bool:
        return (
            self.control is not None
            and self.control.fits(routes)
            and routes < GROUPED_GEMM_FROM_ROUTES
            and not self._streams(tokens)
        )

    # -- the executor --------------------------------------------------------------------

    def __call__(
        self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.kind.resident:
            # Every expert is resident: no lookup, no host round trip, nothing to count but calls.
            self._telemetry.layers[moe_layer].calls += 1
            pairs = ids + moe_layer * self.store.num_experts
            t, k = ids.shape
            if self.cpu is not None and t * k < GROUPED_GEMM_FROM_ROUTES:
                # A CPU-only machine, where the pool is the cache: decode-sized calls run on the
                # native kernel (about twice torch's bf16 GEMV), long chunks on torch's GEMMs.
                rows = torch.arange(t).repeat_interleave(k)
                job = CPUJob(x, rows, pairs.reshape(-1), weights.reshape(-1))
                return self.cpu.submit(job).result().out.to(x.dtype)
            return self._gpu(x, pairs, weights)
        if self._decided_on_device(x.shape[0], ids.numel()):
            return self._device_layer(moe_layer, x, ids, weights)
        if self.control is not None:
            # The host decides this call: on the host tables, brought up to date around it.
            self.control.push_host_tables()
            try:
                return self._host_layer(moe_layer, x, ids, weights)
            finally:
                self.control.pull_host_tables()
        return self._host_layer(moe_layer, x, ids, weights)

    def _host_layer(self, moe_layer, x, ids, weights) -> torch.Tensor:
        if self._streams(x.shape[0]):
            return self.streamer.forward(moe_layer, x, ids, weights)
        return self._split_layer(moe_layer, x, ids, weights)

    def _device_layer(self, moe_layer, x, ids, weights) -> torch.Tensor:
        """Decide, fill and compute on the device (moe/device_control.py); hybrid's CPU share
        meanwhile, through the doorbell (moe/doorbell.py)."""
        pairs = ids + moe_layer * self.store.num_experts
        bell, control, clock = self.doorbell, self.control, self._clock
        shape, start, end = 0, None, None
        if bell is not None:  # hybrid on CUDA: the CPU's share, and its steps clocked (begin_step)
            shape = bell.shape_value(moe_layer, *ids.shape)
            start = clock.start_stamp if moe_layer == 0 else None
            end = clock.end_stamp if moe_layer == self.store.num_layers - 1 else None
        slots, fill_pairs, fill_slots = control.plan(moe_layer, pairs, weights, x, shape, start)
        fill_experts(self._fill_banks, fill_pairs, fill_slots, self.cache.num_slots,
                     self._fill_table)  # fmt: skip
        out = self._gpu(x, slots, weights)
        if not self.kind.splits:
            return out  # offload: no CPU share
        if bell is not None:
            out = out.contiguous()
            bell.merge_(out, control.cpu_flag, end)
            return out
        return out + self._cpu_share(moe_layer, x, ids.numel()).to(x.dtype)

    def _cpu_share(self, moe_layer: int, x: torch.Tensor, routes: int) -> torch.Tensor:
        """The CPU tier's doorbell: the routes the plan left to the CPU, run now (fp32)."""
        pairs = self.control.cpu_pairs[:routes]
        ours = pairs >= 0
        if not ours.any():
            return torch.zeros(x.shape, dtype=torch.float32)
        rows = torch.arange(routes) // (routes // x.shape[0])
        weights = self.control.cpu_weights[:routes][ours]
        result = self.cpu.submit(CPUJob(x, rows[ours], pairs[ours], weights)).result()
        self.tracker.observe_cpu(result.weight_bytes, result.seconds)
        self._telemetry.layers[moe_layer].cpu_time_s += result.seconds
        return result.out

    def _streams(self, tokens: int) -> bool:
        """Whether a call of this many tokens streams whole expert layers (moe/prefill.py)."""
        threshold = self.options.prefill_stream_threshold
        return self.streamer is not None and threshold is not None and tokens >= threshold

    def _gpu(self, x, slots, weights) -> torch.Tensor:
        w = self.cache.weights
        return grouped_expert_forward(x, slots, weights, w.gate_up, w.down, self.act, w.bias)

    def _split_layer(self, moe_layer, x, ids, weights) -> torch.Tensor:
        """The layer eagerly: the GPU kernel is queued before waiting for the CPU share."""
        started = time.perf_counter()
        plan = self._start_layer(moe_layer, x, ids, weights)
        out = None
        if plan.gpu_slots is not None:
            out = self._gpu(x, self._to_device(plan.gpu_slots, "slots"), weights)
        if plan.cpu is not None:
            cpu_out = self._to_device(self._finish_cpu(moe_layer, plan), "partial", x.dtype)
            out = cpu_out if out is None else out + cpu_out
        self._telemetry.layers[moe_layer].host_time_s += time.perf_counter() - started
        return out

    # -- split into a host phase and a capturable device phase (decode graphs) --------------

    def foldable(self, tokens: int, routes: int) -> bool:
        """Whether a decode graph may hold this layer's GPU work (`device_phase`), leaving
        the host only `host_phase`: strategies that decide on the host and have a cache, for
        calls that neither stream whole layers nor take the grouped-GEMM path."""
        return (
            not self.kind.resident
            and self.cache is not None
            and not self._streams(tokens)
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
        slots.copy_(self._pinned(gpu_slots, "slots"), non_blocking=True)
        if plan.cpu is not None:
            host = self._finish_cpu(moe_layer, plan)
            partial.copy_(self._pinned(host, "partial", partial.dtype), non_blocking=True)
            self._partial_dirty.add(partial.data_ptr())
        elif partial.data_ptr() in self._partial_dirty:
            partial.zero_()
            self._partial_dirty.discard(partial.data_ptr())
        self._telemetry.layers[moe_layer].host_time_s += time.perf_counter() - started

    def device_phase(self, x, slots, weights, partial) -> torch.Tensor:
        """The layer's GPU work from `host_phase`'s buffers: the same sum as the eager path
        (adding zeros where one side has no routes changes nothing)."""
        return self._gpu(x, slots, weights) + partial

    def _start_layer(self, moe_layer, x, ids, weights, packed=None) -> _LayerPlan:
        """The host round trip, the decisions, the fills and the CPU job's start."""
        cache, E = self.cache, self.store.num_experts
        self._drain_fill_timings()
        # The host round trip every layer makes: which pairs are routed. The decisions below
        # are numpy on a handful of ids (a microsecond an op; a torch op on a tiny tensor costs
        # 5-10, and on the H200 machine this phase once took 0.25 ms a layer).
        began = time.perf_counter()
        if self._expects_cpu_job(moe_layer, x.shape[0]):
            self.cpu.prepare()  # the team wakes while the host waits for the routing
        (ids_h, x_h, weights_h), sync_wait = self._fetch([ids, x, weights], packed)
        self._clock_step(moe_layer, x.shape[0])
        fetched = time.perf_counter()
        pairs = ids_h.numpy() + moe_layer * E  # [T, k]
        if cache is not None:
            missed = cache.slot_of.numpy()[pairs] < 0
        else:
            missed = np.ones(pairs.shape, dtype=bool)
        # distinct pairs: a token's routes are distinct already
        routed = pairs.reshape(-1) if len(pairs) == 1 else np.unique(pairs)
        misses = pairs[missed] if len(pairs) == 1 else np.unique(pairs[missed])
        hits = len(routed) - len(misses)
        fill, policy = misses[:0], None
        if self.kind.fills:
            policy = cache.policy
            q = self._fill_count(len(misses), hits, x.shape[0])
            fill = misses[:q]
            if 0 < q < len(misses):  # the policy ranks which misses are worth a slot
                scores = host_array(policy.pair_scores(moe_layer, misses))
                fill = misses[np.argsort(-scores, kind="stable")[:q]]
        cpu_routes = missed
        if len(fill):
            filled = (pairs[..., None] == fill).any(-1)  # np.isin costs ~10x on a few ids
            cpu_routes = missed & ~filled if len(fill) < len(misses) else None
        plan = _LayerPlan(x.shape[0])
        planned = time.perf_counter()
        # The CPU job first, so the CPU works while the host chooses victims and queues fills.
        if cpu_routes is not None and cpu_routes.any():
            plan.cpu = self._submit_cpu(plan, cpu_routes, pairs, x_h, weights_h)
        started = time.perf_counter()
        if len(fill):
            protected = cache.slot_of.numpy()[pairs[~missed]]
            victims = cache.victim_candidates(moe_layer, protected, len(fill))
            # The round trip synchronised the stream: no kernel queued can still read a victim.
            events = cache.place(fill.tolist(), victims.tolist(), after_compute=False)
            fill_bytes = len(fill) * self.store.shape.nbytes
            if events is not None:
                torch.cuda.current_stream(self.device).wait_event(events[1])
                if events[0] is not None:  # a timed fill
                    self._pending_fill_timing.append((*events, fill_bytes))
            else:
                self.tracker.observe_fill(fill_bytes, cache.last_fill_seconds)
        filled = time.perf_counter()
        if policy is not None:
            # After this layer's victims are chosen (from what the earlier visits taught), off
            # the path to the fills: the host waits for them or the CPU job next.
            policy.observe(moe_layer, routed - moe_layer * E)
        counters = self._telemetry.layers[moe_layer]
        counters.round_trip_s += fetched - began
        counters.plan_s += planned - fetched
        counters.cpu_start_s += started - planned
        counters.fill_s += filled - started
        counters.policy_s += time.perf_counter() - filled
        if hits or len(fill):
            plan.gpu_slots = cache.slot_of.numpy()[pairs]
            if cpu_routes is not None:
                plan.gpu_slots[cpu_routes] = -1
        self._telemetry.record(
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

    def _expects_cpu_job(self, moe_layer: int, tokens: int) -> bool:
        """Whether this layer step will likely hand routes to the CPU, before its routing is
        known: decode steps of `cpu`, of `static` on a layer not wholly resident, and of
        `hybrid` unless its current way of stepping fills every miss."""
        if (
            self.cpu is None
            or self.device.type != "cuda"  # no wait for the device to hide the wake-up in
            or tokens >= self.options.fill_all_from_tokens
        ):
            return False
        if not self.kind.cached:
            return True
        if self.kind.fixed_placement:
            return moe_layer in self._static_cpu_layers
        if self.kind.splits:
            return self._step is None or self._step[2] != FILL
        return False

    def _submit_cpu(self, plan: _LayerPlan, cpu_routes, pairs, x_h, weights_h):
        """Start the CPU job of the routes marked in `cpu_routes` [T, k]; the tokens it reads
        are noted in `plan` for the scatter of its partial."""
        rows, cols = np.nonzero(cpu_routes)
        if plan.num_tokens == 1:
            plan.tokens, token_of_route = np.zeros(1, np.int64), rows
        else:
            plan.tokens, token_of_route = np.unique(rows, return_inverse=True)
            plan.all_tokens = len(plan.tokens) == plan.num_tokens
        x = x_h if plan.all_tokens else x_h[torch.from_numpy(plan.tokens)]
        job = CPUJob(x, token_of_route, pairs[rows, cols], weights_h.float().numpy()[rows, cols])
        return self.cpu.submit(job)

    def _finish_cpu(self, moe_layer, plan: _LayerPlan) -> torch.Tensor:
        """Wait for the layer's CPU share; its partial [T, H] (on the host)."""
        waited = time.perf_counter()
        result = plan.cpu.result()
        counters = self._telemetry.layers[moe_layer]
        counters.cpu_wait_s += time.perf_counter() - waited
        counters.cpu_time_s += result.seconds
        self.tracker.observe_cpu(result.weight_bytes, result.seconds)
        out = result.out
        if not plan.all_tokens:
            shape = (plan.num_tokens, out.shape[1])
            rows = torch.from_numpy(plan.tokens)
            out = torch.zeros(shape, dtype=out.dtype).index_copy_(0, rows, out)
        return out

    def _to_device(self, host, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host array or tensor (converted to `dtype`) on the device, through a pinned buffer
        on CUDA (from pageable memory a copy first waits for the stream, here for the fills)."""
        if self.device.type != "cuda":
            host = torch.as_tensor(host)
            return host if dtype is None else host.to(dtype)
        return self._pinned(host, name, dtype).to(self.device, non_blocking=True)

    def _pinned(self, host, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`host` (an array or tensor) copied, as `dtype`, into this runtime's pinned buffer
        for `name` and its shape, so the copy to the device is truly asynchronous. One buffer
        serves every layer: the next layer's round trip waits for the stream, so the copy out
        of it is done by then. Numpy data of the buffer's dtype is copied by numpy (a torch op
        costs 5-40 us of host time on the H200 machine)."""
        dtype = dtype or torch.as_tensor(host).dtype
        key = (name, tuple(host.shape), dtype)
        buf = self._pinned_buffers.get(key)
        if buf is None:
            buf = torch.empty(host.shape, dtype=dtype, pin_memory=self.device.type == "cuda")
            self._pinned_buffers[key] = buf
        if isinstance(host, np.ndarray) and dtype in (torch.int64, torch.float32):
            buf.numpy()[...] = host
        else:
            buf.copy_(torch.as_tensor(host))
        return buf

    def _fetch(self, tensors: list[torch.Tensor], packed=None) -> tuple[list, float]:
        """Copy device tensors to the host as one transfer with one synchronisation (each
        copy costs ~30 us of host time on the H200 machine; packing them, one kernel, which a
        decode graph runs itself: `packed`). The host views of a shape are made once. Returns
        the views and the seconds spent waiting for the device."""
        if self.device.type != "cuda":
            return tensors, 0.0
        if packed is None:
            packed = pack_bytes(tensors)
        key = ("round trip", packed.numel(), *((t.shape, t.dtype) for t in tensors))
        staged = self._pinned_buffers.get(key)
        if staged is None:
            host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
            staged = self._pinned_buffers[key] = (host, unpack_bytes(host, tensors))
        host, views = staged
        host.copy_(packed, non_blocking=True)
        waited = time.perf_counter()
        torch.cuda.current_stream(self.device).synchronize()
        return views, time.perf_counter() - waited

    def _clock_step(self, moe_layer: int, tokens: int) -> None:
        """Time hybrid decode steps in each of `StepModes`' ways: from the first MoE layer's
        round trip to the last one's, which waits for all the work of the layers before it,
        both paths of their misses included."""
        if self._split is not None:
            return  # a device-decided runtime times whole steps (begin_step, end_step)
        if not self.kind.splits or tokens >= self.options.fill_all_from_tokens:
            self._step = None
            return
        now = time.perf_counter()
        if moe_layer == 0:
            self._step = (now, tokens, self.step_modes.choose(tokens))
        elif moe_layer == self.store.num_layers - 1 and self._step is not None:
            start, step_tokens, mode = self._step
            if step_tokens == tokens:
                self.step_modes.observe(tokens, mode, now - start)

    def _fill_count(self, misses: int, hits: int, tokens: int) -> int:
        """How many misses to copy into the cache (the rest run on the CPU)."""
        if misses == 0:
            return 0
        if not self.kind.splits or tokens >= self.options.fill_all_from_tokens:
            q = misses
        else:
            mode = self._step[2] if self._step is not None else SPLIT
            if mode == CPU:
                return 0
            # A `fill` step gives the CPU no bandwidth: all filled, up to the fetch cap.
            cpu = self.tracker.cpu if mode != FILL else 0.0
            q = split_misses(misses, self.tracker.fill, cpu, self.options.max_fetch)
        # Slots this layer's hits use cannot be given up; what does not fit runs on the CPU.
        return max(0, min(q, self.cache.num_slots - hits))

    def _drain_fill_timings(self) -> None:
        """Fold finished copies' measured bandwidth into the running average (no waiting)."""
        keep = []
        for start, done, nbytes in self._pending_fill_timing:
            if done.query():
                self.tracker.observe_fill(nbytes, start.elapsed_time(done) / 1e3)
            else:
                keep.append((start, done, nbytes))
        self._pending_fill_timing = keep


def _packing_order(tensors: list[torch.Tensor]) -> list[int]:
    # Widest elements first: every part then starts at a multiple of its element size, so the
    # byte buffer can be viewed back as each dtype in place.
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())


def pack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, concatenated into one uint8 tensor (see `unpack_bytes`)."""
    return torch.cat(
        [tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in _packing_order(tensors)]
    )


def unpack_bytes(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `packed` with the shapes and dtypes of `like` (the tensors packed)."""
    out: list[torch.Tensor] = [packed] * len(like)
    offset = 0
    for i in _packing_order(like):
        t = like[i]
        nbytes = t.numel() * t.element_size()
        out[i] = packed[offset : offset + nbytes].view(t.dtype).reshape(t.shape)
        offset += nbytes
    return out


def cpu_waits(options: MoEOptions) -> dict[str, float]:
    """How the CPU expert team's idle threads wait, from the options."""
    return {"spin_us": options.cpu_spin_us, "prepare_us": options.cpu_prepare_us}


def resolve_strategy(
    options: MoEOptions,
    device: torch.device,
    store: HostExpertStore,
    cache_slots: int | None,
    profile: BandwidthProfile | None = None,
) -> str:
    """`auto`: fused when the whole pool fits the cache budget (always on a CPU-only machine,
    where host memory is the device memory); otherwise hybrid, unless the profile says the CPU
    is too slow to take a useful share of the misses, where offload saves the CPU's round trip."""
    if options.strategy != "auto":
        return options.strategy
    if device.type == "cpu" or cache_slots is None or cache_slots >= store.num_pairs:
        return "fused"
    if profile is not None and (profile.fill_fraction or 0.0) >= OFFLOAD_FILL_FRACTION:
        return "offload"
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


def warm_order(store: HostExpertStore) -> list[int]:
    """The pairs a warm cache starts with, in the order they take slots: expert 0 of every
    layer, then expert 1, ..., so a partial fill gives every layer the same share."""
    L, E = store.num_layers, store.num_experts
    return [layer * E + expert for expert in range(E) for layer in range(L)]


def build_runtime(
    store: HostExpertStore,
    device: torch.device,
    options: MoEOptions,
    act: str = "silu",
    reserve_bytes: int = 2 * 2**30,
) -> MoERuntime:
    streaming = options.strategy != "fused" and options.prefill_stream_threshold is not None
    stream_bytes = 2 * store.num_experts * store.shape.nbytes if streaming else 0
    # Sized from free memory, the cache leaves room for the two prefill layer buffers.
    slots = cache_slots_for(options, device, store, reserve_bytes + stream_bytes)
    profile = load_profile(device, store.shape)
    strategy = resolve_strategy(options, device, store, slots, profile)
    kind = KINDS[strategy]
    if not kind.resident and (
        not slots or (kind.cached and device.type == "cuda" and not store.pin())
    ):
        kind = KINDS["cpu"]  # no cache, or no pinned pool to fill it from
    cache = _cache_for(kind, store, slots, device, options)
    log.debug("expert cache made")
    cpu = None
    if not kind.resident or device.type == "cpu":
        executor = CPUExpertExecutor(store, act, options.cpu_threads, **cpu_waits(options))
        # (fused on a CPU-only machine: the native kernel for decode-sized calls, if any)
        cpu = executor if not kind.resident or executor.native is not None else None
        if not kind.resident and device.type == "cuda" and cpu.native is not None:
            # Torch's own CPU work is now only the policy's small ops: one thread, so its
            # spinning OpenMP team does not take cores from the expert kernel's.
            torch.set_num_threads(1)
    log.info(
        "MoE strategy %s, expert cache %s slots of %d",
        kind.name,
        cache.num_slots if cache is not None else 0,
        store.num_pairs,
    )
    tracker = None
    if profile is not None and profile.pcie_concurrent and profile.cpu_concurrent:
        tracker = BandwidthTracker(profile.pcie_concurrent, profile.cpu_concurrent)
    streamer = None
    if not kind.resident and streaming:
        if (
            device.type == "cuda"
            and torch.cuda.mem_get_info(device)[0] < stream_bytes + reserve_bytes
        ):
            log.warning(
                "no room for two layers of experts (%.1f GiB): long prefills fill the cache "
                "on demand, layer by layer",
                stream_bytes / 2**30,
            )
        else:
            streamer = LayerStreamer(store, cache, device, act)
    log.debug("layer streamer made")
    control = doorbell = None
    if kind.on_device and options.device_control:
        control, doorbell = _device_control(kind, store, cache, cpu, options, device)
    return MoERuntime(store, device, kind.name, cache, cpu, options, act, tracker, streamer,
                      control, doorbell)  # fmt: skip


def _cache_for(kind, store, slots, device, options) -> ExpertCache | None:
    """The strategy's expert cache: every expert resident, a fixed placement, or slots run by
    an eviction policy (with the policy device control needs, when it decides)."""
    if kind.resident:
        return ExpertCache.resident(store, device)
    if not kind.cached:
        return None
    if kind.fixed_placement:
        cache = ExpertCache(store, slots, device)
        # llama.cpp's --n-cpu-moe keeps whole layers on the CPU from the first layer on; the
        # experts of the last layers stay on the GPU.
        cache.preload(range(store.num_pairs - slots, store.num_pairs))
        return cache
    policy = make_policy(options.policy) if options.policy else default_policy()
    if kind.on_device and options.device_control and not hasattr(policy, "observe_masked"):
        # Device control needs a policy with a fixed-shape update; the default's is not
        # written yet: the closest one that has it (38.0% against 42.3% hits on gpt-oss-20b at
        # a 10% cache).
        log.info("device control: policy %s has no device form; using expected-next-use",
                 policy.name)  # fmt: skip
        policy = ExpectedNextUsePolicy()
    cache = ExpertCache(store, slots, device, policy=policy)
    if options.warm_cache:
        cache.preload(warm_order(store), wait=False)  # (settled by the first step)
    return cache


def _device_control(kind, store, cache, cpu, options, device):
    """(control, doorbell) for a strategy that decides its decode calls on the device; (None,
    None) where it cannot (hybrid on CUDA without a doorbell)."""
    split = doorbell = None
    if kind.splits:
        # (f, lo, hi) of the split, rewritten by the host before each decode step; on CUDA in
        # mapped pinned memory, which the plans read where it lies
        split = torch.tensor([1.0, 1.0, 2.0**30], pin_memory=device.type == "cuda")
        if device.type == "cuda":
            doorbell = _doorbell(store, cpu, options, device)
            if doorbell is None:
                return None, None  # hybrid decides on the host
    # The policy's state moves to the device, where the plans read and update it.
    cache.policy.reset(store.num_layers, store.num_experts, cache.num_slots, device)
    return _control_of(cache, split, doorbell), doorbell


def _control_of(cache: ExpertCache, split, doorbell: CPUDoorbell | None) -> DeviceControl:
    """Device control over `cache` (at load, and after each re-size), its plans writing the
    CPU's share to the doorbell's buffers and ringing it, where there is one."""
    if doorbell is None:
        return DeviceControl(cache, cache.policy, split)
    return DeviceControl(cache, cache.policy, split, doorbell.inputs, doorbell.signal)


def _doorbell(store, cpu, options, device) -> CPUDoorbell | None:
    """The CPU share's doorbell for hybrid deciding on the device, or None (with the reason
    logged) where the native library is missing."""
    if cpu is None or cpu.native is None:
        log.info("device control: no native CPU kernel here; hybrid decides on the host")
        return None
    # The listener thread joins each job, and spins between them, as the team does while
    # decode steps come: the team gives up two threads, so the thread driving the GPU (and
    # the driver's own) keep a core.
    threads = max(1, cpu.native.threads - 2)
    prepare = options.cpu_prepare_us * 1e-6
    return CPUDoorbell(cpu.native, store.num_layers, threads, cache_control.MAX_ROUTES, device,
                       prepare)  # fmt: skip
