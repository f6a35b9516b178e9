"""MTP drafts (engine/mtp.py): the next-token-prediction layer as releases lay it out, read
only when asked; its logits at every position against a reference written here from the
formula (transformers' own decoder block for its block), in one pass and through the paged
cache; the engine's greedy tokens with MTP drafts equal to its tokens without drafts (random
MTP weights, drafts forced right and forced wrong), its MTP K/V right at every step through
verify steps, rejections, prefix reuse and preemption; clear errors and fallbacks where a
checkpoint has no MTP layer. fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.generate import LLMEngine
from freetoken.engine.mtp import MTPDrafter, drafter_for, mtp_reading
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.speculative import PromptLookup
from freetoken.models.loading import MTPUnavailableError, load_model
from tiny_models import MTP_LAYOUT, add_mtp, build

NEW_TOKENS = 20


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1.0 + weight.float()) if zero_centered else weight.float())


class Reference:
    """The MTP layer's logits over a whole sequence, without a cache: at position i,
    h'_i = eh_proj [enorm(embed(t_{i+1})); hnorm(h_i)], h_i the model's final (normed) hidden
    state at i; h' through the MTP block (causal attention over h' alone), its final norm and
    the model's output head give the logits of t_{i+2}."""

    def __init__(self, family: str, model, parts: dict):
        self.model, self.parts = model, parts
        self.zc = MTP_LAYOUT[family] == "qwen3_next"  # (zero-centered norms)
        self.eps = model.config.rms_norm_eps

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids)[None]
        h = self.model.model(t).last_hidden_state[0]
        e = self.model.get_input_embeddings()(t[0, 1:])
        p = self.parts
        x = torch.cat(
            [rms(e, p["enorm"], self.eps, self.zc), rms(h[:-1], p["hnorm"], self.eps, self.zc)],
            dim=-1,
        )
        return p["block"](inputs_embeds=(x @ p["eh_proj"].T)[None]).logits[0].float()


def with_mtp(family: str, out_dir):
    path, model = build(family, out_dir)
    return path, Reference(family, model, add_mtp(path, family, model))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return with_mtp("deepseek_v3", tmp_path_factory.mktemp("mtp-deepseek") / "m")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return with_mtp("qwen3_next", tmp_path_factory.mktemp("mtp-next") / "m")


def ids(n: int, vocab: int, seed: int = 3) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "family", ["deepseek_v3", "glm4_moe", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe"]
)
def test_mtp_logits_equal_the_reference_at_every_position(family, tmp_path):
    """In one pass over the sequence, and through the paged cache (a chunk, then a token at a
    time, as the engine follows prefill and decode): max error < 1e-4 (fp32)."""
    path, reference = with_mtp(family, tmp_path / "m")
    loaded = load_model(path, dtype="float32", mtp="on")
    assert loaded.config.mtp and loaded.config.stack_layers == loaded.config.num_layers + 1
    runner = ModelRunner(loaded, 256, page_size=8, max_sequences=2)
    tokens = ids(30, loaded.config.vocab_size)
    want = reference(tokens)
    seq = runner.new_sequence()
    _, hidden = runner.forward([seq], [tokens], all_logits=True, hidden=True)
    got, _ = runner.mtp_forward([seq], [tokens[1:]], [0], hidden[:-1], all_logits=True)
    assert (got - want).abs().max() < 1e-4
    # through the cache: the model over a prompt, then a token a step; the MTP layer follows
    seq, split, rows = runner.new_sequence(), 19, []
    _, hidden = runner.forward([seq], [tokens[:split]], hidden=True)
    logits, _ = runner.mtp_forward([seq], [tokens[1:split]], [0], hidden[:-1], all_logits=True)
    rows.append(logits)
    last = hidden[-1:]
    for p in range(split, len(tokens)):  # (position p - 1 follows once token p is known)
        logits, _ = runner.mtp_forward([seq], [[tokens[p]]], [p - 1], last)
        rows.append(logits)
        _, last = runner.forward([seq], [[tokens[p]]], hidden=True)
    assert (torch.cat(rows) - want).abs().max() < 1e-4


