"""Every family against its transformers reference: fp32 on CPU, prefill then paged decode."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.runner import ModelRunner
from freetoken.models.loading import load_model
from tiny_models import FAMILIES, build

PROMPT_LEN, DECODE_STEPS, TOL = 40, 20, 1e-4


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_match_transformers(family, tmp_path):
    path, hf = build(family, tmp_path / family)
    runner = ModelRunner(load_model(path, dtype="float32"), kv_cache_tokens=256, page_size=8)
    gen = torch.Generator().manual_seed(1)
    vocab = hf.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()

    seq = runner.new_sequence()
    ours = runner.forward([seq], [prompt], all_logits=True)
    ref = reference_logits(hf, prompt)
    assert (ours - ref).abs().max().item() < TOL

    ids = list(prompt)
    worst = 0.0
    for _ in range(DECODE_STEPS):
        ids.append(int(ours[-1].argmax()))
        ours = runner.forward([seq], [[ids[-1]]])
        ref = reference_logits(hf, ids)[-1:]
        worst = max(worst, (ours - ref).abs().max().item())
    assert worst < TOL, f"decode drifted from transformers by {worst}"
    assert seq.length == PROMPT_LEN + DECODE_STEPS


# Families with sliding-window layers (a window of 8 in tiny_models.py): chunks and a shared
# prefix that end inside a window
SLIDING = ["qwen2", "gpt_oss", "gemma4"]


@pytest.mark.parametrize("family", SLIDING)
def test_chunked_prefill_and_a_reused_prefix_match_transformers(family, tmp_path):
    """A prompt prefilled in chunks of 7, and a second prompt continuing from the first one's
    full pages (as the radix cache hands them over) then decoding: transformers' logits."""
    path, hf = build(family, tmp_path / family)
    loaded, page = load_model(path, dtype="float32"), 8
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, 160, (PROMPT_LEN,), generator=gen).tolist()
    second = first[:29] + torch.randint(0, 160, (15,), generator=gen).tolist()
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=page)
    a = runner.new_sequence()
    chunks = [
        runner.forward([a], [first[i : i + 7]], all_logits=True) for i in range(0, PROMPT_LEN, 7)
    ]
    assert (torch.cat(chunks) - reference_logits(hf, first)).abs().max().item() < TOL
    b = runner.new_sequence()
    shared = 3  # pages: 24 tokens, the last window of 8 among them
    b.pages, b.length = list(a.pages[:shared]), shared * page
    ours = [runner.forward([b], [second[shared * page :]], all_logits=True)]
    ids = list(second)
    for _ in range(4):
        ids.append(int(ours[-1][-1].argmax()))
        ours.append(runner.forward([b], [[ids[-1]]], all_logits=True))
    ref = reference_logits(hf, ids)[shared * page :]
    assert (torch.cat(ours) - ref).abs().max().item() < TOL


def test_batched_decode_matches_single_sequences(tmp_path):
    path, hf = build("qwen3_moe", tmp_path / "m")
    loaded = load_model(path, dtype="float32")
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 33, 9)
    ]
    steps = 12

    def decode(runner, prompts):
        seqs = [runner.new_sequence() for _ in prompts]
        logits = runner.forward(seqs, prompts)
        history = [logits]
        for _ in range(steps):
            nxt = [[int(t)] for t in logits.argmax(-1)]
            logits = runner.forward(seqs, nxt)
            history.append(logits)
        return torch.stack(history, 1)  # [B, steps + 1, V]

    batched = decode(ModelRunner(loaded, kv_cache_tokens=512, page_size=4), prompts)
    for i, p in enumerate(prompts):
        alone = decode(ModelRunner(loaded, kv_cache_tokens=512, page_size=4), [p])[0]
        assert (batched[i] - alone).abs().max().item() < 1e-5
