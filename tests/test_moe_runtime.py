"""The offload runtime with the cache tier on the CPU: every strategy and cache size gives the
fused result; split, telemetry and cache tables behave as specified."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.models.loading import load_model
from freetoken.moe.runtime import parse_cache_size
from tiny_models import build

MOE_FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "qwen3_5_moe",
    "deepseek_v3",
    "deepseek_v4",
    "deepseek_v32",
    "glm_moe_dsa",
    "gpt_oss",
    "minimax_m2",
    "kimi_k25",
    "gemma4",
    "kimi_linear",
]
PROMPT, STEPS = 24, 10


def greedy_run(loaded, options: MoEOptions, prompts):
    """Greedy decode of every prompt together; returns (tokens, logits per step, runner)."""
    runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8, moe=options)
    seqs = [runner.new_sequence() for _ in prompts]
    logits = runner.forward(seqs, prompts)
    all_logits, tokens = [logits], []
    for _ in range(STEPS):
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        logits = runner.forward(seqs, [[int(t)] for t in nxt])
        all_logits.append(logits)
    return torch.stack(tokens, 1), torch.stack(all_logits, 1), runner


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family_model(request, tmp_path_factory):
    path, _ = build(request.param, tmp_path_factory.mktemp(request.param) / "m")
    return load_model(path, dtype="float32")


def prompts_for(loaded, n=2):
    gen = torch.Generator().manual_seed(5)
    vocab = loaded.config.vocab_size
    return [torch.randint(0, vocab, (PROMPT - 7 * i,), generator=gen).tolist() for i in range(n)]


CONFIGS = [
    MoEOptions(strategy="offload", cache_size="1"),
    MoEOptions(strategy="offload", cache_size="5"),
    MoEOptions(strategy="hybrid", cache_size="1"),
    MoEOptions(strategy="hybrid", cache_size="7"),
    MoEOptions(strategy="hybrid", cache_size="13", max_fetch=1),
    MoEOptions(strategy="cpu"),
    MoEOptions(strategy="static", cache_size="9"),
    MoEOptions(strategy="offload", cache_size="24"),  # the whole pool of 3 layers x 8 experts
    MoEOptions(strategy="hybrid", cache_size="6", policy="lru"),
    # decode fills a layer ahead on predicted routes (moe/prefetch.py)
    MoEOptions(strategy="hybrid", cache_size="7", prefetch_experts=3),
    # decode decided on the host, as before device control (decode at "5" decides on the device)
    MoEOptions(strategy="offload", cache_size="5", device_control=False),
]


@pytest.mark.parametrize(
    "options",
    CONFIGS,
    ids=lambda o: f"{o.strategy}-{o.cache_size}-{o.policy}-{o.prefetch_experts}",
)
def test_every_strategy_and_cache_size_matches_fused(family_model, options):
    prompts = prompts_for(family_model)
    ref_tokens, ref_logits, _ = greedy_run(family_model, MoEOptions(strategy="fused"), prompts)
    tokens, logits, runner = greedy_run(family_model, options, prompts)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max().item() < 1e-5
    assert runner.moe.strategy == options.strategy
    total = runner.moe.telemetry.total()
    assert total.accesses == total.hits + total.misses
    assert total.misses == total.fills + total.cpu
    if options.strategy == "cpu":
        assert total.fills == 0 and total.cpu == total.misses > 0
    if options.strategy == "offload" and options.cache_size == "24":
        assert total.cpu == 0
    if options.prefetch_experts:
        assert total.prefetches > 0


def test_runners_sharing_a_model_each_run_their_own_runtime(family_model):
    """Two runners on one loaded model (as a benchmark interleaving strategies builds them):
    each forward runs its own runner's MoE runtime, whichever was built last."""
    offload = ModelRunner(family_model, 256, moe=MoEOptions("offload", "1000"))  # all fit
    cpu = ModelRunner(family_model, 256, moe=MoEOptions("cpu"))
    a, b = offload.new_sequence(), cpu.new_sequence()
    prompt = prompts_for(family_model, 1)[0]
    offload.forward([a], [prompt])
    cpu.forward([b], [prompt])
    offload.forward([a], [[1]])
    layers = len(offload.moe.telemetry.layers)
    assert offload.moe.telemetry.total().calls == 2 * layers
    assert offload.moe.telemetry.total().cpu_routes == 0
    assert cpu.moe.telemetry.total().calls == layers


