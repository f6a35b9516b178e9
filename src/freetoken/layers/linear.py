"""The dense layer every module uses: torch's, except decode-sized batches on the CPU, which go
through the native kernel's thread team (kernels/cpu_linear.py says why).

A layer's weight may be kept quantized (a GGUF file's blocks, weights/expert_format.py's
QuantizedWeight: the loader keeps it so on the CPU). Decode-sized batches on the CPU then read
the blocks (`native_qlinear`); anything else (a prompt's rows, another device) dequantizes the
weight to x's dtype for that call (on the CPU by the native decoders, on the team) and
multiplies with torch: a prompt is a GEMM, which torch's kernels do far better than dot
products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.cpu_linear import (
    dequantized,
    native_linear,
    native_qlinear,
    takes,
    takes_quantized,
)
from freetoken.weights.expert_format import QuantizedWeight


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., H] . weight [N, H]^T + bias."""
    if isinstance(weight, QuantizedWeight):
        rows = x.reshape(-1, x.shape[-1])
        if takes_quantized(rows, weight):
            return native_qlinear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, dequantized(weight, x.dtype).to(x.device), bias)
    if takes(x, weight):
        return native_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (the same parameters, so checkpoints load the same), computed by `linear`; or,
    once given one (`keep_quantized`), from a quantized weight in place of its `weight`."""

    quantized: QuantizedWeight | None = None
    # A stacked layer's dense weight (`stacked`), held outside the parameters: its layers'
    # weights are views of its rows, and those are what a checkpoint names and saves.
    stack: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        # Models are built on the meta device and their weights loaded: nothing to draw there
        # (torch's init on meta tensors runs Python reference ops: 2 s of a 16-layer model's
        # start on the H200 machine).
        if not self.weight.is_meta:
            super().reset_parameters()

    def keep_quantized(self, weight: QuantizedWeight) -> None:
        """Compute from `weight` (its blocks) from now on; the dense `weight` parameter goes."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"a quantized weight of shape {weight.shape} for a layer of "
                f"{(self.out_features, self.in_features)}"
            )
        self.weight = None  # (nn.Module: the parameter's entry becomes None, its memory freed)
        self.quantized = weight

    def _apply(self, fn, recurse=True):
        # .to(device) and the like move the quantized parts too, but never cast them: their
        # dtypes are the format's (fn is given an empty tensor to learn where it goes)
        super()._apply(fn, recurse)
        if self.stack is not None:
            self.stack = fn(self.stack)
        if self.quantized is not None:
            device = fn(torch.empty(0, device=self.quantized.device)).device
            if device != self.quantized.device:
                self.quantized = self.quantized.to(device)
        return self

    @property
    def computed_weight(self) -> torch.Tensor | QuantizedWeight:
        """What `forward` multiplies by: the quantized weight once kept, a stacked layer's
        rows, else `weight`."""
        if self.quantized is not None:
            return self.quantized
        return self.stack if self.stack is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.computed_weight, self.bias)


def stacked(*layers: Linear, dense: bool = True) -> Linear | None:
    """One Linear computing `layers` (all of one input) at once, their outputs side by side, or
    None where they cannot be: q, k and v, gate and up, a compressed attention's projections of
    x. One call a decode step where there were several: on the CPU one job of the thread team
    where each was a handoff to it; on the GPU one GEMM launch where each was one. Weights stack
    when all are kept quantized in one format (`QuantizedWeight.stacked`), or, with `dense`,
    all are dense in one dtype on one device; their biases alike. Each layer's weight becomes
    a view of the stacked rows: the memory is not doubled, a checkpoint still names each, and
    each still computes alone (a prompt's rows, the tests). Each output is the layer's own,
    bit for bit on the CPU's native path (each dot product is the same); torch's GEMMs may
    block the sums by the matrix's width (within rounding)."""
    if len({layer.bias is None for layer in layers}) != 1:
        return None
    if all(layer.quantized is not None for layer in layers):
        return _stacked_quantized(layers)
    if not dense:
        return None
    weights = [layer.weight for layer in layers]
    first = weights[0]
    if any(
        w is None
        or w.dtype != first.dtype
        or w.device != first.device
        or w.shape[1:] != first.shape[1:]
        or w.is_meta
        for w in weights
    ):
        return None
    with torch.no_grad():
        weight = torch.cat(weights)
    out = _stacked_layer(layers)
    out.weight = None
    out.stack = weight
    for layer, view in zip(layers, weight.split([w.shape[0] for w in weights]), strict=True):
        layer.weight = nn.Parameter(view, requires_grad=False)
    return out


def outputs(
    x: torch.Tensor, layers: tuple[Linear, ...], stack: Linear | None
) -> list[torch.Tensor]:
    """Each of `layers`' output of x: through `stack` (`stacked(*layers)`) where there is one,
    its columns split as views, else layer by layer."""
    if stack is None:
        return [layer(x) for layer in layers]
    return list(stack(x).split([layer.out_features for layer in layers], dim=-1))


def _stacked_quantized(layers: tuple[Linear, ...]) -> Linear | None:
    weights = [layer.quantized for layer in layers]
    weight = QuantizedWeight.stacked(weights)
    if weight is None:
        return None
    out = _stacked_layer(layers)
    out.keep_quantized(weight)
    for layer, view in zip(layers, weight.split_rows([w.shape[0] for w in weights]), strict=True):
        layer.quantized = view
    return out


def _stacked_layer(layers: tuple[Linear, ...]) -> Linear:
    """The Linear of `layers` stacked, with their biases (its weight to be given)."""
    biased = layers[0].bias is not None
    rows = sum(layer.out_features for layer in layers)
    out = Linear(layers[0].in_features, rows, bias=biased, device="meta")
    if biased:
        with torch.no_grad():
            bias = torch.cat([layer.bias for layer in layers])
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out
