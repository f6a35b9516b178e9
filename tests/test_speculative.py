"""Speculative decoding by prompt lookup (engine/speculative.py): the n-gram index, the
drafter's pauses, and the engine's greedy tokens with drafts equal to its tokens without them,
for every family (fp32 on the CPU; those with recurrent state rewind it on a rejection), with
drafts forced right and forced wrong, with penalties, in a batch, through prefix reuse (a
hybrid model's through its anchors) and through preemption."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from freetoken.config import EngineConfig, MoEOptions
from freetoken.engine.draft_policy import (
    PROBE_EVERY,
    STALE_STEPS,
    Acceptance,
    DraftPolicy,
    expert_union,
)
from freetoken.engine.generate import LLMEngine
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import Sampler, SamplingParams
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.speculative import NgramIndex, PromptLookup, drafter_for
from freetoken.models.loading import load_model
from tiny_models import FAMILIES, build, build_chat_model

NEW_TOKENS = 24


def test_the_index_finds_the_longest_suffix_s_latest_earlier_occurrence():
    index = NgramIndex(min_n=1, max_n=3)
    index.extend([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6])
    # suffix (5, 6): latest earlier occurrence ends at position 6 -> then 7, 1, 2, 5
    assert index.draft(4) == [7, 1, 2, 5]
    index.extend([7])  # suffix (5, 6, 7): the occurrence at 5-7 beats the one at 0-2
    assert index.draft(3) == [1, 2, 5]
    index.extend([42])  # never seen: nothing to draft
    assert index.draft(4) == []
    short = NgramIndex(min_n=2, max_n=4)
    short.extend([1, 2, 3, 2])  # (2,) occurred, but n-grams of one token are below min_n
    assert short.draft(4) == []
    assert NgramIndex().draft(4) == []


def test_prompt_lookup_drafts_up_to_its_cap_and_the_room_left():
    lookup = PromptLookup(max_draft=3)
    state = lookup.start([1, 2, 3, 4, 5, 6, 1, 2])
    assert lookup.draft(state, room=10) == [3, 4, 5]
    assert lookup.draft(state, room=2) == [3, 4]
    lookup.observe(state, 3)
    assert lookup.draft(state, room=10) == [4, 5, 6]
    lookup.record(state, 3, 1)
    assert (state.drafted, state.accepted) == (3, 1)


def test_acceptance_counts_kept_tokens_against_rejections_and_fades():
    a = Acceptance()
    assert a.rate() == 0.5 and a.expected(0) == 1.0 and a.expected(2) == 1.75
    for _ in range(6):
        a.record(4, 4)  # kept whole: no rejection
    assert a.rate() > 0.9
    kept = a.rate()
    a.record(4, 0)
    assert a.rate() < kept
    bad = Acceptance()
    for _ in range(6):
        bad.record(2, 0)
    assert bad.rate() < 0.25
    low = bad.rate()
    for _ in range(20):
        bad.fade()  # steps without a draft: the evidence fades back to the prior
    assert low < bad.rate() < 0.5 + 1e-9 and abs(bad.rate() - 0.5) < 0.05


def test_the_policy_drafts_only_what_pays():
    policy = DraftPolicy(max_draft=4)
    likely, unlikely = Acceptance(kept=20.0), Acceptance(rejected=20.0)
    assert policy.choose([(likely, 4)]) == 0  # a plain step not measured yet
    policy.observe(1, 1, 0.010)
    # Unmeasured verify shapes cost what the largest measured one below them does (no
    # expert misses): worth trying whole
    assert policy.choose([(likely, 4)]) == 4
    assert policy.choose([(likely, 0)]) == 0  # (nothing drafted)
    policy.observe(1, 5, 0.030)  # a verify of five tokens costs three steps
    policy.observe(1, 2, 0.011)
    assert policy.cost(1, 3) == pytest.approx(0.011)  # from the largest measured below
    assert policy.choose([(likely, 4)]) == 3  # 4 tokens in 11 ms beats 5 in 30
    assert policy.choose([(unlikely, 4)]) == 0  # ~1.05 tokens in 11 ms: not worth it
    # a batch: two requests' drafts of one each against a plain step of two
    policy.observe(2, 2, 0.012)
    policy.observe(2, 4, 0.013)
    assert policy.choose([(likely, 1), (likely, 3)]) == 3  # (5 and 6 tokens: not measured)
    policy.observe(2, 5, 0.030)
    policy.observe(2, 6, 0.035)
    assert policy.choose([(likely, 1), (likely, 3)]) == 1


def test_a_new_request_starts_from_every_request_s_acceptance():
    """An agent's turns are short requests: a batch whose drafts were all kept must not start
    each new one at 1/2, where a verify step that costs 1.65x a plain one never pays."""
    policy = DraftPolicy(max_draft=1)
    policy.observe(4, 4, 0.0286)
    policy.observe(4, 8, 0.0471)  # (an H100's hybrid steps at batch 4)
    fresh = [policy.acceptance() for _ in range(4)]
    assert fresh[0].rate() == 0.5
    assert policy.choose([(a, 1) for a in fresh]) == 0  # 6 tokens in 47 ms < 4 in 29
    for _ in range(8):  # earlier requests' drafts, all kept
        policy.record(Acceptance(), 1, 1)
    fresh = [policy.acceptance() for _ in range(4)]
    assert fresh[0].rate() > 0.8 and (fresh[0].kept, fresh[0].rejected) == (0.0, 0.0)
    assert policy.choose([(a, 1) for a in fresh]) == 1
    # its own evidence rules once it has some, and fades back to the pooled prior
    mine = policy.acceptance()
    for _ in range(6):
        policy.record(mine, 1, 0)
    assert mine.rate() < 0.3
    for _ in range(30):
        mine.fade()
    assert mine.rate() == pytest.approx(mine.prior, abs=0.02)
    # (the pool took its rejections too: later requests start lower)
    assert policy.acceptance().rate() < fresh[0].rate()


def test_expert_misses_grow_an_unmeasured_verify_step_by_the_union_of_experts():
    assert expert_union(1, 128, 8) == pytest.approx(8)
    assert expert_union(3, 128, 8) == pytest.approx(128 * (1 - (120 / 128) ** 3))  # ~22.5
    cached = DraftPolicy(max_draft=4, experts=128, top_k=8, miss_rate=lambda: 0.0)
    missing = DraftPolicy(max_draft=4, experts=128, top_k=8, miss_rate=lambda: 1.0)
    for policy in (cached, missing):
        policy.observe(1, 1, 0.010)
    assert cached.cost(1, 3) == pytest.approx(0.010)
    assert missing.cost(1, 3) == pytest.approx(0.010 * expert_union(3, 128, 8) / 8)
    middling = Acceptance(kept=3.0, rejected=1.0)  # 2/3
    assert cached.choose([(middling, 4)]) == 4
    assert missing.choose([(middling, 4)]) == 0  # every extra token's experts miss


def test_shapes_the_estimate_rejects_are_probed_now_and_then():
    """Routing that overlaps more than uniform routing's can make a verify step pay where the
    estimate says it can't: every PROBE_EVERY drafting steps the shortest unmeasured (or stale)
    cap above the chosen one is verified once, and its measured cost rules after that; a stale
    plain step likewise."""
    policy = DraftPolicy(max_draft=4, experts=128, top_k=8, miss_rate=lambda: 1.0)
    policy.observe(1, 1, 0.010)
    likely = Acceptance(kept=3.0, rejected=1.0)  # 2/3
    caps = [policy.choose([(likely, 4)]) for _ in range(PROBE_EVERY)]
    assert caps == [0] * (PROBE_EVERY - 1) + [1]  # (the estimate: 2 tokens' experts cost 1.9x)
    policy.observe(1, 2, 0.012)  # the probe: overlapping routes, 2 tokens for 1.2 steps
    assert policy.choose([(likely, 4)]) == 1  # measured: it pays
    caps = [policy.choose([(likely, 4)]) for _ in range(PROBE_EVERY - 1)]
    assert caps == [1] * (PROBE_EVERY - 2) + [2]  # the next shape up, probed
    policy.observe(1, 3, 0.040)  # too slow: not chosen, and not probed again until stale
    later = []
    for _ in range(STALE_STEPS - 1):
        later.append(policy.choose([(likely, 2)]))
        if later[-1] == 0:  # (measured as the engine would)
            policy.observe(1, 1, 0.010)
    # every step drafting, the plain step they are weighed against went stale: probed once
    assert later.count(0) == 1 and set(later) == {0, 1}
    assert policy.choose([(likely, 2)]) == 2  # 1x3 measured STALE_STEPS drafting steps ago
    assert policy.choose([(Acceptance(), 0)]) == 0  # (no draft: no probe)


def test_a_step_beside_or_right_after_a_prefill_is_not_timed(tmp_path):
    """The cost model reads steady steps only: a decode step beside a prefill chunk waits for
    its queued work, and the one right after runs on what the prefill left cold."""
    path = build("qwen3_moe", tmp_path / "m")[0]
    engine = engine_for(path, None)
    engine.draft_policy = DraftPolicy(max_draft=4)
    seen = []
    engine.draft_policy.observe = lambda s, t, seconds: seen.append((s, t))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request([1, 2, 3, 4, 5], params)
    engine.step()  # the prompt (and its first token)
    engine.step()  # the first decode: right after the prefill
    assert seen == []
    engine.add_request([6, 7, 8], params)
    engine.step()  # a decode beside the new request's prefill
    assert seen == []
    engine.step()  # two decoding, right after it
    engine.step()
    assert seen == [(2, 2)]


def test_modes_choose_a_drafter():
    assert isinstance(drafter_for("ngram"), PromptLookup)
    assert isinstance(drafter_for("auto"), PromptLookup)
    assert drafter_for("off") is None and drafter_for("mtp") is None  # (mtp: engine/mtp.py)
    with pytest.raises(ValueError, match="auto, ngram, mtp, off"):
        drafter_for("eagle")


class Tokens:
    """The least of a tokenizer the engine needs: ids as text."""

    def __init__(self, vocab: int):
        self.vocab_size = vocab
        self.eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass
class Forced:
    """A drafter that drafts each request's known continuation (`shift` 0: every draft
    right) or that continuation shifted by one id (every draft wrong)."""

    expected: dict[tuple[int, ...], list[int]]  # prompt -> prompt + its greedy output
    vocab: int
    shift: int = 0
    max_draft: int = 3

    @dataclass
    class State:
        tokens: list[int]
        reference: list[int] = field(default_factory=list)

    def start(self, tokens):
        reference = next(v for k, v in self.expected.items() if tuple(tokens[: len(k)]) == k)
        return self.State(list(tokens), reference)

    def draft(self, state, room):
        n = len(state.tokens)
        ahead = state.reference[n : n + min(room, self.max_draft)]
        return [(t + self.shift) % self.vocab for t in ahead]

    def observe(self, state, token):
        state.tokens.append(token)

    def record(self, state, drafted, accepted):
        pass


def engine_for(path, drafter, kv_tokens=1024, batch=2, moe=None) -> LLMEngine:
    loaded = load_model(path, dtype="float32")
    runner = ModelRunner(
        loaded, kv_tokens, page_size=8, moe=moe, max_sequences=batch, state_scratch=batch
    )
    return LLMEngine(runner, Tokens(loaded.config.vocab_size), batch, drafter=drafter)


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat a span, so prompt lookup finds something to draft."""
    gen = torch.Generator().manual_seed(7)
    a, b = (torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (12, 9))
    return [a + b + a + b[:3], b + a + b + a[:2]]


