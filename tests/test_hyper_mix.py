"""DeepSeek-V4's hyper-connection mixes in one kernel (kernels/hyper_mix.py) against their torch
definition: under Triton's interpreter on the CPU (CI), compiled on CUDA where present."""

from __future__ import annotations

import pytest
import torch

from compiled import run_compiled
from freetoken.kernels import hyper_mix
from interpreted import run_interpreted

needs_triton = pytest.mark.skipif(hyper_mix.triton is None, reason="needs Triton")
CASES = [(4, 20, 7), (4, 1, 3), (2, 3, 5), (4, 20, 0)]  # (n, Sinkhorn iterations, tokens)


def _inputs(n: int, tokens: int, device="cpu"):
    gen = torch.Generator().manual_seed(n * 100 + tokens)
    mixes = torch.randn(tokens, (2 + n) * n, generator=gen) * 3
    base = torch.randn((2 + n) * n, generator=gen)
    scale = torch.rand(3, generator=gen) * 2
    return mixes.to(device), base.to(device), scale.to(device)


def _largest_errors(device: str = "cpu") -> list[list[float]]:
    """Per case: the kernel's largest difference from the reference in pre, post and comb,
    and how far comb's columns are from summing to 1."""
    out = []
    for n, iters, tokens in CASES:
        mixes, base, scale = _inputs(n, tokens, device)
        ours = hyper_mix.launch_hc_mix(mixes, base, scale, n, iters, 1e-6)
        ref = hyper_mix.hc_mix_reference(mixes, base, scale, n, iters, 1e-6)
        pairs = zip(ours, ref, strict=True)
        errors = [(a - b).abs().max().item() if a.numel() else 0.0 for a, b in pairs]
        columns = (ours[2].sum(-2) - 1).abs().max().item() if tokens else 0.0
        out.append([*errors, columns])
    return out


@needs_triton
def test_the_kernel_computes_the_reference_under_the_interpreter():
    for (n, iters, _), (pre, post, comb, columns) in zip(
        CASES, run_interpreted("test_hyper_mix", "_largest_errors", timeout=300), strict=True
    ):
        assert max(pre, post, comb) < 1e-5, (n, iters, pre, post, comb)
        assert columns < 1e-3  # (Sinkhorn ends on a column normalisation)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_computes_the_reference_on_cuda():
    for pre, post, comb, columns in _largest_errors("cuda"):
        assert max(pre, post, comb) < 1e-5 and columns < 1e-3


def test_the_cpu_takes_the_reference_path(monkeypatch):
    """On the CPU (or without Triton) hc_mix is the torch reference itself."""
    mixes, base, scale = _inputs(4, 3)
    monkeypatch.setattr(hyper_mix, "launch_hc_mix", lambda *a: pytest.fail("kernel launched"))
    ours = hyper_mix.hc_mix(mixes, base, scale, 4, 20, 1e-6)
    ref = hyper_mix.hc_mix_reference(mixes, base, scale, 4, 20, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


def _merge_float_ops() -> list[str]:
    """The bf16 stream merge compiled for sm_90 (tests/compiled.py): its floating-point
    opcodes."""
    streams = torch.randn(2, 4, 256).bfloat16()
    post, comb, out = torch.rand(2, 4), torch.rand(2, 4, 4), torch.randn(2, 256).bfloat16()
    hyper_mix.hc_merge(streams, post, comb, out)
    (compiled,) = [
        kernel
        for caches in hyper_mix._merge_kernel.device_caches.values()
        for kernel in caches[0].values()
    ]
    lines = [line.split() for line in compiled.asm["ptx"].splitlines()]
    return sorted({w[0] for w in lines if w and w[0].split(".")[0] in ("fma", "add", "mul")})


@needs_triton
def test_the_merge_rounds_its_product_before_the_sum_as_torch_does():
    """torch rounds post x out to bf16, then the sum with the mixed streams: an fma (which the
    compiler makes of casts written in the kernel) rounds once, and on CUDA that tipped
    DeepSeek-V4's bf16 decode off transformers' tokens."""
    ops = run_compiled("test_hyper_mix", "_merge_float_ops", timeout=300)
    assert "add.f32" in ops and not [op for op in ops if op.startswith("fma")], ops
