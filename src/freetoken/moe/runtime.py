"""The MoE runtime: the executor of every MoE block, composed of parts with one job each,
which the strategy (moe/strategies.py) and the machine choose at load (`build_runtime`).

    the layer step    ResidentLayers (fused; moe/resident.py), HostDecided (moe/host_layer.py),
                      or DeviceDecided (offload's and hybrid's decode calls, in the step's CUDA
                      graph; moe/device_layer.py), which gives the host path what it cannot hold
    miss split        which misses a host-decided step fills (moe/split.py: MissSplit)
    fills             copies into the cache, device-launched or host-queued (moe/fills.py)
    CPU share         the CPU's routes: a host-decided step's job, or a device-decided step's
                      doorbell or CPU-tier run (moe/cpu_share.py)
    step clock        hybrid's ways of stepping, timed (moe/steps.py, StepModes in split.py)
    telemetry         counters per layer (telemetry.py); those the device and the CPU
                      listener keep are folded in when read

Nothing in a layer step tests the strategy's name or flags: each part is what its strategy
does. Every route is computed exactly once, on one side, so any strategy and cache size give
a fully resident run's tokens.

Strategies: `fused` (every expert resident), `offload` (every miss filled), `cpu` (every miss
on the CPU, no cache), `hybrid` (the split), `static` (a fixed set chosen at load stays on the
GPU, the rest always on the CPU: llama.cpp's and KTransformers' placement, kept as a baseline),
`auto` (fused when everything fits, else hybrid).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from freetoken.config import MoEOptions, parse_size
from freetoken.kernels import cache_control
from freetoken.moe.bandwidth import BandwidthProfile, load_profile
from freetoken.moe.cache import ExpertCache, warm_order
from freetoken.moe.cpu import CPUExpertExecutor
from freetoken.moe.cpu_share import DoorbellShare, HostCPUShare, NoCPUShare, TierCPUShare
from freetoken.moe.device_control import DeviceControl
from freetoken.moe.device_layer import DeviceDecided, control_over
from freetoken.moe.doorbell import CPUDoorbell
from freetoken.moe.fills import Fills
from freetoken.moe.host_layer import HostDecided
from freetoken.moe.policy import ExpectedNextUsePolicy, default_policy, make_policy
from freetoken.moe.prefetch import Prefetch
from freetoken.moe.prefill import LayerStreamer
from freetoken.moe.resident import ResidentLayers
from freetoken.moe.round_trip import pack_bytes as pack_bytes  # (the tests' import)
from freetoken.moe.round_trip import unpack_bytes as unpack_bytes
from freetoken.moe.split import BandwidthTracker, StepClock, StepModes
from freetoken.moe.steps import DeviceTimedSteps, LayerTimedSteps, UntimedSteps
from freetoken.moe.store import HostExpertStore
from freetoken.moe.strategies import KINDS
from freetoken.telemetry import MoETelemetry

log = logging.getLogger(__name__)

# When the split would fill this share of the misses anyway, the CPU path is not worth its cost:
# on the H200 host (B_P' 41-49 GB/s, B_H' 4-8 GB/s, 86% filled) each CPU job's fixed cost
# (handoff, waiting, ~0.7 ms) exceeded the PCIe time it saved, and hybrid ran 25-35% below
# offload (benchmarks/results/2026-11-29-decode-offload-h200.md).
OFFLOAD_FILL_FRACTION = 0.8
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
        self.streamer = streamer
        self._fills = Fills(store, device, self.tracker)
        self._clock = StepClock(device)  # device-decided steps' times (begin_step, end_step)
        share = self._device_share(doorbell)
        prefetch = None
        if control is not None:  # (decisions on the device: a layer's misses may come ahead)
            prefetch = Prefetch(control, self._fills, options.prefetch_experts)
        self._steps = self._step_clock(control, share, prefetch)
        self._host = self._device = None
        if self.kind.resident:
            self._layer = ResidentLayers(cache, cpu, act, self._telemetry)
        else:
            self._layer = self._host = self._host_layer(cache)
            if control is not None:
                self._layer = self._device = DeviceDecided(
                    control, self._fills, share, self._host, prefetch
                )
        # the parts that read the cache, each once (the layer step may be the host path)
        users = (streamer, self._layer, self._host)
        self._cache_users = list({id(p): p for p in users if p is not None}.values())
        self._bind_cache(cache)

    # -- the parts the strategy chooses -----------------------------------------------------

    def _device_share(self, doorbell: CPUDoorbell | None) -> NoCPUShare:
        """How a device-decided step's CPU routes run: hybrid's through the doorbell (CUDA)
        or at once on the executor (the CPU tier); offload has none."""
        if not self.kind.splits:
            return NoCPUShare()
        if doorbell is not None:
            store = self.store
            return DoorbellShare(doorbell, self._clock, store.num_layers, store.shape.nbytes)
        return TierCPUShare(self.cpu, self.tracker, self._telemetry)

    def _step_clock(
        self, control: DeviceControl | None, share: NoCPUShare, prefetch: Prefetch | None
    ) -> UntimedSteps:
        """Hybrid's decode steps are timed for StepModes: whole steps where the device decides
        (its split written before each, and the prefetch switched as the way says), from layer
        to layer where the host does."""
        if not self.kind.splits:
            return UntimedSteps()
        if control is not None:
            split = control.split.numpy()
            modes = StepModes(ahead=prefetch is not None and prefetch.experts > 0)
            return DeviceTimedSteps(
                modes, self._clock, split, self.tracker, self.options, share, prefetch
            )
        return LayerTimedSteps(StepModes(), self.options, self.store.num_layers)

    def _host_layer(self, cache: ExpertCache | None) -> HostDecided:
        """The host-decided layer step, with the strategy's miss split: it may give the CPU
        routes on the layers the cache does not wholly hold (all of them, without a cache)."""
        L = self.store.num_layers
        cpu_layers = range(L)
        if cache is not None:
            on_cpu = (cache.slot_of.numpy() < 0).reshape(L, -1).any(1)
            cpu_layers = np.flatnonzero(on_cpu).tolist()
        split = self.kind.miss_split(self.tracker, self.options, cpu_layers)
        cpu = None
        if self.cpu is not None:
            cpu = HostCPUShare(self.cpu, self.tracker, self._telemetry)
        return HostDecided(
            self.store,
            self.device,
            cache,
            self.options,
            self.act,
            self._telemetry,
            split,
            self._fills,
            cpu,
            self._steps,
            self.streamer,
        )

    def _bind_cache(self, cache: ExpertCache | None) -> None:
        """Make `cache` the one every part uses (the fills' destination, the streamer's)."""
        self.cache = cache
        for user in self._cache_users:
            user.cache = cache
        self._fills.bind(cache)

    # -- state the engine, benchmarks and tests read ------------------------------------------

    @property
    def control(self) -> DeviceControl | None:
        """The device's decisions (offload and hybrid deciding on the device), or None."""
        return self._device.control if self._device is not None else None

    @property
    def doorbell(self) -> CPUDoorbell | None:
        return self._device.share.doorbell if self._device is not None else None

    @doorbell.setter
    def doorbell(self, doorbell) -> None:
        """Hybrid's device-decided steps' CPU share goes through `doorbell` from now on."""
        self._device.share = self._steps.share = self._device_share(doorbell)

    @property
    def step_modes(self) -> StepModes:
        return self._steps.modes

    @step_modes.setter
    def step_modes(self, modes: StepModes) -> None:
        self._steps.modes = modes

    @property
    def _step(self) -> tuple | None:
        """The current decode step's (start, tokens, way), None outside one."""
        return self._steps.step

    @_step.setter
    def _step(self, step: tuple | None) -> None:
        self._steps.step = step

    def _expects_cpu_job(self, moe_layer: int, tokens: int) -> bool:
        """Whether a layer step will likely give the CPU routes (HostDecided.expects_cpu_job)."""
        return self._host.expects_cpu_job(moe_layer, tokens, self.device)

    @property
    def telemetry(self) -> MoETelemetry:
        """The counters, with those the device keeps (device-decided calls) folded in."""
        self._layer.fold(self._telemetry)
        return self._telemetry

    # -- between steps ------------------------------------------------------------------------

    def begin_step(self, tokens: int, decode: bool) -> None:
        """Called before every forward: for hybrid deciding on the device, the last decode
        step's time given to `StepModes`, this step's way chosen and its split written where
        the plans read it."""
        if self.cache is not None:
            self.cache.settle()  # (a warm start's fills, left running by the build)
        self._steps.begin(tokens, decode)

    def end_step(self, timed: bool = True) -> None:
        """Called after every forward was queued; `timed` False for a step whose time says
        nothing of its way (one that captured a decode graph)."""
        self._steps.end(timed)

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
        if self._device is not None:
            self._device.control.push_host_tables()
            self._device.fold_counters(self._telemetry)  # before the control is replaced
        refill = warm_order(self.store) if self.options.warm_cache else ()
        self._fills.release()  # (the old banks may be freed before the new ones are made)
        try:
            resized = self.cache.resized(num_slots, refill)
        except Exception:
            if self.cache.w_gate_up is not None:
                self._bind_cache(self.cache)  # untouched: serving goes on with it
            raise
        self._bind_cache(resized)
        num_slots = resized.num_slots  # (fewer where the device held no more)
        if self._device is not None:
            self._device.rebuild_control()
        log.info("expert cache resized to %d slots of %d", num_slots, self.store.num_pairs)

    # -- the executor -------------------------------------------------------------------------

    def __call__(
        self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return self._layer(moe_layer, x, ids, weights)

    @property
    def prefetches(self) -> bool:
        """Whether decode calls may be prefetched a layer ahead at all (`prefetch_experts` on,
        the device deciding): the model asks `prefetcher` only then."""
        return self._device is not None and self._device.prefetch.experts > 0

    def prefetcher(self, tokens: int, routes: int) -> Prefetch | None:
        """Where the next layer's call, of this shape, may be prefetched (moe/prefetch.py):
        the device decides it and `prefetch_experts` is on; else None."""
        return self._device.prefetcher(tokens, routes) if self._device is not None else None

    def capturable(self, tokens: int, routes: int) -> bool:
        """Whether a call of this shape runs on the device alone (a decode graph holds it)."""
        return self._layer.capturable(tokens, routes)

    def foldable(self, tokens: int, routes: int) -> bool:
        """Whether a decode graph may hold this call's GPU work (`device_phase`), leaving the
        host only `host_phase` (HostDecided, moe/host_layer.py)."""
        return self._layer.foldable(tokens, routes)

    def pack_round_trip(self, x, ids, weights) -> torch.Tensor | None:
        return self._host.pack_round_trip(x, ids, weights)

    def host_phase(self, moe_layer, x, ids, weights, slots, partial, packed=None) -> None:
        self._layer.host_phase(moe_layer, x, ids, weights, slots, partial, packed)

    def device_phase(self, x, slots, weights, partial) -> torch.Tensor:
        return self._host.device_phase(x, slots, weights, partial)


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
    return MoERuntime(
        store, device, kind.name, cache, cpu, options, act, tracker, streamer, control, doorbell
    )


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
        log.info(
            "device control: policy %s has no device form; using expected-next-use", policy.name
        )
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
    return control_over(cache, split, doorbell), doorbell


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
    return CPUDoorbell(
        cpu.native, store.num_layers, threads, cache_control.MAX_ROUTES, device, prepare
    )
