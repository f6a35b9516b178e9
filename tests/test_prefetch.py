"""Fills a layer ahead (moe/prefetch.py), with the cache tier on the CPU: a prefetch's plan fills
the first p misses of the predicted routes and nothing else changes; a model whose predictions
are exact (its attention outputs zero, so the next router reads what the prediction read) hits
every expert of every layer but the first in decode; the tokens never change."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import MoEOptions
from freetoken.kernels.expert_fill import fill_experts
from freetoken.moe.cache import ExpertCache
from freetoken.moe.device_control import PREFETCHES, DeviceControl
from freetoken.moe.policy import ExpectedNextUsePolicy
from interpreted import run_interpreted
from test_device_control import check_tables
from test_moe_runtime import prompts_for, tiny_store

LAYERS, EXPERTS = 3, 6


def check_prefetches(cases, fused: bool = False) -> None:
    """Each case (slots, warm pairs, layer, predicted experts, p): the cache holds the warm
    pairs, then one prefetch; checks what it filled and that nothing else moved."""
    store = tiny_store(num_layers=LAYERS, num_experts=EXPERTS)
    for slots, warm, layer, predicted, p in cases:
        policy = ExpectedNextUsePolicy()
        cache = ExpertCache(store, slots, torch.device("cpu"), policy=policy)
        control = DeviceControl(cache, policy, None)
        control.fused = fused
        banks = ((cache.w_gate_up, store.w_gate_up), (cache.w_down, store.w_down))
        for pair in warm:  # through ordinary plans: the policy has seen them
            _, fp, fs = control.plan(pair // EXPERTS, torch.tensor([[pair]]), torch.ones(1, 1))
            fill_experts(banks, fp, fs, slots)
        control.take_counters()
        control.set_prefetch(p)
        before_slot = control.slot_of.clone()
        before_policy = [torch.as_tensor(a).clone() for a in (policy.neg_wait, policy.p)]
        scores = torch.as_tensor(policy.slot_scores(layer, control.pair_of[:slots])).float()
        pairs = torch.tensor(predicted) + layer * EXPERTS
        fill_pairs, fill_slots = control.plan_ahead(layer, pairs)
        check_tables(control)
        # The first p distinct misses in route order are filled; the hits keep their slots.
        order = list(dict.fromkeys(pairs.tolist()))
        misses = [q for q in order if before_slot[q] < 0]
        filled = misses[:p]
        real = fill_slots != slots
        assert sorted(fill_pairs[real].tolist()) == sorted(filled)
        hits = [q for q in order if before_slot[q] >= 0]
        assert torch.equal(control.slot_of[hits], before_slot[hits])
        assert all(control.slot_of[q] >= 0 for q in filled)
        assert all(control.slot_of[q] < 0 for q in misses[p:])
        # Into the lowest-scored slots but the predicted hits'.
        victims = fill_slots[real]
        free = torch.ones(slots, dtype=torch.bool)
        free[before_slot[hits]] = False
        assert torch.equal(scores[victims].sort().values, scores[free].sort().values[: len(filled)])
        # No route ran: the policy saw no use, and only the prefetch counter moved.
        after = [torch.as_tensor(a) for a in (policy.neg_wait, policy.p)]
        assert all(torch.equal(a, b) for a, b in zip(before_policy, after, strict=True))
        counts = control.take_counters()
        assert counts[:, :PREFETCHES].sum() == 0
        assert counts[layer, PREFETCHES] == counts[:, PREFETCHES].sum() == len(filled)
        fill_experts(banks, fill_pairs, fill_slots, slots)
        for pair in filled:
            assert torch.equal(cache.w_gate_up[control.slot_of[pair]], store.w_gate_up[pair])


CASES = [
    (4, [], 0, [3, 1, 5, 0], 2),  # cold: the first two predicted
    (4, [7, 9], 1, [1, 3, 2, 5], 3),  # 7 and 9 are hits (protected), 3 of the rest filled
    (5, [0, 1, 2, 3, 4], 0, [4, 5, 1], 8),  # p above the misses: the one miss
    (3, [6], 1, [0, 0, 2], 1),  # a repeated prediction counts once
    (4, [12, 13], 2, [1, 0], 0),  # p = 0: nothing
]


def test_a_prefetch_fills_the_first_predicted_misses_and_nothing_else():
    check_prefetches(CASES)


def test_the_one_program_prefetch_matches_the_twin_in_the_interpreter():
    pytest.importorskip("triton")
    assert run_interpreted("test_prefetch", "checked_fused", CASES) == "ok"


def checked_fused(cases) -> str:
    """`check_prefetches` through the one-program plan (under the interpreter)."""
    check_prefetches(cases, fused=True)
    return "ok"


@pytest.fixture(scope="module")
def exact_predictions(tmp_path_factory):
    """The tiny Mixtral with every attention output zeroed: the next layer's router then reads
    exactly what the prediction read (the stream as the layer before left it)."""
    from freetoken.models.loading import load_model
    from tiny_models import build

    path, _ = build("mixtral", tmp_path_factory.mktemp("mixtral") / "m")
    loaded = load_model(path, dtype="float32")
    with torch.no_grad():
        for layer in loaded.model.layers:
            layer.attn.o_proj.weight.zero_()
    return loaded


def decode_misses(loaded, options: MoEOptions, prompts, steps: int = 8):
    """Greedy decode of the prompts together: (tokens, misses and prefetches per layer over
    the decode steps alone)."""
    from freetoken.engine.runner import ModelRunner

    runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8, moe=options)
    seqs = [runner.new_sequence() for _ in prompts]
    logits = runner.forward(seqs, prompts)
    runner.moe.telemetry.reset()  # (the prompts' calls: decided on the host, none prefetched)
    tokens = []
    for _ in range(steps):
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        logits = runner.forward(seqs, [[int(t)] for t in nxt])
    layers = runner.moe.telemetry.layers
    return torch.stack(tokens, 1), [c.misses for c in layers], [c.prefetches for c in layers]


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_exact_predictions_make_every_decode_call_past_the_first_layer_a_hit(
    exact_predictions, strategy
):
    loaded = exact_predictions
    prompts = prompts_for(loaded)
    ref, _, _ = decode_misses(loaded, MoEOptions(strategy="fused"), prompts)
    k = loaded.config.moe.top_k
    off = MoEOptions(strategy=strategy, cache_size="12", prefetch_experts=0)
    on = MoEOptions(strategy=strategy, cache_size="12", prefetch_experts=2 * k)
    tokens_off, misses_off, prefetched_off = decode_misses(loaded, off, prompts)
    tokens_on, misses_on, prefetched_on = decode_misses(loaded, on, prompts)
    assert torch.equal(tokens_off, ref) and torch.equal(tokens_on, ref)
    assert sum(prefetched_off) == 0
    # Without it the later layers miss; with it they never do, their misses filled a layer
    # ahead. The first layer has no layer before it to predict from.
    assert sum(misses_off[1:]) > 0
    assert misses_on[1:] == [0] * (len(misses_on) - 1), misses_on
    assert prefetched_on[0] == 0 and sum(prefetched_on[1:]) > 0


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="--moe-prefetch"):
        MoEOptions(strategy="offload", prefetch_experts=-1)


@pytest.mark.parametrize("fastest", ["split+ahead", "split"])
def test_hybrid_keeps_the_prefetch_only_where_its_steps_measure_faster(exact_predictions, fastest):
    """Hybrid times each way with the prefetch on and off (StepModes' `+ahead` ways) and keeps
    the fastest: the prefetch runs in the steps after the trial only if it won."""
    from freetoken.engine.runner import ModelRunner
    from freetoken.moe.split import StepModes

    loaded = exact_predictions
    options = MoEOptions(strategy="hybrid", cache_size="12", prefetch_experts=4)
    runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8, moe=options)
    modes = StepModes(warmup=2, rounds=1, retrial_every=1000, ahead=True)
    assert modes.MODES == ("split", "fill", "cpu", "split+ahead", "fill+ahead", "cpu+ahead")
    runner.moe.step_modes = modes
    observe = modes.observe
    modes.observe = lambda batch, mode, s: observe(batch, mode, 0.001 if mode == fastest else 1.0)
    seqs = [runner.new_sequence()]
    logits = runner.forward(seqs, [prompts_for(loaded, 1)[0]])
    for _ in range(2 + 2 * len(modes.MODES) + 1):  # the warm-up, the trial (each way twice)
        logits = runner.forward(seqs, [[int(logits.argmax(-1)[0])]])
    assert modes.current(1) == fastest
    runner.moe.telemetry.reset()
    for _ in range(4):
        logits = runner.forward(seqs, [[int(logits.argmax(-1)[0])]])
    prefetched = runner.moe.telemetry.total().prefetches
    assert (prefetched > 0) == fastest.endswith("+ahead"), prefetched


def test_verify_steps_tokens_are_prefetched_too(exact_predictions):
    """A verify step of speculative decoding (several new tokens a sequence, every token's
    logits) predicts each token's routes a layer ahead like a decode step: with exact
    predictions every later layer hits, and the logits are the fused run's."""
    from freetoken.engine.runner import ModelRunner

    loaded = exact_predictions
    prompts = prompts_for(loaded)

    def verify_steps(options):
        runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8, moe=options)
        seqs = [runner.new_sequence() for _ in prompts]
        runner.forward(seqs, prompts)
        if runner.moe is not None:
            runner.moe.telemetry.reset()
        out = []
        for step in range(3):  # three tokens a sequence, as a draft of two would be
            chunks = [[(7 * step + 3 * b + i) % 50 for i in range(3)] for b in range(len(seqs))]
            out.append(runner.forward(seqs, chunks, all_logits=True))
        return torch.cat(out), runner

    want, _ = verify_steps(MoEOptions(strategy="fused"))
    got, runner = verify_steps(MoEOptions(strategy="offload", cache_size="12", prefetch_experts=12))
    assert (got - want).abs().max().item() < 1e-5
    layers = runner.moe.telemetry.layers
    assert [c.misses for c in layers[1:]] == [0] * (len(layers) - 1)
    assert sum(c.prefetches for c in layers[1:]) > 0


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v4", "qwen3_moe"])
def test_a_prediction_is_submitted_heaviest_first(family, tmp_path):
    """Sigmoid and sqrtsoftplus routing give a token's k experts unsorted (torch.topk with
    sorted=False, as the references): the prediction is ranked by gate weight before it is
    submitted, so a prefetch of p < k fills the p likeliest, not any p."""
    from contextlib import contextmanager

    from freetoken.models.loading import load_model
    from tiny_models import build

    loaded = load_model(build(family, tmp_path / "m")[0], dtype="float32")
    layer = loaded.model.layers[loaded.config.num_layers - 1]  # (V4's first layers hash)
    block = layer.moe
    submitted = []

    class Recorder:
        @contextmanager
        def ahead(self, held):
            yield lambda moe_layer, ids: submitted.append((moe_layer, ids))

    block.prefetch_from = lambda tokens, routes: Recorder()
    torch.manual_seed(0)
    x = torch.randn(16, loaded.config.hidden_size)
    with torch.no_grad():
        weights, ids = block.route(x, torch.arange(16), x)
        block.prefetch(lambda: (x, x), (x,), torch.arange(16))
    [(moe_layer, ranked)] = submitted
    assert moe_layer == block.moe_layer
    assert torch.equal(ranked.sort(1).values, ids.sort(1).values)  # the same experts
    # each submitted expert's gate weight (`ranked` is `ids` reordered per token)
    place = (ranked[:, :, None] == ids[:, None, :]).int().argmax(2)
    got = weights.gather(1, place)
    assert (got[:, :-1] >= got[:, 1:]).all()
    if family != "qwen3_moe":  # (softmax routing's order is the ranked one already)
        assert not (weights[:, :-1] >= weights[:, 1:]).all()
