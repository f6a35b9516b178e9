"""The native RMSNorm and rotary embedding of a decode step's rows on the CPU (kernels/norm_rope.py,
cpu_layers.c) against the torch reference they replace (layers/norm.py, layers/rope.py)."""

import pytest
import torch

from freetoken.kernels import cpu_team, norm_rope
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import rotary_reference

pytestmark = pytest.mark.skipif(cpu_team.library() is None, reason="no native library here")


def _norm(dim, dtype, zero_centered, scale_fp32, seed=0):
    torch.manual_seed(seed)
    norm = RMSNorm(dim, 1e-6, zero_centered, scale_fp32).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim) * 0.3 + (0.0 if zero_centered else 1.0))
    return norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["llama", "scale_fp32", "zero_centered"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_native_norm_matches_the_reference(dtype, mode, rows):
    norm = _norm(896, dtype, mode == "zero_centered", mode == "scale_fp32")
    x = (torch.randn(rows, 896) * 3).to(dtype)
    delta = (torch.randn(rows, 896) * 2).to(dtype)
    with torch.no_grad():
        assert norm_rope.native_takes(x, delta, norm.weight)
        total, out = norm_rope.cpu_rms_norm(
            x, delta, norm.weight, norm.eps, norm.zero_centered, norm.scale_fp32
        )
        assert torch.equal(total, x + delta)
        ref = norm.reference(x + delta)
        # Only the sum of squares' order differs: in bf16 the same values but for a rare
        # last-bit flip, in fp32 within a few ulps.
        if dtype == torch.bfloat16:
            assert (out == ref).float().mean().item() > 0.995
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-5)
        else:
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        alone = norm(x)  # the module's own path: no delta
        assert torch.equal(
            alone,
            norm_rope.cpu_rms_norm(
                x, None, norm.weight, norm.eps, norm.zero_centered, norm.scale_fp32
            )[1],
        )


def test_the_module_takes_the_native_path_only_for_decode_rows(monkeypatch):
    norm = _norm(64, torch.bfloat16, False, False)
    calls = []
    real = norm_rope.cpu_rms_norm
    monkeypatch.setattr(norm_rope, "cpu_rms_norm", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        norm(torch.randn(4, 64).to(torch.bfloat16))
        assert calls == [1]
        norm(torch.randn(norm_rope.CPU_MAX_ROWS + 1, 64).to(torch.bfloat16))  # a prompt: torch
        assert calls == [1]
        x = torch.randn(2, 64)  # fp32 rows, a bf16 weight: torch's promotion, not ours
        assert not norm_rope.native_takes(x, norm.weight)
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert not norm_rope.native_takes(x, norm.weight)  # autograd on: torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rot", [64, 32])
def test_native_rotary_matches_the_reference_bit_for_bit(dtype, rot):
    torch.manual_seed(1)
    t, heads, kv_heads, d = 3, 14, 2, 64
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d) * 2).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)  # strided views, as attention makes them
    positions = torch.tensor([5, 900, 31000])
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    with torch.no_grad():
        for x in (q, k):
            assert norm_rope.native_takes(x, cos, sin)
            assert torch.equal(
                norm_rope.cpu_apply_rotary(x, cos, sin), rotary_reference(x, cos, sin)
            )
