"""A dense MLP's gated unit in one kernel (kernels/gated_unit.py) against its torch definition
(activations.py's `glu`): under Triton's interpreter on the CPU (CI), compiled for sm_90, and on
CUDA where present; and the MLP that launches it, with stacked gate and up, against the MLP's
torch path."""

from __future__ import annotations

import pytest
import torch

from compiled import run_compiled
from freetoken.activations import SWIGLU_CLAMP, glu
from freetoken.kernels import gated_unit
from interpreted import run_interpreted

needs_triton = pytest.mark.skipif(gated_unit.triton is None, reason="needs Triton")
ACTS = ["silu", "gelu", "gelu_pytorch_tanh", "relu", SWIGLU_CLAMP]


def _largest_errors(device: str = "cpu") -> dict[str, float]:
    """Per activation, dtype and shape: the kernel's largest difference from torch's unit
    (relative to the largest value), and per activation the stacked MLP's largest difference
    from its torch path."""
    from freetoken.layers.linear import stacked
    from freetoken.layers.mlp import GatedMLP

    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    out = {}
    for act in ACTS:
        for dtype in dtypes:
            for rows, inter in ((1, 96), (5, 1500), (3, 2048)):  # (one block, several, a tail)
                # (x 6: a clamped unit's limits are crossed)
                gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(device, dtype)
                ref = glu(act)(*gate_up.chunk(2, dim=-1))
                ours = gated_unit.glu(gate_up, act)
                err = (ours.float() - ref.float()).abs().max() / ref.float().abs().max()
                out[f"{act}/{dtype}/{rows}x{inter}"] = err.item()  # (of the largest value)
        mlp = GatedMLP(64, 96, act).to(device)
        x = torch.randn(3, 64, generator=gen).to(device)
        with torch.no_grad():
            want = mlp(x)
            mlp.gate_up_proj = stacked(mlp.gate_proj, mlp.up_proj)
            takes, gated_unit.kernel_takes = gated_unit.kernel_takes, lambda *a: True
            try:
                got = mlp(x)
            finally:
                gated_unit.kernel_takes = takes
        out[f"mlp/{act}"] = (got - want).abs().max().item()
    return out


def _check(results: dict[str, float], dtypes: int) -> None:
    assert len(results) == len(ACTS) * (3 * dtypes + 1)
    for key, err in results.items():
        # fp32: Triton's exp and erf against torch's, a few ulp; bf16: at most one rounding
        # step (the activation rounded, then the product), relative to the largest value
        limit = 2**-7 if "bfloat16" in key else 1e-6
        assert err <= limit, (key, err)


@needs_triton
def test_the_kernel_computes_the_unit_under_the_interpreter():
    _check(run_interpreted("test_gated_unit", "_largest_errors", timeout=300), dtypes=1)


@needs_triton
def test_the_kernel_compiles_for_the_gpu():
    """Every activation's kernel compiled for sm_90 (tests/compiled.py: nothing launched)."""
    assert run_compiled("test_gated_unit", "_compiled", timeout=300) == ACTS


def _compiled() -> list[str]:
    import compiled

    for act in ACTS:
        gated_unit.glu(torch.zeros(2, 2 * 1500, dtype=torch.bfloat16), act)
    assert [c["name"] for c in compiled.COMPILED] == ["_glu_kernel"] * len(ACTS)
    return ACTS


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_computes_the_unit_on_cuda():
    _check(_largest_errors("cuda"), dtypes=2)


def test_the_cpu_and_gpt_oss_units_take_torch():
    assert not gated_unit.kernel_takes(torch.zeros(1, 4), "silu")
    if torch.cuda.is_available():
        assert not gated_unit.kernel_takes(torch.zeros(1, 4, device="cuda"), "swiglu_oai")
