import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels import norm_rope


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the reference implementations do.

    `zero_centered` (Qwen3-Next): the stored weight is the scale minus one, and the scale is
    applied in fp32 before the cast back (the reference's order, which matters in bf16).
    `scale_fp32` (gpt-oss): the scale applied in fp32 too; otherwise Llama's order, the
    normalised row rounded to the dtype first, then scaled.
    """

    def __init__(self, dim: int, eps: float, zero_centered: bool = False, scale_fp32=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered
        self.scale_fp32 = scale_fp32 or zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_rope.available(x):  # one launch on the GPU (kernels/norm_rope.py)
            return norm_rope.rms_norm(x, self.weight, self.eps, self.zero_centered, self.scale_fp32)
        if norm_rope.native_takes(x, self.weight):  # one call on the CPU at decode
            return norm_rope.cpu_rms_norm(
                x, None, self.weight, self.eps, self.zero_centered, self.scale_fp32
            )[1]
        return self.reference(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None):
        """(s, norm(s)) for the residual sum s = x + delta (x itself where delta is None): on
        the GPU the add and the norm in one launch."""
        if delta is None:
            return x, self(x)
        if norm_rope.available(x):
            return norm_rope.add_rms_norm(
                x, delta, self.weight, self.eps, self.zero_centered, self.scale_fp32
            )
        if norm_rope.native_takes(x, delta, self.weight):
            return norm_rope.cpu_rms_norm(
                x, delta, self.weight, self.eps, self.zero_centered, self.scale_fp32
            )
        s = x + delta
        return s, self.reference(s)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        if self.scale_fp32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 and cast back: an RMSNorm without a weight
    (Gemma-4's values and its router's input)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * silu(gate): the output norm of gated DeltaNet (norm first, then gate).
    Kimi's KDA (`sigmoid_gate`): RMSNorm(x) * sigmoid(gate), the scale applied in fp32."""

    def __init__(self, dim: int, eps: float, sigmoid_gate: bool = False):
        super().__init__(dim, eps, scale_fp32=sigmoid_gate)
        self.gate = torch.sigmoid if sigmoid_gate else F.silu

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # (scaled in fp32: KDA's norm gates it before the one rounding to x's dtype)
        normed = self.reference(x.float() if self.scale_fp32 else x)
        return (normed * self.gate(gate.float())).to(x.dtype)