def test_auto_on_cpu_is_fused(family_model):
    runner = ModelRunner(family_model, kv_cache_tokens=64)
    assert runner.moe.strategy == "fused"


def test_parse_cache_size():
    assert parse_cache_size("300", 1000) == 300
    assert parse_cache_size("8GiB", 2**20) == 8192
    assert parse_cache_size("1.5 GB", 10**6) == 1500
    with pytest.raises(ValueError, match="cannot read cache size"):
        parse_cache_size("lots", 1)


def test_bad_strategy_is_rejected():
    with pytest.raises(ValueError, match="unknown MoE strategy"):
        MoEOptions(strategy="magic")


# -- a hand-worked example, driving one runtime directly ------------------------------------


def tiny_store(
    num_layers=2, num_experts=4, hidden=8, inter=4, dtype=torch.float32, expert_bias=False
):
    from freetoken.moe.store import ExpertShape, HostExpertStore

    store = HostExpertStore(ExpertShape(hidden, inter, dtype, expert_bias), num_layers, num_experts)
    gen = torch.Generator().manual_seed(0)
    for bank in store.banks:
        bank.copy_(torch.randn(bank.shape, generator=gen))
    return store


def reference(store, moe_layer, x, ids, weights):
    from freetoken.kernels.grouped_experts import reference_grouped_experts

    rows = store.layer_rows(moe_layer)
    return reference_grouped_experts(
        x,
        ids,
        weights,
        *(bank[rows] for bank in store.banks[:2]),
        "silu",
        *(bank[rows] for bank in store.banks[2:]),
    )


def drive(runtime, store, steps):
    """Run (moe_layer, ids) steps of one token each, checking every output against the
    reference; returns the telemetry."""
    gen = torch.Generator().manual_seed(1)
    for moe_layer, ids in steps:
        ids = torch.tensor(ids)
        x = torch.randn(ids.shape[0], store.shape.hidden, generator=gen)
        weights = torch.rand(ids.shape, generator=gen)
        out = runtime(moe_layer, x, ids, weights)
        assert torch.allclose(out, reference(store, moe_layer, x, ids, weights), atol=1e-5)
    return runtime.telemetry


def test_telemetry_counts_hand_worked_offload():
    from freetoken.moe.runtime import build_runtime

    store = tiny_store()
    # the host path, from a cold cache
    options = MoEOptions("offload", "2", policy="lru", device_control=False, warm_cache=False)
    rt = build_runtime(store, torch.device("cpu"), options)
    # 2 slots, LRU. L0e0 miss->fill, L1e1 miss->fill, L0e0 hit, L1e2 miss: the least recently
    # used of {L0e0 (used at step 3), L1e1 (step 2)} is L1e1 -> evicted; then L0e0 and L1e2 hit.
    t = drive(rt, store, [(0, [[0]]), (1, [[1]]), (0, [[0]]), (1, [[2]]), (0, [[0]]), (1, [[2]])])
    l0, l1, total = t.layers[0], t.layers[1], t.total()
    assert (l0.calls, l0.accesses, l0.hits, l0.fills, l0.cpu) == (3, 3, 2, 1, 0)
    assert (l1.calls, l1.accesses, l1.hits, l1.fills, l1.cpu) == (3, 3, 1, 2, 0)
    assert total.bytes_h2d == 3 * store.shape.nbytes
    assert rt.cache.slot_of[0] >= 0  # L0e0 cached
    assert rt.cache.slot_of[5] == -1  # L1e1 evicted
    snap = t.snapshot()
    assert snap["hit_rate"] == pytest.approx(3 / 6)
    assert snap["mean_fills_per_layer_step"] == pytest.approx(3 / 6)