class Oracle(MTPDrafter):
    """The MTP drafter, its drafts (as long as the layer's) replaced by each request's known
    continuation (`shift` 0: every draft kept) or that shifted by one id (none kept)."""

    def __init__(self, expected: dict, vocab: int, shift: int = 0):
        super().__init__()
        self.expected, self.vocab, self.shift = expected, vocab, shift

    def start(self, tokens):
        state = super().start(tokens)
        state.tokens = list(tokens)
        state.reference = next(v for k, v in self.expected.items() if tuple(tokens[: len(k)]) == k)
        return state

    def observe(self, state, token):
        state.tokens.append(token)

    def draft(self, state, room):
        n, k = len(state.tokens), len(super().draft(state, room))
        return [(t + self.shift) % self.vocab for t in state.reference[n : n + k]]


def engine_for(path, drafter, kv_tokens=1024, batch=2) -> LLMEngine:
    from test_speculative import Tokens

    loaded = load_model(path, dtype="float32", mtp="on" if drafter is not None else "off")
    runner = ModelRunner(loaded, kv_tokens, page_size=8, max_sequences=batch, state_scratch=batch)
    return LLMEngine(runner, Tokens(loaded.config.vocab_size), batch, drafter=drafter)


class Followed:
    """The engine's MTP passes over kept positions, recorded: (request, position, logits of
    the token two after) at each request's last kept position."""

    def __init__(self, engine: LLMEngine):
        self.rows: list[tuple[object, int, torch.Tensor]] = []
        runner, forward = engine.runner, engine.runner.mtp_forward

        def recorded(seqs, tokens, starts, hidden, all_logits=False):
            logits, states = forward(seqs, tokens, starts, hidden, all_logits)
            if all(s + len(t) == q.length for q, t, s in zip(seqs, tokens, starts, strict=True)):
                owners = {id(r.seq): r for r in engine.running}
                for i, (seq, t, s) in enumerate(zip(seqs, tokens, starts, strict=True)):
                    self.rows.append((owners[id(seq)], s + len(t) - 1, logits[i]))
            return logits, states

        runner.mtp_forward = recorded

    def max_error(self, reference: Reference) -> float:
        """Against the reference over each request's whole sequence (the logits at position
        p read only the tokens up to p + 1)."""
        worst, cache = 0.0, {}
        for req, p, logits in self.rows:
            full = tuple(req.prompt_ids + req.output_ids)
            if full not in cache:
                cache[full] = reference(list(full))
            worst = max(worst, float((logits - cache[full][p]).abs().max()))
        return worst


def prompts(vocab: int) -> list[list[int]]:
    a, b = ids(11, vocab, 7), ids(7, vocab, 8)
    return [a + b + a[:4], b + a + b[:2]]


@pytest.mark.parametrize("which", ["deepseek", "qwen3_next"])
def test_mtp_drafts_never_change_the_greedy_tokens(which, request):
    """The MTP layer's own drafts (random weights: most rejected), drafts forced right (all
    kept, so drafts grow to three tokens) and forced wrong: the tokens of one token a step,
    in a batch of two; the MTP layer's logits at every step those of the reference."""
    path, reference = request.getfixturevalue(which)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    off = engine_for(path, None)
    vocab = off.runner.config.vocab_size
    assert len(off.runner.kv.k) == off.runner.config.num_layers  # (MTP not read: no K/V)
    todo = prompts(vocab)
    want = [c.output_ids for c in off.generate(todo, params)]
    expected = {tuple(p): p + w for p, w in zip(todo, want, strict=True)}
    for drafter in (MTPDrafter(), Oracle(expected, vocab), Oracle(expected, vocab, shift=1)):
        engine = engine_for(path, drafter)
        assert len(engine.runner.kv.k) == engine.runner.config.num_layers + 1  # (its K/V)
        followed = Followed(engine)
        got = [c.output_ids for c in engine.generate(todo, params)]
        assert got == want, type(drafter).__name__
        assert engine.drafted > 0
        if isinstance(drafter, Oracle):
            assert engine.accepted == (engine.drafted if drafter.shift == 0 else 0)
        if isinstance(drafter, Oracle) and drafter.shift == 0:
            assert engine.drafted > 2 * engine.verified  # (drafts of more than two tokens)
        assert followed.rows and followed.max_error(reference) < 1e-4


