"""Grouped expert compute for long chunks: routes sorted by slot, one grouped GEMM a projection.

The decode kernels (grouped_kernels.py) read an expert's weights once per route: right for
decode, where routes rarely share an expert, wasteful for a prefill chunk, where hundreds of
tokens do. `grouped_gemm_experts` reads each used expert once, with `torch._grouped_mm` over
the slots (at most GROUPED_MM_MAX_GROUPS a call); quantized banks are dequantized a window of
used slots at a time (`dequantize_slots`: one Triton launch on CUDA, the format's definition
elsewhere).
"""

from __future__ import annotations

import torch
from torch import Tensor

from freetoken.activations import glu
from freetoken.kernels.grouped_launch import triton_available, triton_dequantize_slots
from freetoken.kernels.grouped_reference import Bank, check_args, check_bias, sum_routes
from freetoken.weights.expert_format import QuantizedBank

GROUPED_MM_MAX_GROUPS = 512  # below torch._grouped_mm's limit on groups (slots) per call (1024)
# Quantized banks in grouped GEMMs: the used experts dequantized this many bytes at a time.
DEQUANTIZED_WINDOW_BYTES = 256 * 2**20


def grouped_gemm_experts(
    x: Tensor,
    slots: Tensor,
    weights: Tensor,
    w_gate_up: Bank,
    w_down: Bank,
    act: str = "silu",
    b_gate_up: Tensor | None = None,
) -> Tensor:
    """`reference_grouped_experts` for long chunks: routes sorted by slot and each projection
    run as ONE grouped GEMM over all slots (`torch._grouped_mm`), so a layer costs a dozen
    launches however many experts it uses, where the reference launches a handful per expert.
    Same rounding steps as the reference (each GEMM's output is an x.dtype tensor)."""
    t, k, h, i = check_args(x, slots, weights, w_gate_up, w_down)
    check_bias(b_gate_up, w_gate_up, x.dtype)
    num_slots = w_gate_up.shape[0]
    flat = slots.reshape(-1).long()
    # Skipped routes (-1) sort after every slot's group, past the last offset: the GEMMs leave
    # those rows unwritten and the mask below zeroes them.
    key = torch.where(flat >= 0, flat, num_slots)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_slots + 1)[:num_slots]
    windows = _slot_windows(counts, len(order))
    hidden = _grouped_mm(x[order // k], w_gate_up, counts, windows)
    if b_gate_up is not None:  # (skipped routes read slot 0's: their rows are zeroed below)
        hidden = hidden + b_gate_up[key[order].clamp(max=num_slots - 1)]
    gate, up = hidden.split(i, dim=-1)
    y = _grouped_mm(glu(act)(gate, up), w_down, counts, windows)
    c = (y * weights.reshape(-1)[order, None]).to(x.dtype)
    c = torch.where((key[order] < num_slots)[:, None], c, 0)
    return sum_routes(torch.empty_like(c).index_copy_(0, order, c).view(t, k, h))


def _slot_windows(counts: Tensor, num_rows: int) -> list[tuple[slice, int, int]]:
    """Windows of at most GROUPED_MM_MAX_GROUPS slots, each with the rows of the slot-sorted
    routes it covers (one host read of where they start, only when there are several)."""
    num_slots = counts.shape[0]
    if num_slots <= GROUPED_MM_MAX_GROUPS:
        return [(slice(0, num_slots), 0, num_rows)]
    edges = list(range(0, num_slots, GROUPED_MM_MAX_GROUPS))
    starts = [0, *counts.cumsum(0)[[e - 1 for e in edges[1:]]].tolist()]
    return [
        (slice(e, e + GROUPED_MM_MAX_GROUPS), lo, hi)
        for e, lo, hi in zip(edges, starts, [*starts[1:], num_rows], strict=True)
    ]


def _grouped_mm(rows: Tensor, bank: Bank, counts: Tensor, windows) -> Tensor:
    """rows [R, in] sorted by slot (`counts` per slot) times each one's bank[slot].T."""
    if isinstance(bank, QuantizedBank):
        return _grouped_mm_quantized(rows, bank, counts)
    if len(windows) == 1:
        return torch._grouped_mm(rows, bank.transpose(1, 2), offs=counts.cumsum(0).int())
    out = rows.new_empty(rows.shape[0], bank.shape[1])
    for slots, lo, hi in windows:
        ends = counts[slots].cumsum(0).int()
        out[lo:hi] = torch._grouped_mm(rows[lo:hi], bank[slots].transpose(1, 2), offs=ends)
    return out


def _grouped_mm_quantized(rows: Tensor, bank: QuantizedBank, counts: Tensor) -> Tensor:
    """`_grouped_mm` on a quantized bank: the slots the rows use, dequantized into the rows'
    dtype a window at a time (at most DEQUANTIZED_WINDOW_BYTES of dense weights), each window
    one grouped GEMM. Rows of no slot (past the used ones) are left unwritten."""
    _, n, kdim = bank.shape
    used = torch.nonzero(counts).squeeze(1)  # (one host read: a prefill chunk's call)
    used_counts = counts[used]
    starts = [0, *used_counts.cumsum(0).tolist()]
    per = max(1, DEQUANTIZED_WINDOW_BYTES // (n * kdim * rows.element_size()))
    per = min(per, GROUPED_MM_MAX_GROUPS)
    out = rows.new_empty(rows.shape[0], n)
    for first in range(0, len(used), per):
        last = min(first + per, len(used))
        lo, hi = starts[first], starts[last]
        dense = dequantize_slots(bank, used[first:last], rows.dtype)
        ends = used_counts[first:last].cumsum(0).int()
        out[lo:hi] = torch._grouped_mm(rows[lo:hi], dense.transpose(1, 2), offs=ends)
    return out


def dequantize_slots(bank: QuantizedBank, slots: Tensor, dtype: torch.dtype) -> Tensor:
    """The dense weights [len(slots), N, K] in `dtype` of a quantized bank's `slots`: a Triton
    kernel on CUDA, the format's definition in torch elsewhere (the same values)."""
    if bank.device.type == "cuda" and triton_available():
        return triton_dequantize_slots(bank, slots, dtype)
    return bank.dequantize(slots, dtype)
