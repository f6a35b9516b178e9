"""The grouped expert compute defined in torch, and the argument checks every path shares.

`reference_grouped_experts` is the result `grouped_expert_forward` (grouped_experts.py) gives
on any path: the CPU's executor of cached experts and the tests' oracle. `Bank` is one
projection of S expert slots, dense or kept quantized; a quantized slot is dequantized by the
native decoders on the CPU (cpu_banks.py), by its format's definition elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken.activations import glu
from freetoken.kernels.cpu_banks import decode_expert, decodes
from freetoken.weights.expert_format import QuantizedBank

Bank = Tensor | QuantizedBank  # a projection of S experts: dense [S, N, K], or kept quantized


def check_args(
    x: Tensor, slots: Tensor, weights: Tensor, w_gate_up: Bank, w_down: Bank
) -> tuple[int, int, int, int]:
    """Validate shapes and dtypes (no device sync); return (T, k, H, I)."""
    if x.dim() != 2 or slots.dim() != 2 or weights.shape != slots.shape:
        raise ValueError(
            f"expected x [T, H] and slots, weights [T, k]; got x {tuple(x.shape)}, "
            f"slots {tuple(slots.shape)}, weights {tuple(weights.shape)}"
        )
    t, h = x.shape
    if slots.shape[0] != t:
        raise ValueError(f"slots has {slots.shape[0]} rows for {t} tokens")
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32 or int64, got {slots.dtype}")
    if len(w_gate_up.shape) != 3 or w_gate_up.shape[2] != h or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [S, 2I, {h}], got {tuple(w_gate_up.shape)}")
    i = w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (w_gate_up.shape[0], h, i):
        raise ValueError(
            f"w_down must be [{w_gate_up.shape[0]}, {h}, {i}], got {tuple(w_down.shape)}"
        )
    if type(w_gate_up) is not type(w_down):
        raise ValueError("w_gate_up and w_down must both be dense or both quantized")
    if isinstance(w_gate_up, Tensor) and (w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype):
        raise ValueError(
            f"expert weights ({w_gate_up.dtype}, {w_down.dtype}) must have x's dtype {x.dtype}"
        )
    return t, slots.shape[1], h, i


def _expert(bank: Bank, slot: int, dtype: torch.dtype) -> Tensor:
    """Slot `slot`'s weights [N, K] in `dtype` (a quantized bank's dequantized as defined: by the
    native decoders on the CPU, the same values at a fraction of torch's time)."""
    if isinstance(bank, QuantizedBank):
        if decodes(bank, dtype):
            return decode_expert(bank, slot, dtype)
        return bank.dequantize(slot, dtype)
    return bank[slot]


def check_bias(b_gate_up: Tensor | None, w_gate_up: Bank, dtype: torch.dtype) -> None:
    if b_gate_up is not None and (
        tuple(b_gate_up.shape) != tuple(w_gate_up.shape[:2]) or b_gate_up.dtype != dtype
    ):
        raise ValueError(
            f"b_gate_up must be {tuple(w_gate_up.shape[:2])} of {dtype}, got "
            f"{tuple(b_gate_up.shape)} of {b_gate_up.dtype}"
        )


def reference_grouped_experts(
    x: Tensor,
    slots: Tensor,
    weights: Tensor,
    w_gate_up: Bank,
    w_down: Bank,
    act: str = "silu",
    b_gate_up: Tensor | None = None,
) -> Tensor:
    """Pure-torch definition of `grouped_expert_forward` (any device).

    For each route (t, j) with slots[t, j] >= 0: h = W_gu[s] @ x[t] (+ b_gate_up[s], a second
    op as transformers adds it); a = glu(act)(h[:I], h[I:]);
    y = W_d[s] @ a; out[t] += (y * weights[t, j]).to(x.dtype), all in x.dtype as torch computes
    it, with a token's routes added in order j = 0..k-1. Routes sharing a slot run as one GEMM
    pair (one Python iteration per used slot), so this is also a usable CPU executor.
    """
    t, k, h, i = check_args(x, slots, weights, w_gate_up, w_down)
    check_bias(b_gate_up, w_gate_up, x.dtype)
    unit = glu(act)
    # Per-route contributions, reduced over k in a fixed order below (deterministic, and the
    # order the Triton path uses too).
    contrib = x.new_zeros(t * k, h)
    flat = slots.reshape(-1).long()
    flat_weights = weights.reshape(-1)
    routes = torch.nonzero(flat >= 0).squeeze(1)
    if routes.numel():
        order = routes[torch.argsort(flat[routes], stable=True)]
        used, counts = torch.unique_consecutive(flat[order], return_counts=True)
        start = 0
        for s, n in zip(used.tolist(), counts.tolist(), strict=True):
            rows = order[start : start + n]
            # F.linear reads the [out, in] rows as stored; `x @ w.t()` can make oneDNN repack
            # the expert first (10x slower for a bf16 GEMV on a 2-core CPU).
            hidden = F.linear(x[rows // k], _expert(w_gate_up, s, x.dtype))
            if b_gate_up is not None:
                hidden = hidden + b_gate_up[s]
            gate, up = hidden.split(i, dim=-1)
            y = F.linear(unit(gate, up), _expert(w_down, s, x.dtype))
            contrib[rows] = (y * flat_weights[rows, None]).to(x.dtype)
            start += n
    return sum_routes(contrib.view(t, k, h))


def sum_routes(per_token: Tensor) -> Tensor:
    """[T, k, H] route contributions -> [T, H], added in route order j = 0..k-1 with the
    dtype's rounding after each add (the order the Triton reduce follows too)."""
    out = per_token.new_zeros(per_token.shape[0], per_token.shape[2])
    for j in range(per_token.shape[1]):
        out += per_token[:, j]
    return out
