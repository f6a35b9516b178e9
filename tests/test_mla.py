"""Multi-head latent attention (layers/mla.py): the paged cache holds each token's latent and
RoPE key part only, once per layer; prompts (expanded from the cached latents, in one chunk or
after a cached prefix, several sequences at once) and paged decode (the absorbed form) match
transformers with and without a low-rank query, and the pool survives prefix copies."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.runner import ModelRunner, kv_bytes_per_token
from freetoken.models.loading import load_model
from test_exactness import reference_logits
from tiny_models import FAMILIES, build

RANK, ROPE = (
    FAMILIES["deepseek_v3"][2]["kv_lora_rank"],
    FAMILIES["deepseek_v3"][2]["qk_rope_head_dim"],
)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_the_cache_holds_the_latent_and_decode_matches_transformers(q_lora_rank, tmp_path):
    path, hf = build("deepseek_v3", tmp_path / "m", q_lora_rank=q_lora_rank)
    loaded = load_model(path, dtype="float32")
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    cfg, kv = loaded.config, runner.kv
    # one pool a layer, [latent, k_pe] a token: no expanded keys or values, no separate V
    assert kv.v is kv.k and all(pool.shape[1:] == (1, RANK + ROPE) for pool in kv.k)
    per_token = cfg.num_layers * (RANK + ROPE) * 4
    assert kv.page_bytes == per_token * kv.page_size
    assert kv_bytes_per_token(cfg, torch.float32) == per_token
    expanded = 2 * cfg.num_layers * cfg.num_heads * (16 + ROPE) * 4  # what GQA would keep
    assert per_token * 4 < expanded

    seq = runner.new_sequence()
    ids = list(range(3, 43))
    ours = runner.forward([seq], [ids], all_logits=True)
    assert (ours - reference_logits(hf, ids)).abs().max().item() < 1e-4
    worst = 0.0
    for _ in range(12):
        ids.append(int(ours[-1].argmax()))
        ours = runner.forward([seq], [[ids[-1]]])
        worst = max(worst, (ours - reference_logits(hf, ids)[-1:]).abs().max().item())
    assert worst < 1e-4


def test_prompts_after_a_cached_prefix_and_side_by_side_match_transformers(tmp_path):
    """The expanded prefill reads each sequence's whole context from the pool: a chunk after a
    cached prefix (queries the last positions of their keys) and two sequences of different
    lengths in one forward."""
    path, hf = build("deepseek_v3", tmp_path / "m")
    runner = ModelRunner(load_model(path, dtype="float32"), kv_cache_tokens=256, page_size=8)
    ids = list(range(3, 43))
    seq = runner.new_sequence()
    runner.forward([seq], [ids[:27]])
    ours = runner.forward([seq], [ids[27:]], all_logits=True)
    assert (ours - reference_logits(hf, ids)[27:]).abs().max().item() < 1e-4
    other = [5, 9, 11, 2, 7, 30, 31]
    a, b = runner.new_sequence(), runner.new_sequence()
    ours = runner.forward([a, b], [ids, other], all_logits=True)
    want = torch.cat([reference_logits(hf, ids), reference_logits(hf, other)])
    assert (ours - want).abs().max().item() < 1e-4


def test_the_shared_pool_survives_resizes_and_prefix_copies(tmp_path):
    path, _ = build("deepseek_v3", tmp_path / "m")
    runner = ModelRunner(load_model(path, dtype="float32"), kv_cache_tokens=64, page_size=8)
    kv = runner.kv
    seq = runner.new_sequence()
    runner.forward([seq], [list(range(3, 15))])
    before = [pool.clone() for pool in kv.k]
    runner.resize_kv(16)
    assert kv.v is kv.k and kv.num_pages == 16
    for pool, old in zip(kv.k, before, strict=True):
        assert torch.equal(pool[: old.shape[0]], old)
    kv.copy_prefix(seq.pages[1], 12, 4)  # copy-on-write of a shared page's first slots
    for pool in kv.k:
        assert torch.equal(pool[12 * 8 : 12 * 8 + 4], pool[seq.pages[1] * 8 : seq.pages[1] * 8 + 4])


def test_decode_graphs_are_kept_for_heads_the_device_kernel_takes():
    """The Triton decode kernel takes power-of-two heads of 16 to 512 (Gemma-4's full layers:
    512), and latent heads read as their own values (576 = 512 + 64 for DeepSeek-V3: the
    latent, then the RoPE part), so ModelRunner captures decode graphs for MLA models too;
    other widths take the torch path, which reads lengths on the host (a graph would replay
    the capture's lengths)."""
    from freetoken.kernels import paged_attention

    if paged_attention.triton is None:
        pytest.skip("needs triton")
    assert paged_attention.triton_decode_width(128) and paged_attention.triton_decode_width(16)
    assert paged_attention.triton_decode_width(512)
    assert paged_attention.triton_decode_width(576, values_are_keys=True)
    assert paged_attention.triton_decode_width(64 + 16, values_are_keys=True)
    for width in (576, 80, 8, 1024):
        assert not paged_attention.triton_decode_width(width), width
    for width in (512 + 8, 1024 + 64, 512 + 96, 300):  # (a rest under 16, too wide, not 2^n)
        assert not paged_attention.triton_decode_width(width, values_are_keys=True), width
    # (the value columns the caller reads must lie in the kernel's value part: a latent of 520
    # with a RoPE part of 56 is 576 wide too, but its last 8 latent values would be cut off)
    assert paged_attention.triton_decode_width(576, True, values=512)
    assert not paged_attention.triton_decode_width(576, True, values=520)