def reference(path, params: SamplingParams):
    """(prompts, their tokens without drafts, prompt -> prompt + tokens, the vocabulary)."""
    off = engine_for(path, None)
    vocab = off.runner.config.vocab_size
    prompts = repetitive_prompts(vocab)
    want = [c.output_ids for c in off.generate(prompts, params)]
    return prompts, want, {tuple(p): p + w for p, w in zip(prompts, want, strict=True)}, vocab


@pytest.fixture(scope="module", params=FAMILIES)
def family_path(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param) / "m")[0]


def test_drafts_never_change_the_greedy_tokens(family_path):
    """Prompt lookup, drafts forced right (all kept) and forced wrong (none kept): the
    tokens of one token a step, in a batch of two."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts, want, expected, vocab = reference(family_path, params)
    for drafter in (PromptLookup(), Forced(expected, vocab), Forced(expected, vocab, shift=1)):
        engine = engine_for(family_path, drafter)
        got = [c.output_ids for c in engine.generate(prompts, params)]
        assert got == want, type(drafter).__name__
        if isinstance(drafter, Forced):
            assert engine.drafted > 0
            assert engine.accepted == (engine.drafted if drafter.shift == 0 else 0)


@dataclass
class Boundaries:
    """A drafter whose drafts are end-of-turn tokens (boundaries, where anchors are saved):
    the verify step plans anchors among tokens that are then rejected."""

    token: int

    def start(self, tokens):
        return None

    def draft(self, state, room):
        return [self.token] * min(room, 2)

    def observe(self, state, token):
        pass

    def record(self, state, drafted, accepted):
        pass


def test_hybrid_drafts_through_anchors_and_prefix_reuse(tmp_path_factory):
    """Qwen3-Next behind Qwen3's tokenizer, a conversation turn by turn, each turn resumed
    from an anchor of the last: with drafts forced right, forced wrong, and made of boundary
    tokens, the tokens of an engine without drafts or prefix cache; no anchor, scratch or
    state slot is left behind."""
    path = build_chat_model("qwen3_next", tmp_path_factory.mktemp("spec-chat") / "m")[0]

    def engine(**options):
        return LLMEngine.from_config(
            EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_tokens=4096, **options)
        )

    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    plain = engine(prefix_cache=False, speculative="off")
    tok = plain.tokenizer
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": "List the files."}]))]
    want = []
    for turn in range(3):  # each turn's prompt: the last one, its reply and a question
        want.append(plain.generate([prompts[-1]], params)[0].output_ids)
        question = f"<|im_end|>\n<|im_start|>user\nAnd file {turn}?<|im_end|>\n"
        prompts.append(prompts[-1] + want[-1] + tok.encode(question + "<|im_start|>assistant\n"))
    prompts.pop()
    # (latest prompt first: each prompt starts with the ones before it)
    expected = {tuple(p): p + w for p, w in reversed(list(zip(prompts, want, strict=True)))}
    vocab, end = plain.runner.config.vocab_size, tok.token_id("<|im_end|>")
    for drafter in (Forced(expected, vocab), Forced(expected, vocab, 1), Boundaries(end)):
        drafting = engine(speculative="ngram", page_size=16)
        drafting.drafter = drafter
        got = [drafting.generate([p], params)[0].output_ids for p in prompts]
        assert got == want, drafter
        assert drafting.drafted > 0
        assert all(r["anchor"] for r in list(drafting.reuse.recent)[1:])  # resumed from anchors
        store = drafting.anchors
        assert store.num_free + store.num_attached == store.capacity
        assert drafting.runner.states.num_free == drafting.max_batch_size


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return build("qwen3_moe", tmp_path_factory.mktemp("spec-moe") / "m")[0]


def test_penalties_count_the_draft_before_each_position(moe_path):
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
    )
    prompts, want, expected, vocab = reference(moe_path, params)
    engine = engine_for(moe_path, Forced(expected, vocab))
    assert [c.output_ids for c in engine.generate(prompts, params)] == want
    assert engine.accepted == engine.drafted > 0


def test_drafts_through_prefix_reuse_preemption_and_the_offload_strategies(moe_path):
    """A second request reusing the first's prefix, a KV pool so small the newer request is
    preempted and resumes, and the cache strategies (their tier on the CPU): the same tokens."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts, want, expected, vocab = reference(moe_path, params)
    engine = engine_for(moe_path, Forced(expected, vocab))
    for _ in range(2):  # (the second time from the prefix cache)
        assert [c.output_ids for c in engine.generate(prompts, params)] == want
    assert engine.reuse.snapshot()["reused_tokens"] > 0
    # room for about one request's tokens: the newer one is preempted as both grow
    tight = engine_for(moe_path, Forced(expected, vocab), kv_tokens=72)
    assert [c.output_ids for c in tight.generate(prompts, params)] == want
    assert tight.preemptions > 0
    for strategy, size in (("offload", "3"), ("hybrid", "3"), ("cpu", None)):
        moe = MoEOptions(strategy=strategy, cache_size=size)
        engine = engine_for(moe_path, Forced(expected, vocab, shift=strategy == "hybrid"), moe=moe)
        assert [c.output_ids for c in engine.generate(prompts, params)] == want, strategy