def test_mtp_through_prefix_reuse_and_preemption(deepseek):
    """Each prompt's next turn (the prompt, its reply and more) from the prefix cache: the MTP
    layer's K/V in the cached pages, the reply's last positions' included, reused; and a KV
    pool so small the newer request is preempted and recomputes: the same tokens as without
    drafts, the MTP logits the reference's at every step."""
    path, reference = deepseek
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    off = engine_for(path, None)
    vocab = off.runner.config.vocab_size
    first = prompts(vocab)
    replies = [c.output_ids for c in off.generate(first, params)]
    second = [p + r + ids(5, vocab, i) for i, (p, r) in enumerate(zip(first, replies, strict=True))]
    more = [c.output_ids for c in off.generate(second, params)]
    # (longest first: the oracle takes the first prompt a request's tokens start with)
    expected = {tuple(p): p + w for p, w in zip(second + first, more + replies, strict=True)}
    engine = engine_for(path, Oracle(expected, vocab))
    for todo, want in ((first, replies), (second, more)):
        followed = Followed(engine)
        assert [c.output_ids for c in engine.generate(todo, params)] == want
        assert followed.max_error(reference) < 1e-4
    assert engine.reuse.snapshot()["reused_tokens"] >= 64  # (replies included)
    tight = engine_for(path, MTPDrafter(), kv_tokens=64)
    followed = Followed(tight)
    assert [c.output_ids for c in tight.generate(first, params)] == replies
    assert tight.preemptions > 0
    assert followed.max_error(reference) < 1e-4


def test_a_checkpoint_without_mtp_refuses_mtp_and_auto_falls_back(tmp_path, deepseek):
    """`mtp` on a checkpoint whose config declares an MTP layer its tensors lack, or that
    declares none: a clear error; `auto` drafts by prompt lookup there, by MTP where the layer
    is, and `ngram` and `off` never read it."""
    declared, _ = build("deepseek_v3", tmp_path / "v3")  # (num_nextn_predict_layers 1, no tensors)
    with pytest.raises(MTPUnavailableError, match="declares 1 next-token-prediction"):
        load_model(declared, dtype="float32", mtp="on")
    none, _ = build("qwen3_moe", tmp_path / "moe")
    with pytest.raises(MTPUnavailableError, match=r"no next-token-prediction \(MTP\) layer"):
        LLMEngine.from_config(EngineConfig(model=none, device="cpu", speculative="mtp"))
    assert not load_model(declared, dtype="float32", mtp="auto").config.mtp
    assert isinstance(drafter_for("auto", mtp=False), PromptLookup)
    assert isinstance(drafter_for("auto", mtp=True), MTPDrafter)
    assert isinstance(drafter_for("mtp", mtp=True), MTPDrafter)
    assert type(drafter_for("ngram", mtp=True)) is PromptLookup
    assert [mtp_reading(m, "cpu") for m in ("mtp", "auto", "ngram", "off")] == [
        "on",
        "auto",
        "off",
        "off",
    ]
    assert mtp_reading("auto", "cuda") == "off"  # (a GPU: MTP steps would lose their graphs)
    path, _ = deepseek
    assert load_model(path, dtype="float32", mtp="auto").config.mtp
    plain = load_model(path, dtype="float32")  # (its MTP tensors skipped: no memory)
    assert not plain.config.mtp and plain.model.mtp is None
    assert len(plain.model.layers) == plain.config.num_layers
