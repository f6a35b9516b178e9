"""The dense layer every module uses: torch's, except decode-sized batches on the CPU, which go
through the native kernel's thread team (kernels/cpu_linear.py says why)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.cpu_linear import native_linear, takes


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., H] . weight [N, H]^T + bias."""
    if takes(x, weight):
        return native_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (the same parameters, so checkpoints load the same), computed by `linear`."""

    def reset_parameters(self) -> None:
        # Models are built on the meta device and their weights loaded: nothing to draw there
        # (torch's init on meta tensors runs Python reference ops: 2 s of a 16-layer model's
        # start on the H200 machine).
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