def test_a_step_that_ends_a_request_on_a_draft_delivers_every_token(moe_path):
    """A verified draft gives a request several outputs in one step, the last of which ends
    it: each output says whether it is the last, and the scheduler hands every one to the
    client (reading `request.finished` instead dropped the tokens after the first of them)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts, want, expected, vocab = reference(moe_path, params)
    engine = engine_for(moe_path, Forced(expected, vocab))
    req = engine.add_request(prompts[0], params)
    outputs = []
    while not req.finished:
        outputs += engine.step()
    assert [o.token_id for o in outputs] == want[0]
    assert [o.finished for o in outputs] == [False] * (NEW_TOKENS - 1) + [True]
    assert len([o for o in outputs[-4:] if o.request.finished]) > 1  # several in one step

    engine = engine_for(moe_path, Forced(expected, vocab))
    scheduler = Scheduler(engine, max_running=2)
    got: dict[int, list[int]] = {0: [], 1: []}
    done = threading.Event()

    def collect(i):
        def on_output(out, error):
            assert error is None
            got[i].append(out.token_id)
            if out.finished and all(len(v) == NEW_TOKENS for v in got.values()):
                done.set()

        return on_output

    try:
        for i, prompt in enumerate(prompts):
            scheduler.submit(prompt, params, collect(i))
        assert done.wait(timeout=120)
    finally:
        scheduler.shutdown()
    assert [got[0], got[1]] == want


def test_a_draft_without_free_pages_is_dropped_not_paid_for_by_a_preemption(moe_path):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts, want, expected, vocab = reference(moe_path, params)
    # drafts forced wrong: each step moves one token, so every room in a page comes by
    engine = engine_for(moe_path, Forced(expected, vocab, shift=1))
    reqs = [engine.add_request(p, params) for p in prompts]
    kv = engine.runner.kv

    def room(r):  # positions its pages hold past its length
        return len(r.seq.pages) * kv.page_size - r.seq.length

    for _ in range(NEW_TOKENS):  # until the oldest's token fits its pages but a draft would not
        if reqs[0].output_ids and 1 <= room(reqs[0]) <= 3 and room(reqs[1]) >= 1:
            break
        engine.step()
    else:
        pytest.fail("no step with room for one token but not for a draft")
    hog = kv.allocator.alloc(kv.allocator.num_free)  # nothing free for a draft's pages
    before = (len(reqs[0].output_ids), engine.preemptions)
    engine.step()
    assert engine.preemptions == before[1]
    assert len(reqs[0].output_ids) == before[0] + 1  # the step decoded its one token
    kv.allocator.free(hog)
    while not all(r.finished for r in reqs):
        engine.step()
    assert [r.output_ids for r in reqs] == want


# Chi-square critical values at the 0.999 quantile (a test that fails once in a thousand runs
# by chance, with fixed seeds: never, unless the rule is wrong)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft_token", [0, 3, 7])  # likely, middling, filtered out by top_k
def test_the_sampled_verify_rule_keeps_the_models_distribution(draft_token):
    """Sampler.verify on a draft of two: the first token emitted is distributed as p_0 (the
    draft token kept with p_0(d), else a draw from the rest), and the second, given the first
    was the draft, as p_1: chi-square over 8,000 draws on a vocabulary of 8."""
    sampler = Sampler()
    params = SamplingParams(temperature=0.8, top_k=7)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 8, generator=gen) * 2
    logits[0, 7] = -30.0  # below top_k's cut at the first position
    probs = sampler.filter_logits(logits, [params] * 3).softmax(dim=-1)
    first, second = torch.zeros(8), torch.zeros(8)
    draft = [draft_token, 5]
    for _ in range(8000):
        tokens = sampler.verify(logits, params, gen, draft)
        assert 1 <= len(tokens) <= 3 and (len(tokens) == 1 or tokens[0] == draft_token)
        first[tokens[0]] += 1
        if tokens[0] == draft_token and len(tokens) > 1:
            second[tokens[1]] += 1
    dof = int((probs[0] > 0).sum()) - 1
    assert chi_square(first, probs[0]) < CHI2_999[dof]
    if second.sum() > 500:
        assert chi_square(second, probs[1]) < CHI2_999[int((probs[1] > 0).sum()) - 1]


def test_the_greedy_verify_rule_keeps_the_draft_while_it_agrees():
    sampler, params = Sampler(), SamplingParams(temperature=0.0)
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 0]):
        logits[row, best] = 5.0
    assert sampler.verify(logits, params, None, [2, 4, 1]) == [2, 4, 1, 0]  # all kept + one
    assert sampler.verify(logits, params, None, [2, 3, 1]) == [2, 4]  # the model's at a miss
    assert sampler.verify(logits[:1], params, None, []) == [2]
    with pytest.raises(ValueError, match="rows"):
        sampler.verify(logits, params, None, [2])


def test_sampled_requests_draw_alike_with_drafts_and_without(moe_path):
    """The engine end to end: the third token of a sampled request (top_k 4), over 400 seeds,
    with drafts forced right (kept by the rule with the model's probability) and without:
    the two samples are homogeneous (chi-square, 3 degrees of freedom per context)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts, _, expected, vocab = reference(moe_path, params)
    prompt = prompts[0]
    counts = {}
    for name, drafter in (("off", None), ("on", Forced(expected, vocab))):
        engine = engine_for(moe_path, drafter, batch=1)
        tally: dict[tuple[int, int], dict[int, int]] = {}
        for seed in range(400):
            sampled = SamplingParams(
                max_new_tokens=3, temperature=1.0, top_k=4, seed=seed, ignore_eos=True
            )
            out = engine.generate([prompt], sampled)[0].output_ids
            row = tally.setdefault((out[0], out[1]), {})
            row[out[2]] = row.get(out[2], 0) + 1
        counts[name] = tally
        if drafter is not None:
            assert engine.drafted > 0 and 0 < engine.accepted < engine.drafted
    # Homogeneity of the third token's distribution in the two commonest contexts
    common = sorted(counts["off"], key=lambda c: -sum(counts["off"][c].values()))[:2]
    for context in common:
        a, b = counts["off"][context], counts["on"].get(context, {})
        tokens = sorted(set(a) | set(b))
        table = torch.tensor(
            [[a.get(t, 0) for t in tokens], [b.get(t, 0) for t in tokens]], dtype=torch.float64
        )
        if table.sum(dim=1).min() < 40:
            continue
        expected_table = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        stat = float(((table - expected_table) ** 2 / expected_table).sum())
        assert stat < CHI2_999.get(len(tokens) - 1, 30.0), (context, table)


def test_auto_measures_steps_drafts_where_it_pays_and_keeps_the_tokens(tmp_path):
    """`--speculative auto`: the engine times its steps by shape, the cost model tries drafts
    once a plain step is measured, and the tokens are those of no drafting."""
    from freetoken.engine.draft_policy import auto_policy

    path = build("qwen3_moe", tmp_path / "m")[0]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts, want, expected, vocab = reference(path, params)
    auto = engine_for(path, Forced(expected, vocab))  # (drafts always at hand, always right)
    auto.draft_policy = auto_policy(auto.runner, PromptLookup().max_draft)
    got = [c.output_ids for c in auto.generate(prompts, params)]
    assert got == want
    assert (2, 2) in auto.draft_policy.costs  # plain steps of the pair, measured
    assert any(t > 2 for s, t in auto.draft_policy.costs if s == 2)  # and verify steps
    assert auto.drafted > 0 and auto.accepted == auto.drafted

    chat = build_chat_model("qwen3", tmp_path / "chat")[0]

    def engine(speculative):
        config = EngineConfig(model=chat, device="cpu", dtype="float32", speculative=speculative)
        return LLMEngine.from_config(config)

    assert isinstance(engine("auto").draft_policy, DraftPolicy)
    assert engine("ngram").draft_policy is None  # (every draft verified whole)
    assert engine("off").drafter is None


def test_auto_does_not_draft_where_a_verify_step_loses_its_graph(tmp_path, monkeypatch):
    """On a GPU whose decode steps replay CUDA graphs, a model whose verify steps can't be
    captured (latent attention, recurrent state) gets no drafts from `auto` (CPU twin: the
    runner's flags as a GPU's would be)."""
    from freetoken.engine.draft_policy import auto_policy

    path = build("qwen3_moe", tmp_path / "m")[0]
    runner = ModelRunner(load_model(path, dtype="float32"), 256, page_size=8)
    assert auto_policy(runner, 4) is not None  # no graphs: steps are measured
    runner.graphs, runner.verify_graphs = object(), False
    assert auto_policy(runner, 4) is None
    runner.verify_graphs = True
    policy = auto_policy(runner, 3)
    moe = runner.config.moe
    assert (policy.max_draft, policy.experts, policy.top_k) == (3, moe.num_experts, moe.top_k)
    # on a GPU alike: drafts where its verify steps replay graphs, none where they can't
    monkeypatch.setattr(ModelRunner, "device", property(lambda self: torch.device("cuda")))
    assert auto_policy(runner, 3) is not None
    runner.verify_graphs = False
    assert auto_policy(runner, 3) is None