def test_telemetry_counts_cpu_routes_and_hybrid_split():
    from freetoken.moe.runtime import build_runtime

    store = tiny_store()
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("cpu"))
    # Two tokens routed to the same expert: one distinct pair, two CPU routes.
    t = drive(rt, store, [(0, [[3], [3]])])
    assert (t.total().accesses, t.total().cpu, t.total().cpu_routes) == (1, 1, 2)

    # the host's split (device control's: tests/test_device_control.py)
    options = MoEOptions("hybrid", "8", policy="lru", warm_cache=False, device_control=False)
    rt = build_runtime(store, torch.device("cpu"), options)
    rt.tracker.fill = rt.tracker.cpu = 1e9  # equal bandwidths: half the misses are filled
    rt.tracker.alpha = 0.0  # keep them fixed for the example
    t = drive(rt, store, [(1, [[0, 1], [2, 3]])])  # 4 distinct misses -> q = 2, m - q = 2
    total = t.total()
    assert (total.misses, total.fills, total.cpu, total.cpu_routes) == (4, 2, 2, 2)
    # The host phases are timed, and lie within the layer's host time.
    phases = (total.round_trip_s, total.plan_s, total.cpu_start_s, total.fill_s, total.policy_s)
    assert all(p > 0 for p in phases) and sum(phases) + total.cpu_wait_s <= total.host_time_s


@pytest.mark.parametrize("strategy", ["offload", "hybrid", "static"])
def test_folded_phases_match_the_eager_layer(strategy):
    """Decode graphs run a layer as `host_phase` (decisions, fills, CPU share into buffers)
    then `device_phase` (captured). With each layer's buffers reused across steps, as a graph
    does, the result equals the reference whether a step has CPU routes, GPU routes or both
    (a stale CPU partial left in a buffer would show here)."""
    from freetoken.moe.runtime import build_runtime

    store = tiny_store(num_experts=6)
    rt = build_runtime(store, torch.device("cpu"), MoEOptions(strategy, "3", policy="lru"))
    rt.tracker.fill = rt.tracker.cpu = 1e9
    rt.tracker.alpha = 0.0
    assert rt.foldable(tokens=2, routes=2)
    gen = torch.Generator().manual_seed(3)
    buffers = {}
    for step in range(24):
        for moe_layer in range(store.num_layers):
            ids = torch.randint(0, 6, (2, 1), generator=gen)
            if step % 5 == 0:
                ids[:] = step % 2  # steps of hits only, so a partial must be zeroed again
            x = torch.randn(2, store.shape.hidden, generator=gen)
            weights = torch.rand(ids.shape, generator=gen)
            slots, partial = buffers.setdefault(
                moe_layer, (torch.full(ids.shape, -1), torch.zeros_like(x))
            )
            rt.host_phase(moe_layer, x, ids, weights, slots, partial)
            out = rt.device_phase(x, slots, weights, partial)
            want = reference(store, moe_layer, x, ids, weights)
            assert torch.allclose(out, want, atol=1e-5), (step, moe_layer)
    total = rt.telemetry.total()
    assert total.hits > 0 and (total.cpu_routes > 0) == (strategy != "offload")
    assert not build_runtime(store, torch.device("cpu"), MoEOptions("cpu")).foldable(2, 2)


@pytest.mark.parametrize("strategy", ["static", "hybrid"])
def test_cpu_share_of_some_tokens_in_bf16(strategy):
    """bf16 layer steps where only some tokens have CPU routes: the CPU partial is scattered
    into zeros for the other tokens in the result's dtype (a dtype mismatch there once broke
    decode on the GPU machine, where no test ran this)."""
    from freetoken.moe.runtime import build_runtime

    store = tiny_store(num_experts=6, dtype=torch.bfloat16)
    options = MoEOptions(strategy, "3", policy="lru", device_control=False)
    rt = build_runtime(store, torch.device("cpu"), options)
    rt.tracker.fill = rt.tracker.cpu = 1e9
    rt.tracker.alpha = 0.0
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        # Token 0 on an expert static keeps resident (layer 1's experts 3-5), tokens 1 and 2
        # on two of 0-2: the CPU computes some tokens' routes, not all.
        ids = torch.tensor([[3], [step % 3], [(step + 1) % 3]])
        x = torch.randn(3, store.shape.hidden, generator=gen).to(torch.bfloat16)
        weights = torch.rand(ids.shape, generator=gen).to(torch.bfloat16)
        out = rt(1, x, ids, weights)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        want = reference(store, 1, x, ids, weights)
        assert torch.allclose(out.float(), want.float(), atol=0.05, rtol=0.02)
    assert rt.telemetry.total().cpu_routes > 0


