"""A dense MLP's gated unit in one launch on the GPU: `glu(act)(gate, up)` over the stacked
gate/up projection's output [T, 2I] (layers/mlp.py, once `stack_projections` has run).

torch computes it op by op: a plain activation and the product are two launches, DeepSeek-V4's
clamped SwiGLU four (two clamps, SiLU, the product), each reading and writing the whole row; at
batch 1 each is a kernel's latency for a few KB. The kernel computes a row's unit with the
grouped experts' formula (grouped_kernels.py's `_glu`: the activation rounded to the dtype
before the product, as torch rounds it), so the activation has one definition for the dense MLP
and the experts. The torch code (activations.py) stays the reference, and the CPU's path.
"""

from __future__ import annotations

import torch

from freetoken.activations import SWIGLU_OAI, activation_code

try:
    import triton
    import triton.language as tl

    from freetoken.kernels.grouped_kernels import _glu
except ImportError:  # CPU-only installs
    triton = None


def kernel_takes(gate_up: torch.Tensor, act: str) -> bool:
    """Whether the kernel computes this unit: a CUDA tensor, with Triton; not gpt-oss's
    SwiGLU, which the kernels round once where torch rounds op by op (no dense MLP has it)."""
    return triton is not None and gate_up.is_cuda and act != SWIGLU_OAI


def glu(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """glu(act)(gate, up) of gate_up [..., 2I] (gate then up, as the stacked projection lays
    them out) -> [..., I] in gate_up's dtype."""
    shape = gate_up.shape
    rows = gate_up.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    inter = shape[-1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(inter), 1024)
    _glu_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, inter, rows.stride(0), ACT=activation_code(act), BLOCK=block
    )
    return out.view(*shape[:-1], inter)


if triton is not None:

    @triton.jit
    def _glu_kernel(GU, OUT, inter, stride, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(GU + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GU + row * stride + inter + cols, mask=ok, other=0.0).to(tl.float32)
        unit = _glu(gate, up, OUT.dtype.element_ty, ACT)
        tl.store(OUT + row * inter + cols, unit.to(OUT.dtype.element_ty), mask=ok)
