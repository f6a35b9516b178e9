"""bf16 greedy tokens equal to transformers in bf16 on the same device (CPU here, CUDA where
present), and fp32 exactness on CUDA. CUDA cases skip without a GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.runner import ModelRunner
from freetoken.models.loading import load_model
from tiny_models import FAMILIES, build

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
STEPS = 32


def greedy_reference(hf, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy decode with its KV cache, as its users run it. (Recomputing the
    whole sequence each step is not the same computation in bf16: random tiny models have
    exact ties between bf16 logits that the two orders of arithmetic break differently.)"""
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def greedy_ours(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    seq = runner.new_sequence()
    logits = runner.forward([seq], [prompt])
    out = []
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([seq], [[out[-1]]])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_greedy_tokens_match_transformers(family, device, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = build(family, tmp_path / family, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    runner = ModelRunner(load_model(path, dtype="bfloat16", device=device), kv_cache_tokens=256)
    prompt = torch.randint(
        0, hf.config.vocab_size, (32,), generator=torch.Generator().manual_seed(3)
    )
    assert greedy_ours(runner, prompt.tolist(), STEPS) == greedy_reference(
        hf, prompt.tolist(), STEPS
    )


@needs_cuda
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