def test_hybrid_times_its_step_modes_and_keeps_the_fastest():
    """Whole decode steps (layer 0 to the last MoE layer) are timed each way per batch size,
    in a trial of the ways in turns; then steps go the fastest way until the next trial."""
    from freetoken.moe.runtime import build_runtime
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    store = tiny_store()  # two MoE layers of four experts, top-1
    # Two slots for four pairs a step: every layer misses twice, and filling both fits.
    options = MoEOptions("hybrid", "2", policy="lru", device_control=False)  # the host's clock
    rt = build_runtime(store, torch.device("cpu"), options)
    rt.tracker.fill = rt.tracker.cpu = 1e9
    rt.tracker.alpha = 0.0
    rt.step_modes = modes = StepModes(warmup=2, rounds=1, retrial_every=100)
    # Filling measures far faster than the others (the host's clock times these steps;
    # its readings are replaced by these as they come).
    observe = modes.observe
    modes.observe = lambda batch, mode, seconds: observe(batch, mode, {FILL: 0.001}.get(mode, 1.0))
    # Two tokens on different experts: 2 misses a layer, split 1 / 1 when splitting.
    step = [(0, [[0], [1]]), (1, [[2], [3]])]
    drive(rt, store, step * 8)  # 2 warm-up steps (the split), the trial's 6 (each way twice)
    assert [modes.median(2, m) for m in (SPLIT, FILL, CPU)] == [1.0, 0.001, 1.0]
    rt.telemetry.reset()
    drive(rt, store, step * 4)
    assert modes.current(2) == FILL
    # layer 0 misses twice each step (the two slots hold layer 1's pairs by then): all filled
    counters = rt.telemetry.layers[0]
    assert (counters.fills, counters.cpu) == (2 * 4, 0)


def test_the_cpu_team_is_woken_early_only_for_steps_that_will_use_it():
    """With a GPU, a decode layer wakes the CPU team before its round trip when it will likely
    hand the CPU routes: always for `cpu`, for `static` on layers not wholly resident, for
    `hybrid` unless it is filling every miss; never for `offload`, nor for long chunks."""
    from freetoken.moe.runtime import build_runtime
    from freetoken.moe.split import CPU, FILL, SPLIT

    store = tiny_store(num_experts=4)

    def runtime(strategy, size=None):
        rt = build_runtime(store, torch.device("cpu"), MoEOptions(strategy, size))
        assert not rt._expects_cpu_job(0, 1)  # no device to wait for: no early wake-up
        rt.device = torch.device("cuda")  # the decision alone; nothing runs
        return rt

    assert runtime("cpu")._expects_cpu_job(0, 1)
    assert not runtime("offload", "3")._expects_cpu_job(0, 1)
    static = runtime("static", "4")  # layer 1's four experts resident, layer 0 on the CPU
    assert static._expects_cpu_job(0, 1) and not static._expects_cpu_job(1, 1)
    hybrid = runtime("hybrid", "3")
    for mode, expected in ((SPLIT, True), (CPU, True), (FILL, False)):
        hybrid._step = (0.0, 1, mode)
        assert hybrid._expects_cpu_job(0, 1) == expected
    assert not hybrid._expects_cpu_job(0, hybrid.options.fill_all_from_tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "options",
    [
        MoEOptions("offload", "3"),
        MoEOptions("offload", "6"),  # decode decided on the device, in the graph
        MoEOptions("offload", "24"),  # the whole pool, on the device
        MoEOptions("offload", "6", device_control=False),
        MoEOptions("hybrid", "5"),  # decided on the device, the CPU share by the doorbell
        MoEOptions("hybrid", "5", device_control=False),
        MoEOptions("static", "9"),
        MoEOptions("cpu"),
        MoEOptions("hybrid", "12", policy="lru"),
    ],
    ids=lambda o: f"{o.strategy}-{o.cache_size}-{'device' if o.device_control else 'host'}",
)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # (gpt-oss: the bias bank too)
def test_strategies_on_cuda_match_fused(tmp_path, options, family):
    """The real device tier: copy stream, events, pinned host pool, Triton kernel."""
    path, _ = build(family, tmp_path / "m")
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_for(loaded)
    ref_tokens, ref_logits, _ = greedy_run(loaded, MoEOptions(strategy="fused"), prompts)
    tokens, logits, runner = greedy_run(loaded, options, prompts)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert runner.moe.strategy == options.strategy
    on_device = options.strategy in ("offload", "hybrid") and options.device_control
    if on_device and options.cache_size != "3":
        assert runner.graphs.replays > 0 and runner.moe.control is not None
        # whole steps in one graph: no segment cut at an MoE layer
        assert all(len(c.graphs) == 1 for c in runner.graphs.captures.values())
    if options.strategy == "hybrid" and options.device_control:
        doorbell = runner.moe.doorbell
        assert doorbell is not None and doorbell.errors == 0
        if options.cache_size == "5":  # 5 slots of 24: misses the split gives the CPU
            total = runner.moe.telemetry.total()
            assert total.cpu_routes > 0 and total.cpu_time_s > 0  # the listener ran them


