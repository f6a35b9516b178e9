"""On an NVIDIA GPU: fp32 exactness against transformers, and bf16 greedy tokens equal to
transformers in bf16 on the same device. Skipped without CUDA (CI has none)."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.runner import ModelRunner
from freetoken.weights.loader import load_model
from tiny_models import FAMILIES, build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = 32


def greedy_reference(hf, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = hf(ids).logits[0, -1].float().argmax()
            out.append(int(nxt))
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return out


def greedy_ours(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    seq = runner.new_sequence()
    logits = runner.forward([seq], [prompt])
    out = []
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([seq], [[out[-1]]])
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_greedy_tokens_match_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = build(family, tmp_path / family, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    runner = ModelRunner(load_model(path, dtype="bfloat16", device="cuda"), kv_cache_tokens=256)
    prompt = torch.randint(
        0, hf.config.vocab_size, (32,), generator=torch.Generator().manual_seed(3)
    )
    assert greedy_ours(runner, prompt.tolist(), STEPS) == greedy_reference(
        hf, prompt.tolist(), STEPS
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_logits_match_transformers_on_cuda(family, tmp_path):
    path, hf = build(family, tmp_path / family)
    hf = hf.cuda()
    runner = ModelRunner(load_model(path, dtype="float32", device="cuda"), kv_cache_tokens=256)
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    ours = runner.forward([runner.new_sequence()], [ids.tolist()], all_logits=True)
    with torch.no_grad():
        ref = hf(ids.view(1, -1).cuda()).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4
