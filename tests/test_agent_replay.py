"""A scripted 10-turn agent conversation under the three edit styles agents use: each turn
recomputes only what differs from what earlier turns left in the prefix cache (full-attention
model), plus the distance back to the deepest anchor checkpoint (hybrid model)."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.demo import demo_checkpoint
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams
from tiny_models import build_chat_model

TURNS = 10
GREEDY = SamplingParams(max_new_tokens=4, temperature=0)
PLACEHOLDER = "[old tool output removed]"


@pytest.fixture()
def engine(tmp_path_factory, monkeypatch):
    """A fresh engine (an empty prefix cache) per conversation."""
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    # Page size 1: reuse is exact to the token, so recomputed tokens are the new suffix.
    return LLMEngine.from_config(
        EngineConfig(
            model=demo_checkpoint(),
            device="cpu",
            dtype="float32",
            kv_cache_tokens=16384,
            page_size=1,
        )
    )


def conversation(turn: int, style: str) -> list[dict]:
    """The messages an agent sends at `turn`, edited the way `style` edits them."""
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing test in utils.py."},
    ]
    for t in range(turn):
        latest = t == turn - 1
        thinking = f"<think>plan step {t}: look at file {t}</think>"
        reply = f"I will inspect file_{t}.py next." if latest or style != "openclaw" else ""
        content = (thinking if latest or style != "openclaw" else "") + reply
        messages.append({"role": "assistant", "content": content or f"Step {t}."})
        output = f"contents of file_{t}.py: " + "def f(x): return x  # " * 3
        if style == "opencode" and t < turn - 2:
            output = PLACEHOLDER
        if style == "swe-agent" and t < turn - 3:
            output = "(observation omitted)"
        messages.append({"role": "user", "content": f"Observation {t}: {output}"})
    return messages


def longest_stored_prefix(prompt: list[int], stored: list[list[int]]) -> int:
    best = 0
    for seq in stored:
        n = 0
        for a, b in zip(prompt, seq, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1)


@pytest.mark.parametrize("style", ["openclaw", "opencode", "swe-agent"])
def test_recompute_is_only_the_new_suffix(engine, style):
    tok, stored = engine.tokenizer, []
    recomputed_total = prompt_total = 0
    for turn in range(1, TURNS + 1):
        prompt = tok.encode(tok.render_chat(conversation(turn, style)))
        expected_reuse = longest_stored_prefix(prompt, stored)
        req = engine.add_request(prompt, GREEDY)
        while not req.finished:
            engine.step()
        assert req.cached_tokens == expected_reuse, f"turn {turn}"
        # The system prompt and the task never change: every later turn reuses at least them.
        assert turn == 1 or req.cached_tokens > 20
        recomputed_total += len(prompt) - req.cached_tokens
        prompt_total += len(prompt)
        # What this turn leaves in the cache: its prompt and output, the last token unfed.
        stored.append((prompt + req.output_ids)[:-1])
    assert recomputed_total < prompt_total


# -- the hybrid half: Qwen3-Next and Kimi-Linear models resume only at anchor checkpoints ---


@pytest.fixture(scope="module", params=["qwen3_next", "kimi_linear"])
def hybrid_model(request, tmp_path_factory):
    return build_chat_model(request.param, tmp_path_factory.mktemp("hybrid") / "m")[0]


def hybrid_engine(path, anchors: int) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(
            model=path,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=16384,
            page_size=1,
            state_anchors=anchors,
        )
    )


def anchor_positions(tokens: list[int], boundaries: dict[int, int]) -> set[int]:
    """Where a sequence fed `tokens` saves anchors: after an AFTER boundary token, before a
    BEFORE one (a reference model of kv/anchors.py's rule)."""
    return {i + boundaries[t] for i, t in enumerate(tokens) if t in boundaries} - {0}


def common_prefix(a: list[int], b: list[int]) -> int:
    return longest_stored_prefix([*a, -1], [b])


@pytest.mark.parametrize("style", ["openclaw", "opencode", "swe-agent"])
def test_hybrid_recomputes_the_new_suffix_plus_the_distance_from_the_deepest_anchor(
    hybrid_model, style
):
    """Turn by turn: recomputed = new suffix + distance back from the end of the matched
    prefix to the deepest anchor on it; without anchors the whole prompt is recomputed. The
    tokens are the same either way."""
    anchored, plain = hybrid_engine(hybrid_model, 256), hybrid_engine(hybrid_model, 0)
    tok, stored = anchored.tokenizer, []
    boundaries = anchored.anchors.boundaries
    distances = []
    for turn in range(1, TURNS + 1):
        prompt = tok.encode(tok.render_chat(conversation(turn, style)))
        matched = longest_stored_prefix(prompt, stored)
        anchor = max(
            (
                p
                for seq in stored
                for p in anchor_positions(seq, boundaries)
                if p <= min(common_prefix(prompt, seq), len(prompt) - 1)
            ),
            default=0,
        )
        runs = {}
        for name, engine in (("anchored", anchored), ("plain", plain)):
            req = engine.add_request(prompt, GREEDY)
            while not req.finished:
                engine.step()
            runs[name] = req
        req = runs["anchored"]
        new_suffix, distance = len(prompt) - matched, matched - anchor
        assert req.recomputed_tokens == new_suffix + distance, f"turn {turn}"
        assert req.anchor == (anchor or None)
        assert runs["plain"].cached_tokens == 0  # no anchors: the whole prompt again
        assert req.output_ids == runs["plain"].output_ids
        distances.append(distance)
        stored.append((prompt + req.output_ids)[:-1])
    # Every message ends on an anchor (<|im_end|>): an edit inside a message (a tool output
    # replaced after its "Observation n:" header) recomputes only that message's head again.
    assert max(distances) < 16, distances
    stats = anchored.reuse.snapshot()
    assert stats["anchor_restores"] == TURNS - 1
    assert stats["recomputed_tokens"] < stats["prompt_tokens"]