def test_auto_picks_from_the_profile():
    from freetoken.moe.bandwidth import BandwidthProfile
    from freetoken.moe.runtime import resolve_strategy

    store = tiny_store()
    cuda = torch.device("cuda")

    def profile(fill, cpu):
        return BandwidthProfile("k", "gpu", "cpu", "fmt", fill, cpu, fill, cpu)

    auto = MoEOptions("auto")
    assert resolve_strategy(auto, cuda, store, store.num_pairs) == "fused"  # everything fits
    assert resolve_strategy(auto, torch.device("cpu"), store, 3) == "fused"  # no separate tier
    assert resolve_strategy(auto, cuda, store, 3) == "hybrid"  # no profile yet
    assert resolve_strategy(auto, cuda, store, 3, profile(50e9, 30e9)) == "hybrid"
    # The H200 host's measured split fills 86%: the CPU share is not worth its job cost.
    assert resolve_strategy(auto, cuda, store, 3, profile(48.8e9, 8.1e9)) == "offload"
    assert resolve_strategy(MoEOptions("static"), cuda, store, 3) == "static"


def test_round_trip_packs_tensors_of_mixed_dtypes_into_one_buffer():
    from freetoken.moe.runtime import pack_bytes, unpack_bytes

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (3, 8), generator=gen)
    x = torch.randn(3, 10, generator=gen).to(torch.bfloat16)
    weights = torch.rand(3, 8, generator=gen)
    odd = torch.randn(5, generator=gen).to(torch.float16)[1:4]  # a view, odd offset and size
    tensors = [x, ids, odd, weights]
    packed = pack_bytes(tensors)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == sum(t.numel() * t.element_size() for t in tensors)
    for got, want in zip(unpack_bytes(packed, tensors), tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_offload_and_hybrid_start_with_every_slot_filled():
    """A warm cache: every slot holds an expert from the start, the layers' experts in turn,
    each in its slot (an empty slot would be a miss paid later)."""
    from freetoken.moe.runtime import build_runtime, warm_order

    store = tiny_store()  # two layers of four experts
    assert warm_order(store) == [0, 4, 1, 5, 2, 6, 3, 7]
    for strategy in ("offload", "hybrid"):
        rt = build_runtime(store, torch.device("cpu"), MoEOptions(strategy, "3"))
        cache = rt.cache
        assert cache.pair_of.tolist() == [0, 4, 1]
        for slot, pair in enumerate(cache.pair_of.tolist()):
            assert torch.equal(cache.w_gate_up[slot], store.w_gate_up[pair])
            assert torch.equal(cache.w_down[slot], store.w_down[pair])
        if rt.control is not None:
            assert rt.control.pair_of[:-1].tolist() == [0, 4, 1]
        cold = build_runtime(
            store, torch.device("cpu"), MoEOptions(strategy, "3", warm_cache=False)
        )
        assert (cold.cache.pair_of == -1).all()


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
@pytest.mark.parametrize("control", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("room", ["both fit", "old freed first", "fit misjudged"])
@pytest.mark.parametrize("biased", [False, True], ids=["", "biased"])
def test_the_expert_cache_shrinks_and_grows_between_steps(
    strategy, control, room, biased, monkeypatch
):
    """`resize_cache`: what the policy values most stays (each expert's weights in its slot),
    the tables stay consistent with the device's, new slots are filled (warm cache), the
    counters carry over, and every output before and after is the reference's; the same
    where the device cannot hold both caches at once and what is kept comes from the pool,
    and where it seemed to but the allocation failed."""
    from freetoken.moe.cache import ExpertCache
    from freetoken.moe.runtime import build_runtime

    monkeypatch.setattr(ExpertCache, "_room_for", lambda self, slots: room != "old freed first")
    if room == "fit misjudged":  # room seemed to be there, the allocation found none

        def no_room(self, *args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (scripted)")

        monkeypatch.setattr(ExpertCache, "_resized_beside", no_room)
    store = tiny_store(num_layers=2, num_experts=8, expert_bias=biased)
    rt = build_runtime(
        store, torch.device("cpu"), MoEOptions(strategy, "6", device_control=control)
    )
    gen = torch.Generator().manual_seed(7)
    steps = [(s % 2, torch.randint(0, 8, (2, 1), generator=gen).tolist()) for s in range(12)]
    drive(rt, store, steps)
    calls = rt.telemetry.total().calls
    for size in (3, 1, 16, 5):
        held = rt.control.pair_of[:-1] if rt.control is not None else rt.cache.pair_of
        before = set(held.tolist()) - {-1}
        rt.resize_cache(size)
        cache = rt.cache
        if size < len(before):  # a shrink keeps a part of what was held
            assert set(cache.pair_of.tolist()) <= before
        assert cache.num_slots == size and (cache.pair_of >= 0).sum() == size  # all filled
        assert len(cache.banks) == len(store.banks)  # (the bias bank too, where there is one)
        for slot, pair in enumerate(cache.pair_of.tolist()):
            for dev, host in zip(cache.banks, store.banks, strict=True):
                assert torch.equal(dev[slot], host[pair])
            assert cache.slot_of[pair] == slot
        if rt.control is not None:
            assert torch.equal(rt.control.slot_of[:-1], cache.slot_of)
        drive(rt, store, steps)  # (checks every output against the reference)
    assert rt.telemetry.total().calls == calls + 4 * len(steps)
    with pytest.raises(ValueError, match="at least one slot"):
        rt.resize_cache(0)
    fused = build_runtime(store, torch.device("cpu"), MoEOptions("fused"))
    with pytest.raises(ValueError, match="cannot be resized"):
        fused.resize_cache(4)


def test_a_warm_start_leaves_its_fills_running_and_the_first_step_waits_for_them(monkeypatch):
    """The build queues the warm cache's fills and returns (on CUDA the link copies them while
    the start goes on); the slots are waited for before anything reads them: the first step,
    or a re-size."""
    from freetoken.moe.cache import ExpertCache
    from freetoken.moe.runtime import build_runtime

    class Copying:  # a CUDA copy's done event, faked: CI has no GPU
        waited = 0

        def synchronize(self):
            Copying.waited += 1

    place = ExpertCache.place

    def placed(self, *args, **kwargs):
        return place(self, *args, **kwargs) or (None, Copying())

    monkeypatch.setattr(ExpertCache, "place", placed)
    store = tiny_store()
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("hybrid", "3"))
    assert min(rt.cache.pair_of.tolist()) >= 0 and Copying.waited == 0  # queued, not waited
    rt.begin_step(1, decode=True)
    assert Copying.waited == 1
    rt.begin_step(1, decode=True)  # (once)
    assert Copying.waited == 1
    again = build_runtime(store, torch.device("cpu"), MoEOptions("hybrid", "3"))
    again.resize_cache(2)  # the slots a re-size keeps are read: after the fills
    assert Copying.waited == 2
    fixed = build_runtime(store, torch.device("cpu"), MoEOptions("hybrid", "3", warm_cache=False))
    assert fixed.cache.pair_of.tolist() == [-1, -1, -1]
