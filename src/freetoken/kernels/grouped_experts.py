"""Grouped routed-expert compute for decode, reading expert weights by slot id.

All MoE layers share one device pool of S expert slots: `w_gate_up [S, 2I, H]` (gate rows, then
up rows) and `w_down [S, H, I]`. A decode step of one MoE layer has T tokens with k routes each;
route (t, j) names the slot holding its expert, or -1 when the route is computed elsewhere (on
the CPU, for a cache miss) and contributes nothing here.

`grouped_expert_forward` runs the whole layer as three Triton launches on CUDA, independent of
how many experts are used (no Python loop over experts, no host sync):

1. gate/up + gated unit, grid (routes, I / GATE_UP_BLOCK_N): each program reads the gate block
   n and the up block n of its route's slot (and their biases), so `a = glu(gate, up)` is fused
   and only `a` ([R, I], tiny) goes back to memory;
2. down, grid (routes, H / DOWN_BLOCK_N, splits): `c[r] = weight[r] * (W_d[slot] @ a[r])`, or
   where a format splits the columns (`down_split`), each split's fp32 partial of the product;
3. reduce, grid (T, H / REDUCE_BLOCK): `out[t] = sum_j c[t * k + j]` in route order (the
   partials of a split route added in split order first).

Decode is a batch of matrix-vector products, so the cost is streaming expert weights from HBM
(9.4 MB per Qwen3-30B-A3B expert in bf16); the kernels are plain GEMVs laid out so that every
weight row is read contiguously along its inner dimension. Summing each token's routes in a
fixed order in a separate pass (instead of atomics) keeps the output deterministic. Launching
three Triton kernels from Python costs more host time (85-150 us per call measured on the H200
machine) than the GPU work at batch 1 (~26 us), so decode should capture its step in a CUDA
graph; the kernels are capturable (no host sync, no data-dependent shapes).

Experts with biases (gpt-oss) pass `b_gate_up [S, 2I]`, a bank of gate/up biases indexed by the
same slot ids, added to the projections before the gated unit; `act` names the unit
(activations.py: `act(gate) * up`, or gpt-oss's clamped `swiglu_oai`).

Experts kept quantized (weights/expert_format.py: fp8 with block scales, mxfp4, nvfp4, GGUF's
q8_0, K-quants and legacy 4- and 5-bit types) come as `QuantizedBank`s for both projections.
The decode kernels read their bytes and dequantize tile by tile in registers (a quarter to a
half of the bf16 bytes streamed), each weight computed as the format defines it and rounded to
x.dtype, so the result is the dense kernels' on the dequantized banks. Long chunks dequantize
the used slots a window at a time (`dequantize_slots`, one Triton launch on CUDA) and run the
grouped GEMMs on them.

`reference_grouped_experts` is the pure-torch definition of the result (used on CPU and as the
test oracle). The kernels reproduce its dtype rounding steps: the gate/up projections, the
activation, the product and the down projection are each rounded to x.dtype where torch would
round them, so bf16 results differ from the reference essentially only by accumulation order;
`swiglu_oai` alone is rounded once where torch rounds op by op (a bf16 rounding or so more).

This module chooses the path; the parts, each importing only those below it:

- grouped_gemm.py: `grouped_gemm_experts` and `dequantize_slots`, for long chunks;
- grouped_launch.py: the decode kernels' launch parameters per format and their launchers
  (`triton_grouped_expert_forward`, `triton_dequantize_slots`);
- grouped_kernels.py: the Triton kernels (gate/up and the gated unit, down, the route reduce,
  the dequantize kernel);
- grouped_tiles.py: the Triton helpers that read each format's weights tile by tile;
- grouped_reference.py: `reference_grouped_experts` and the argument checks every path shares.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freetoken.kernels.grouped_gemm import grouped_gemm_experts
from freetoken.kernels.grouped_launch import triton_available, triton_grouped_expert_forward
from freetoken.kernels.grouped_reference import Bank, reference_grouped_experts

# The decode kernels read an expert's weights once per route: right for decode, where routes
# rarely share an expert, wasteful for a prefill chunk, where hundreds of tokens do. From this
# many routes per call, the routes are sorted by expert and run as grouped GEMMs
# (`grouped_gemm_experts`), which read each used expert once.
GROUPED_GEMM_FROM_ROUTES = 512


def grouped_expert_forward(
    x: Tensor,
    slots: Tensor,
    weights: Tensor,
    w_gate_up: Bank,
    w_down: Bank,
    act: str = "silu",
    b_gate_up: Tensor | None = None,
) -> Tensor:
    """Gate-weighted sum over each token's routes of down(glu(gate(x), up(x))), with the
    expert weights of route (t, j) at slot slots[t, j] of the banks; -1 skips a route.

    x [T, H] (bf16/fp16/fp32); slots [T, k] int32/int64; weights [T, k] (fp32 or x.dtype);
    w_gate_up [S, 2I, H] (gate rows, then up rows); w_down [S, H, I] (each dense in x.dtype, or
    both a QuantizedBank); b_gate_up [S, 2I] or None (the gate/up projections' biases). Returns
    [T, H] in x.dtype, deterministic. On CUDA: Triton kernels for decode-sized calls (quantized
    banks dequantized in them), grouped GEMMs for long chunks (`GROUPED_GEMM_FROM_ROUTES`); the
    torch reference elsewhere.
    """
    if x.is_cuda:
        if slots.numel() >= GROUPED_GEMM_FROM_ROUTES and hasattr(torch, "_grouped_mm"):
            return grouped_gemm_experts(x, slots, weights, w_gate_up, w_down, act, b_gate_up)
        if triton_available():
            return triton_grouped_expert_forward(
                x, slots, weights, w_gate_up, w_down, act, b_gate_up
            )
    return reference_grouped_experts(x, slots, weights, w_gate_up, w_down, act, b_gate_up)
