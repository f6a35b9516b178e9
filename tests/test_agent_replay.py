"""A scripted 10-turn agent conversation under the three edit styles agents use: each turn
recomputes only what differs from what earlier turns left in the prefix cache."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams

TURNS = 10
GREEDY = SamplingParams(max_new_tokens=4, temperature=0)
PLACEHOLDER = "[old tool output removed]"


@pytest.fixture()
def engine(tmp_path_factory, monkeypatch):
    """A fresh engine (an empty prefix cache) per conversation."""
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    # Page size 1: reuse is exact to the token, so recomputed tokens are the new suffix.
    return LLMEngine.from_config(
        EngineConfig(device="cpu", dtype="float32", kv_cache_tokens=16384, page_size=1)
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
