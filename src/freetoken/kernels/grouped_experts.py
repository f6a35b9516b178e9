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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken.activations import (
    SWIGLU_CLAMP_LIMIT,
    SWIGLU_OAI_ALPHA,
    SWIGLU_OAI_LIMIT,
    activation_code,
    glu,
)
from freetoken.kernels import INTERPRETED
from freetoken.kernels.cpu_banks import decode_expert, decodes
from freetoken.weights.expert_format import MIXED_K_TAG, MIXED_K_WIDTH, QuantizedBank
from freetoken.weights.quantized import K_QUANT_REST, LEGACY_REST

Bank = Tensor | QuantizedBank  # a projection of S experts: dense [S, N, K], or kept quantized

try:  # Triton is optional: CPU-only installs (and CI) run the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# ---------------------------------------------------------------------------------------------
# Launch parameters: fixed, not autotuned; `benchmarks/grouped_experts_bench.py --sweep` measures
# alternatives on the target GPU. At batch 1 a Qwen3-30B-A3B layer (H=2048, I=768, bf16) reads
# 8 routes x 9.4 MB = 75 MB of weights, ~18 us at the H200's ~4.2 TB/s copy bandwidth. Decode
# GEMVs are bound by how many loads are in flight, so small row blocks win: they give many
# programs (gate/up: I/8 x 8 routes = 768 at batch 1; down: H/32 x 8 = 512) to spread over the
# 132 SMs, each streaming its rows 128 wide (256 contiguous bytes per row per step). Measured on
# an H200 (CUDA graph replay, weights from HBM): the defaults below took batch 1 from 29 us
# (16 x 256 tiles, 4 warps) to ~26 us (gate/up 15 us at 3.4 TB/s, down 8 us, reduce 1 us);
# neighbouring tile shapes are within 2%, most others within 10%. Accumulators are
# [BLOCK_N, BLOCK_K] fp32 tiles summed across lanes once after the loop, keeping the inner loop
# to loads and FMAs.
# ---------------------------------------------------------------------------------------------
GATE_UP_BLOCK_N = 8
GATE_UP_BLOCK_K = 128
GATE_UP_WARPS = 8
GATE_UP_STAGES = 2
DOWN_BLOCK_N = 32
DOWN_BLOCK_K = 128
DOWN_WARPS = 8
DOWN_STAGES = 3
DOWN_SPLIT_STEPS = 0  # (not split: see `down_split`)
REDUCE_BLOCK = 1024  # the route reduce touches only R x H activations: one wide block per row
LAUNCH_NAMES = (
    "GATE_UP_BLOCK_N",
    "GATE_UP_BLOCK_K",
    "GATE_UP_WARPS",
    "GATE_UP_STAGES",
    "DOWN_BLOCK_N",
    "DOWN_BLOCK_K",
    "DOWN_WARPS",
    "DOWN_STAGES",
    "DOWN_SPLIT_STEPS",
)
# Split-K of the down projection. A decode GEMV's time is the dependent steps each program
# walks (a load's latency each) when its programs do not fill the chip: Qwen2.5-0.5B's k_mixed
# down [896, 4864] in 16 x 256 tiles is 56 row blocks x 2 routes = 112 programs for 132 SMs,
# each 19 steps, 29.7 us for 6 MB that HBM streams in ~2 (2026-12-04-legacy-tiles-h200.md).
# With DOWN_SPLIT_STEPS (a format's launch parameter; 0: never) a program walks at most that
# many steps of one split of the columns and writes an fp32 partial; the route reduce adds the
# splits in a fixed order (deterministic, as the unsplit kernels). The grid stays under this
# many programs (16 per SM of an H100/H200: a few waves of short programs), so batches that
# already fill the chip split less.
DOWN_SPLIT_MAX_PROGRAMS = 16 * 132
# Quantized banks: the same kernels, launched with their own parameters (a weight is 1 byte in
# fp8 and half a byte in fp4, and decoding costs ALU work per weight: about 8 instructions a
# weight in the fp4 loops, 9 in fp8's, against 7 for bf16, from the sm_90 SASS). Chosen from
# the compiled code and not yet swept (`benchmarks/grouped_experts_bench.py --sweep`): on the
# H200 they ran at 0.84-1.37x bf16's time per layer, bound by the decoding
# (benchmarks/results/2026-12-02-quantized-experts-h200.md). They keep a thread's weight loads
# at 8 bytes a projection and step, as bf16's gate/up, and below the sizes at which Triton keeps
# a load in its own coalesced layout (a load of at least as many elements as the program has
# threads): BLOCK_K < 32 x warps (x) and, for fp4, BLOCK_N x BLOCK_K / 32 < 32 x warps (the
# scales), or x and the scales cross shared memory every step, behind a barrier. FP8 BLOCK_K
# stays at most the checkpoints' 128-column scale blocks (one scale per row and tile); fp4
# BLOCK_K must be a multiple of 32.
# q8_0's tiles (a byte a weight, as fp8's; BLOCK_K a multiple of its 32-value blocks), the
# starting point of the K-quants' and the legacy types' (their own below); each format gets a
# copy of its own, since grouped_experts_bench.py sweeps a format's entries in place.
_BYTE_TILES = {
    "GATE_UP_BLOCK_N": 16,
    "GATE_UP_BLOCK_K": 128,
    "GATE_UP_WARPS": 8,
    "GATE_UP_STAGES": 3,
    "DOWN_BLOCK_N": 32,
    "DOWN_BLOCK_K": 128,
    "DOWN_WARPS": 8,
    "DOWN_STAGES": 3,
    "DOWN_SPLIT_STEPS": 0,
}
QUANTIZED_LAUNCH: dict[str, dict[str, int]] = {
    "fp8": {
        "GATE_UP_BLOCK_N": 16,
        "GATE_UP_BLOCK_K": 128,
        "GATE_UP_WARPS": 8,
        "GATE_UP_STAGES": 3,
        "DOWN_BLOCK_N": 32,
        "DOWN_BLOCK_K": 128,
        "DOWN_WARPS": 8,
        "DOWN_STAGES": 3,
        "DOWN_SPLIT_STEPS": 0,
    },
    "mxfp4": {
        "GATE_UP_BLOCK_N": 32,
        "GATE_UP_BLOCK_K": 128,
        "GATE_UP_WARPS": 8,
        "GATE_UP_STAGES": 3,
        "DOWN_BLOCK_N": 32,
        "DOWN_BLOCK_K": 128,
        "DOWN_WARPS": 8,
        "DOWN_STAGES": 3,
        "DOWN_SPLIT_STEPS": 0,
    },
    "nvfp4": {
        "GATE_UP_BLOCK_N": 32,
        "GATE_UP_BLOCK_K": 128,
        "GATE_UP_WARPS": 8,
        "GATE_UP_STAGES": 3,
        "DOWN_BLOCK_N": 32,
        "DOWN_BLOCK_K": 128,
        "DOWN_WARPS": 8,
        "DOWN_STAGES": 3,
        "DOWN_SPLIT_STEPS": 0,
    },
    **{name: dict(_BYTE_TILES) for name in ("q8_0", *K_QUANT_REST, "k_mixed", *LEGACY_REST)},
}
# The legacy types and the K-quants but q6_k are read as int32 words (`_word_tile`). Their tiles
# from `benchmarks/legacy_tiles_bench.py --sweep` on the H200 (2026-12-04; GPU us per call, 1
# token x 2 routes): Qwen2.5-0.5B's Q5_0 gate/up [2 x 4864, 896] 16 x 128 on 4 warps 13.4 (byte
# tiles before: 32.4), its k_mixed down [896, 4864] 16 x 256 on 4 warps 29.7 (80.4); SmolLM2's
# Q4_1 down [576, 1536] 16 x 512 on 8 warps 4.3 (12.6); Qwen3-30B-A3B's Q4_K gate/up 16 x 256
# on 4 warps. Word tiles of BLOCK_N < 16 gave wrong sums on the GPU (not under the interpreter:
# Triton 3.6's code for them, cause not found), so `_check_blocks` refuses them.
for _name in LEGACY_REST:
    QUANTIZED_LAUNCH[_name].update(
        GATE_UP_BLOCK_N=16,
        GATE_UP_BLOCK_K=128,
        GATE_UP_WARPS=4,
        DOWN_BLOCK_N=16,
        DOWN_BLOCK_K=512,
        DOWN_WARPS=8,
    )
QUANTIZED_LAUNCH["k_mixed"].update(DOWN_BLOCK_N=16, DOWN_BLOCK_K=256, DOWN_WARPS=4)
# Word-tile formats split the down kernel's columns at 4 steps (Qwen2.5-0.5B's k_mixed down: 5
# splits of 4, 4, 4, 4, 3 steps, 560 programs at batch 1); chosen from the step count, not yet
# swept on the GPU (legacy_tiles_bench.py --sweep times others).
for _name in (*LEGACY_REST, "k_mixed", "q4_k", "q5_k"):
    QUANTIZED_LAUNCH[_name]["DOWN_SPLIT_STEPS"] = 4
QUANTIZED_LAUNCH["q4_k"].update(
    GATE_UP_BLOCK_N=16,
    GATE_UP_BLOCK_K=256,
    GATE_UP_WARPS=4,
    DOWN_BLOCK_N=16,
    DOWN_BLOCK_K=256,
    DOWN_WARPS=4,
)
WORD_MIN_BLOCK_N = 16
# `dequantize_slots` on CUDA (prefill's grouped GEMMs): one program per slot and row block.
DEQUANTIZE_BLOCK_N = 32
DEQUANTIZE_BLOCK_K = 128  # (a multiple of 32: whole fp4 chunks; fp8: at most its 128 blocks)
DEQUANTIZE_WARPS = 8
# The kernels above read an expert's weights once per route: right for decode, where routes
# rarely share an expert, wasteful for a prefill chunk, where hundreds of tokens do. From this
# many routes per call, the routes are sorted by expert and run as grouped GEMMs
# (`grouped_gemm_experts`), which read each used expert once.
GROUPED_GEMM_FROM_ROUTES = 512
GROUPED_MM_MAX_GROUPS = 512  # below torch._grouped_mm's limit on groups (slots) per call (1024)
# Quantized banks in grouped GEMMs: the used experts dequantized this many bytes at a time.
DEQUANTIZED_WINDOW_BYTES = 256 * 2**20


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _check_args(
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


def _check_bias(b_gate_up: Tensor | None, w_gate_up: Bank, dtype: torch.dtype) -> None:
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
    t, k, h, i = _check_args(x, slots, weights, w_gate_up, w_down)
    _check_bias(b_gate_up, w_gate_up, x.dtype)
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
    return _sum_routes(contrib.view(t, k, h))


def _sum_routes(per_token: Tensor) -> Tensor:
    """[T, k, H] route contributions -> [T, H], added in route order j = 0..k-1 with the
    dtype's rounding after each add (the order the Triton reduce follows too)."""
    out = per_token.new_zeros(per_token.shape[0], per_token.shape[2])
    for j in range(per_token.shape[1]):
        out += per_token[:, j]
    return out


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
    t, k, h, i = _check_args(x, slots, weights, w_gate_up, w_down)
    _check_bias(b_gate_up, w_gate_up, x.dtype)
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
    return _sum_routes(torch.empty_like(c).index_copy_(0, order, c).view(t, k, h))


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
    if bank.device.type == "cuda" and triton is not None:
        return triton_dequantize_slots(bank, slots, dtype)
    return bank.dequantize(slots, dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

# The model dimensions (HIDDEN = H, INTER = I) and the routes per token K are compile-time
# constants: they are fixed for a model (one compilation per MoE shape), the compiler then knows
# every loop trip count and which masks are all-true, and Triton 3.6's CPU interpreter cannot
# take a runtime scalar as a loop bound with numpy >= 2.4. Strides stay runtime values so the
# banks may be views of a larger pool (any layout of the two outer dimensions).
#
# Quantized banks (FORMAT 1 fp8, 2 mxfp4, 3 nvfp4, 4 q8_0, 5-8 the K-quants, 9-12 q4_0, q4_1,
# q5_0, q5_1: `ExpertFormat.code`) are dequantized
# inside the same kernels, tile by tile (`_weight_tile`): each weight is computed as its format
# defines it in fp32 (weights/expert_format.py), rounded to x.dtype (W_ROUND; skipped where that
# is exact: fp32, and mxfp4's e2m1 x 2^e values in bf16), and then goes through the SAME
# [BLOCK_N, BLOCK_K] tiles and accumulation as a dense weight: the result is the dense kernels'
# on the dequantized banks with the same launch parameters (bit for bit under the interpreter; on
# the GPU the final in-tile sum of a differently laid-out tile may be ordered differently, an
# fp32 rounding before the bf16 one). FP8 tiles take one scale per row where a scale block spans
# the tile's columns (COL_BLOCK % BLOCK_K == 0: the checkpoints' 128 x 128 blocks with BLOCK_K <=
# 128) and one per element otherwise; Q8_0 tiles are read as [BLOCK_N, BLOCK_K / 32, 32] int8
# codes times one fp16 scale a block, the tile reshaped back (row order kept). The decode
# kernels read the legacy types and the K-quants (but q6_k, whose 82-byte blocks are not
# word-aligned) as int32 words (`_word_tile`: 16-byte loads of codes, fp16 d read as halves,
# high bits as words), decoded with shifts into [BLOCK_N, BLOCK_K / 32, 4, 8] (legacy: value
# order permuted, x read to match and the sum taken in value order) or [BLOCK_N, BLOCK_K / 32,
# 8, 4] tiles; gathering them a byte a value (`_k_quant_tile`, `_legacy_tile`, still q6_k's and
# dequantize_slots') left the decode kernels 3-10x slower than their bytes. FP4 tiles are read
# as [BLOCK_N, BLOCK_K / 32, 4] int32 words: chunks of 32 values, 16 bytes each, each word's 8
# nibbles its 8 consecutive values (low nibble first, little-endian); each nibble is decoded with
# three integer operations and a multiply (`_e2m1`), scaled (an mxfp4 chunk has one e8m0 scale,
# an nvfp4 chunk two e4m3 scales, one a half), and the eight planes are joined into [BLOCK_N,
# BLOCK_K / 32, 4, 8] in value order (register moves), which x is read to match: the same tile as
# [BLOCK_N, BLOCK_K], reshaped once for the final sum.

if triton is not None:
    _OAI_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)  # (a jit function reads only constexpr globals)
    _OAI_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)
    _CLAMP_LIMIT = tl.constexpr(float(SWIGLU_CLAMP_LIMIT))
    _TWO_POW_126 = tl.constexpr(2.0**126)
    _MIXED_K_WIDTH = tl.constexpr(MIXED_K_WIDTH)
    _MIXED_K_TAG = tl.constexpr(MIXED_K_TAG)

    @triton.jit
    def _activation(g, ACT: tl.constexpr):
        """act(g) in fp32 with the formulas torch uses (g is fp32)."""
        if ACT == 0:  # silu
            return g / (1.0 + tl.exp(-g))
        elif ACT == 1:  # gelu (erf)
            return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        elif ACT == 2:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            return 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))
        else:  # relu
            return tl.maximum(g, 0.0)

    @triton.jit
    def _glu(gate, up, dt, ACT: tl.constexpr):
        """The gated unit (fp32 in and out). The plain activations round act(gate) to dt
        before the product, as torch does; swiglu_oai (code 4) is computed in fp32 and
        rounded once, where torch rounds op by op (bf16 results may differ by a rounding);
        swiglu_clamp (code 5, DeepSeek-V4) is silu's unit over the clamped gate and up."""
        if ACT == 4:
            g = tl.minimum(gate, _OAI_LIMIT)
            u = tl.minimum(tl.maximum(up, -_OAI_LIMIT), _OAI_LIMIT)
            return (u + 1.0) * (g / (1.0 + tl.exp(-_OAI_ALPHA * g)))
        elif ACT == 5:
            g = tl.minimum(gate, _CLAMP_LIMIT)
            u = tl.minimum(tl.maximum(up, -_CLAMP_LIMIT), _CLAMP_LIMIT)
            return _activation(g, 0).to(dt).to(tl.float32) * u
        else:
            return _activation(gate, ACT).to(dt).to(tl.float32) * up

    # -- the formats' values -------------------------------------------------------------------

    @triton.jit
    def _round_weight(v, dt, W_ROUND: tl.constexpr):
        """A weight's fp32 value rounded to dt (round to nearest even), kept in fp32.
        W_ROUND: 0 exact already, 1 by conversion, 2 on the bits (bf16 under the CPU
        interpreter, whose fp32 -> bf16 conversion truncates)."""
        if W_ROUND == 1:
            v = v.to(dt).to(tl.float32)
        elif W_ROUND == 2:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
        return v

    @triton.jit
    def _e2m1(w):
        """fp32 values [A, B, C, 8] of the e2m1 codes in the 8 nibbles of int32 words w
        [A, B, C] (value n in nibble n, the lowest first): sign, 2 exponent bits, 1 mantissa
        bit; 0, 0.5, 1, 1.5, 2, 3, 4, 6. Each code's bits are placed in an fp32's sign, lowest
        exponent and top mantissa bits, which read as e2m1 x 2^-126 (0.5 as a subnormal, which
        fp32 multiplication keeps: no `.ftz`), and one exact product by 2^126 gives the value:
        three integer operations and a multiply a value."""
        # Code n shifted left so that its sign is bit 31, then arithmetically (w is int32)
        # right so that its 3 magnitude bits are bits 22-24, bit 31 staying the sign. The
        # eight are joined in value order (in registers: each join adds a faster index, so the
        # first joins pick nibble bit 2, the next bit 1, the last bit 0).
        n0, n1, n2, n3 = (w << 28) >> 6, (w << 24) >> 6, (w << 20) >> 6, (w << 16) >> 6
        n4, n5, n6, n7 = (w << 12) >> 6, (w << 8) >> 6, (w << 4) >> 6, w >> 6
        bits = tl.join(
            tl.join(tl.join(n0, n4), tl.join(n2, n6)),
            tl.join(tl.join(n1, n5), tl.join(n3, n7)),
        )
        bits = tl.reshape(bits, [w.shape[0], w.shape[1], w.shape[2], 8]) & -0x7E400000
        return bits.to(tl.float32, bitcast=True) * _TWO_POW_126  # (-0x7E400000: 0x81C00000)

    @triton.jit
    def _e4m3(byte, INTERPRETED: tl.constexpr):
        """fp32 values of float8_e4m3fn bytes (uint8)."""
        v = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if INTERPRETED:  # (the interpreter reads the NaNs, 0x7f and 0xff, as +-480)
            v = tl.where((byte & 0x7F) == 0x7F, float("nan"), v)
        return v

    @triton.jit
    def _e8m0(byte):
        """fp32 values of e8m0 bytes (uint8): 2^(byte - 127), built on the bits (0: the
        subnormal 2^-127; 255 read as infinity, so a product with it is inf or nan, as torch's
        ldexp gives)."""
        bits = byte.to(tl.int32) << 23
        return tl.where(byte == 0, 0x00400000, bits).to(tl.float32, bitcast=True)

    @triton.jit
    def _weight_tile(
        w_rows,
        s_rows,
        g_rows,
        k0,
        row_mask,
        dt,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The fp32 weights [BLOCK_N, BLOCK_K] of columns k0.. of BLOCK_N rows (0 out of
        bounds and where row_mask is False), as the format defines them, rounded to dt.
        w_rows [BLOCK_N]: each row's data; s_rows [BLOCK_N]: each row's scales (fp8: its scale
        row); g_rows [BLOCK_N]: nvfp4's per-row scales (values)."""
        cols = tl.arange(0, BLOCK_K)
        if FORMAT == 0:  # dense: the weights as stored
            mask = row_mask[:, None] & ((k0 + cols) < KDIM)[None, :]
            w = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0.0)
            return w.to(tl.float32)
        elif FORMAT == 1:  # fp8: fp8(w) * scale of the [ROW_BLOCK, COL_BLOCK] block
            mask = row_mask[:, None] & ((k0 + cols) < KDIM)[None, :]
            w = _e4m3(
                tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0), INTERPRETED
            )
            if COL_BLOCK % BLOCK_K == 0:  # the tile's columns share a scale column
                scale = tl.load(s_rows + k0 // COL_BLOCK, mask=row_mask, other=0.0)
                w = w * scale[:, None]
            else:
                s_ptrs = s_rows[:, None] + ((k0 + cols) // COL_BLOCK)[None, :]
                w = w * tl.load(s_ptrs, mask=mask, other=0.0)
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT == 4:  # q8_0: int8(w) * fp16 scale of its 32-value block
            G: tl.constexpr = BLOCK_K // 32
            mask = row_mask[:, None] & ((k0 + cols) < KDIM)[None, :]
            codes = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0)
            w = tl.reshape(codes.to(tl.int8, bitcast=True).to(tl.float32), [BLOCK_N, G, 32])
            blocks = k0 // 32 + tl.arange(0, G)
            s_mask = row_mask[:, None] & (blocks * 32 < KDIM)[None, :]
            scale = tl.load(s_rows[:, None] + blocks[None, :], mask=s_mask, other=0.0)
            w = tl.reshape(w * scale.to(tl.float32)[:, :, None], [BLOCK_N, BLOCK_K])
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT >= 9:  # the legacy types: blocks of 32, their d (m, fifth bits) apart
            w = _legacy_tile(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, BLOCK_N, BLOCK_K)
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT == 8:  # mixed K-quants: the tile's rows are of one type (one expert's)
            kind = tl.max(tl.load(s_rows + _MIXED_K_TAG, mask=row_mask, other=0), axis=0)
            if kind == 7:
                w = _k_quant_tile(
                    w_rows, s_rows, k0, row_mask, KDIM, 7, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
            elif kind == 6:
                w = _k_quant_tile(
                    w_rows, s_rows, k0, row_mask, KDIM, 6, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
            else:
                w = _k_quant_tile(
                    w_rows, s_rows, k0, row_mask, KDIM, 5, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT >= 5:  # the K-quants: each value gathered from its super-block's bytes
            REST: tl.constexpr = 16 if FORMAT == 5 else (48 if FORMAT == 6 else 82)
            w = _k_quant_tile(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, REST, BLOCK_N, BLOCK_K)
            return _round_weight(w, dt, W_ROUND)
        else:  # fp4: in value order, from the [BLOCK_N, BLOCK_K / 32, 4, 8] tile
            return tl.reshape(
                _fp4_tile(
                    w_rows,
                    s_rows,
                    g_rows,
                    k0,
                    row_mask,
                    dt,
                    KDIM,
                    FORMAT,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                ),
                [BLOCK_N, BLOCK_K],
            )

    @triton.jit
    def _f16_at(ptrs, mask):
        """The fp16 values (as fp32) whose two bytes (little-endian) start at ptrs."""
        lo = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptrs + 1, mask=mask, other=0).to(tl.int32)
        return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _k_scale_min(s_at, sub, mask):
        """q4_k's and q5_k's chunk scales d * sc and offsets dmin * mn [BLOCK_N, G] (fp32) of
        chunks `sub` [G] of their super-blocks, whose other bytes start at s_at [BLOCK_N, G]:
        the 6-bit scale and min from the 12 bytes at 4 (ggml's get_scale_min_k4)."""
        low = sub < 4
        at = s_at + 4
        a = tl.load(at + tl.where(low, sub, sub + 4)[None, :], mask=mask, other=0).to(tl.int32)
        b = tl.load(at + tl.where(low, sub + 4, sub - 4)[None, :], mask=mask, other=0)
        c = tl.load(at + tl.where(low, sub + 4, sub)[None, :], mask=mask, other=0).to(tl.int32)
        sc = tl.where(low[None, :], a & 63, (a & 0xF) | ((b.to(tl.int32) >> 6) << 4))
        mn = tl.where(low[None, :], c & 63, (a >> 4) | ((c >> 6) << 4))
        return _f16_at(s_at, mask) * sc.to(tl.float32), _f16_at(s_at + 2, mask) * mn.to(tl.float32)

    @triton.jit
    def _k_quant_tile(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        REST: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """fp32 values [BLOCK_N, BLOCK_K] of columns k0.. of K-quant rows (5 q4_k, 6 q5_k, 7
        q6_k: weights/quantized.py's k_quant_values, in its order of operations), as [BLOCK_N,
        G, 32]: G chunks of 32 values (k0 and BLOCK_K multiples of 32), each within one
        super-block (a block's 128 code bytes in w, its other bytes in s), whose fp16 scales and
        sub-block scales are read once a chunk and whose codes and high bits a value. REST:
        the bytes from one block's other bytes to the next's (the type's, or k_mixed's)."""
        G: tl.constexpr = BLOCK_K // 32
        chunk = k0 // 32 + tl.arange(0, G)  # the chunks' places in the row
        sub = chunk % 8  # ... and in their super-block
        lane = tl.arange(0, 32)[None, None, :]
        mask = row_mask[:, None] & (chunk * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        mask3 = mask[:, :, None] & (lane < 32)
        w_at = (w_rows[:, None] + ((chunk // 8) * 128)[None, :])[:, :, None]
        s_at = s_rows[:, None] + ((chunk // 8) * REST)[None, :]  # [BLOCK_N, G]
        if FORMAT == 7:  # q6_k: chunk 4 h + j holds values 128 h + 32 j + l
            h, j = (sub // 4)[None, :, None], (sub % 4)[None, :, None]
            byte = tl.load(w_at + 64 * h + 32 * (j % 2) + lane, mask=mask3, other=0)
            code = (byte.to(tl.int32) >> (4 * (j // 2))) & 0xF
            bits = tl.load(s_at[:, :, None] + 32 * h + lane, mask=mask3, other=0).to(tl.int32)
            code = code | (((bits >> (2 * j)) & 3) << 4)
            sc = tl.load(
                s_at[:, :, None] + 64 + 2 * sub[None, :, None] + lane // 16, mask=mask3, other=0
            )
            d = _f16_at(s_at + 80, mask)[:, :, None]
            w = (d * sc.to(tl.int8, bitcast=True).to(tl.float32)) * (code - 32).to(tl.float32)
            return tl.reshape(w, [BLOCK_N, BLOCK_K])
        # q4_k, q5_k: chunk 2 g + half holds values 64 g + 32 half + l
        g, half = (sub // 2)[None, :, None], (sub % 2)[None, :, None]
        byte = tl.load(w_at + 32 * g + lane, mask=mask3, other=0).to(tl.int32)
        code = (byte >> (4 * half)) & 0xF
        if FORMAT == 6:
            qh = tl.load(s_at[:, :, None] + 16 + lane, mask=mask3, other=0).to(tl.int32)
            code = code | (((qh >> sub[None, :, None]) & 1) << 4)
        scale, offset = _k_scale_min(s_at, sub, mask)
        scale, offset = scale[:, :, None], offset[:, :, None]
        return tl.reshape(scale * code.to(tl.float32) - offset, [BLOCK_N, BLOCK_K])

    @triton.jit
    def _legacy_tile(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """fp32 values [BLOCK_N, BLOCK_K] of columns k0.. of legacy rows (9 q4_0, 10 q4_1, 11
        q5_0, 12 q5_1: weights/quantized.py's legacy_values, in its order of operations), as
        [BLOCK_N, G, 32]: G blocks of 32 values (k0 and BLOCK_K multiples of 32), each block's
        d (and m, fifth bits) read once, its codes a value (value l in byte l % 16's low nibble
        for l < 16, its high nibble else; its fifth bit bit l of qh)."""
        G: tl.constexpr = BLOCK_K // 32
        REST: tl.constexpr = 2 * (FORMAT - 8)  # (2, 4, 6, 8 bytes besides the codes)
        block = k0 // 32 + tl.arange(0, G)
        lane = tl.arange(0, 32)[None, None, :]
        mask = row_mask[:, None] & (block * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        mask3 = mask[:, :, None] & (lane < 32)
        w_at = (w_rows[:, None] + (block * 16)[None, :])[:, :, None]
        byte = tl.load(w_at + lane % 16, mask=mask3, other=0).to(tl.int32)
        code = (byte >> (4 * (lane // 16))) & 0xF
        s_at = s_rows[:, None] + (block * REST)[None, :]  # [BLOCK_N, G]
        if FORMAT == 11 or FORMAT == 12:  # qh: the last 4 of the block's other bytes
            qh = tl.load(s_at[:, :, None] + (REST - 4) + lane // 8, mask=mask3, other=0)
            code = code | (((qh.to(tl.int32) >> (lane % 8)) & 1) << 4)
        d = _f16_at(s_at, mask)[:, :, None]
        if FORMAT == 10 or FORMAT == 12:
            w = d * code.to(tl.float32) + _f16_at(s_at + 2, mask)[:, :, None]
        elif FORMAT == 9:
            w = d * (code - 8).to(tl.float32)
        else:
            w = d * (code - 16).to(tl.float32)
        return tl.reshape(w, [BLOCK_N, BLOCK_K])

    # -- word tiles: the legacy types and the K-quants read as int32 words (decode) ------------

    @triton.jit
    def _planes(
        w,
        S0: tl.constexpr,
        S1: tl.constexpr,
        S2: tl.constexpr,
        S3: tl.constexpr,
        S4: tl.constexpr,
        S5: tl.constexpr,
        S6: tl.constexpr,
        S7: tl.constexpr,
        MASK: tl.constexpr,
    ):
        """[A, B, C, 8]: plane n of int32 words w [A, B, C] is (w >> Sn) & MASK (joined in
        registers, as `_e2m1`'s nibbles: each join adds a faster index)."""
        p0, p1, p2, p3 = (w >> S0) & MASK, (w >> S1) & MASK, (w >> S2) & MASK, (w >> S3) & MASK
        p4, p5, p6, p7 = (w >> S4) & MASK, (w >> S5) & MASK, (w >> S6) & MASK, (w >> S7) & MASK
        bits = tl.join(
            tl.join(tl.join(p0, p4), tl.join(p2, p6)),
            tl.join(tl.join(p1, p5), tl.join(p3, p7)),
        )
        return tl.reshape(bits, [w.shape[0], w.shape[1], w.shape[2], 8])

    @triton.jit
    def _bytes4(w, MASK: tl.constexpr):
        """[A, B, C, 4]: byte j of int32 words w [A, B, C] (little-endian), & MASK."""
        bits = tl.join(
            tl.join(w & MASK, (w >> 16) & MASK), tl.join((w >> 8) & MASK, (w >> 24) & MASK)
        )
        return tl.reshape(bits, [w.shape[0], w.shape[1], w.shape[2], 4])

    @triton.jit
    def _legacy_words(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`_legacy_tile`'s values as [BLOCK_N, G, 4, 8]: a block's 16 code bytes read as 4
        int32 words (one 16-byte load a row and block), plane n = 4 h + j of word q holding
        value 16 h + 4 q + j of the block (byte 4 q + j's low nibble for h = 0, its high one
        for h = 1); `_word_x` reads x in this order and `_legacy_sum` puts it back. d (m,
        the fifth bits) are read as 16-bit halves (a block's other bytes are 2-aligned)."""
        G: tl.constexpr = BLOCK_K // 32
        REST: tl.constexpr = FORMAT - 8  # (halves besides the codes: 1, 2, 3, 4)
        block = k0 // 32 + tl.arange(0, G)
        quad = tl.arange(0, 4)
        mask = row_mask[:, None] & (block * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        w_words = w_rows.to(tl.pointer_type(tl.int32))  # (rows of whole words: checked)
        words = tl.load(
            w_words[:, None, None] + (block * 4)[None, :, None] + quad[None, None, :],
            mask=mask[:, :, None],
            other=0,
        )
        code = _planes(words, 0, 8, 16, 24, 4, 12, 20, 28, 0xF)
        halves = s_rows.to(tl.pointer_type(tl.int16))[:, None] + (block * REST)[None, :]
        d = tl.load(halves, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        if FORMAT == 11 or FORMAT == 12:  # qh: value l's fifth bit is bit l
            lo = tl.load(halves + (REST - 2), mask=mask, other=0).to(tl.int32) & 0xFFFF
            hi = tl.load(halves + (REST - 1), mask=mask, other=0).to(tl.int32)
            qh = (lo | (hi << 16))[:, :, None] >> (quad * 4)[None, None, :]
            code = code | (_planes(qh, 0, 1, 2, 3, 16, 17, 18, 19, 1) << 4)
        d = d[:, :, None, None]
        if FORMAT == 10 or FORMAT == 12:
            m = tl.load(halves + 1, mask=mask, other=0).to(tl.float16, bitcast=True)
            return d * code.to(tl.float32) + m.to(tl.float32)[:, :, None, None]
        elif FORMAT == 9:
            return d * (code - 8).to(tl.float32)
        else:
            return d * (code - 16).to(tl.float32)

    @triton.jit
    def _legacy_sum(acc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Row sums of a [BLOCK_N, G, 4, 8] accumulator of `_legacy_words`' order, summed in
        value order (as the dense kernels' [BLOCK_N, BLOCK_K] tile)."""
        G: tl.constexpr = BLOCK_K // 32
        acc = tl.permute(tl.reshape(acc, [BLOCK_N, G, 4, 2, 4]), (0, 1, 3, 2, 4))
        return tl.sum(tl.reshape(acc, [BLOCK_N, BLOCK_K]), axis=1)

    @triton.jit
    def _k_words(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        REST: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`_k_quant_tile`'s values as [BLOCK_N, G, 8, 4] (value order): a chunk's 32 values
        from 8 int32 words of codes (two 16-byte loads a row and chunk; a byte's other nibble
        is the neighbouring chunk's, read again from L1), q5_k's fifth and q6_k's high bits
        from 8 words of its other bytes (REST a multiple of 4: word-aligned blocks)."""
        G: tl.constexpr = BLOCK_K // 32
        chunk = k0 // 32 + tl.arange(0, G)
        sub = chunk % 8
        word = tl.arange(0, 8)[None, None, :]
        mask = row_mask[:, None] & (chunk * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        mask3 = mask[:, :, None]
        w_words = w_rows.to(tl.pointer_type(tl.int32))  # (rows of whole words: checked)
        w_at = w_words[:, None] + ((chunk // 8) * 32)[None, :]  # [BLOCK_N, G]
        s_at = s_rows[:, None] + ((chunk // 8) * REST)[None, :]
        s_words = (
            s_rows.to(tl.pointer_type(tl.int32))[:, None] + ((chunk // 8) * (REST // 4))[None, :]
        )
        if FORMAT == 7:  # q6_k: chunk 4 h + j holds values 128 h + 32 j + l
            h, j = sub // 4, sub % 4
            lo = tl.load(
                w_at[:, :, None] + (16 * h + 8 * (j % 2))[None, :, None] + word, mask=mask3, other=0
            )
            lo = lo >> (4 * (j // 2))[None, :, None]
            hi = tl.load(s_words[:, :, None] + (8 * h)[None, :, None] + word, mask=mask3, other=0)
            hi = hi >> (2 * j)[None, :, None]
            code = _bytes4(lo, 0xF) | (_bytes4(hi, 3) << 4)
            # one int8 scale a 16 values: words 0-3 and 4-7 of the chunk
            sc = tl.load(
                s_at[:, :, None] + 64 + 2 * sub[None, :, None] + word // 4, mask=mask3, other=0
            )
            d = _f16_at(s_at + 80, mask)[:, :, None]
            scale = (d * sc.to(tl.int8, bitcast=True).to(tl.float32))[:, :, :, None]
            return scale * (code - 32).to(tl.float32)
        # q4_k, q5_k: chunk 2 g + half holds values 64 g + 32 half + l
        g, half = sub // 2, sub % 2
        byte = tl.load(w_at[:, :, None] + (8 * g)[None, :, None] + word, mask=mask3, other=0)
        code = _bytes4(byte >> (4 * half)[None, :, None], 0xF)
        if FORMAT == 6:
            qh = tl.load(s_words[:, :, None] + 4 + word, mask=mask3, other=0)
            code = code | (_bytes4(qh >> sub[None, :, None], 1) << 4)
        scale, offset = _k_scale_min(s_at, sub, mask)
        scale, offset = scale[:, :, None, None], offset[:, :, None, None]
        return scale * code.to(tl.float32) - offset

    @triton.jit
    def _word_tile(
        w_rows,
        s_rows,
        k0,
        row_mask,
        dt,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        W_ROUND: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The decode kernels' tiles of the word-read formats (`_reads_words`), rounded to
        dt: the legacy types' [BLOCK_N, G, 4, 8] (`_legacy_words`), the K-quants' [BLOCK_N,
        G, 8, 4] (`_k_words`; k_mixed: the tile's rows are of one type, one expert's)."""
        if FORMAT >= 9:
            w = _legacy_words(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, BLOCK_N, BLOCK_K)
        elif FORMAT == 8:
            kind = tl.max(tl.load(s_rows + _MIXED_K_TAG, mask=row_mask, other=0), axis=0)
            if kind == 7:
                w = _k_words(
                    w_rows, s_rows, k0, row_mask, KDIM, 7, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
            elif kind == 6:
                w = _k_words(
                    w_rows, s_rows, k0, row_mask, KDIM, 6, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
            else:
                w = _k_words(
                    w_rows, s_rows, k0, row_mask, KDIM, 5, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
        else:
            REST: tl.constexpr = 16 if FORMAT == 5 else 48
            w = _k_words(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, REST, BLOCK_N, BLOCK_K)
        return _round_weight(w, dt, W_ROUND)

    @triton.jit
    def _word_x(x_row, k0, valid, KDIM: tl.constexpr, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
        """x (fp32) in `_word_tile`'s order: [G, 4, 8] for the legacy types, [G, 8, 4]."""
        G: tl.constexpr = BLOCK_K // 32
        if FORMAT >= 9:  # (one return: the two shapes differ)
            n = tl.arange(0, 8)[None, None, :]
            offs = (
                tl.arange(0, G)[:, None, None] * 32
                + tl.arange(0, 4)[None, :, None] * 4
                + (n // 4) * 16
                + n % 4
            )
        else:
            offs = (
                tl.arange(0, G)[:, None, None] * 32
                + tl.arange(0, 8)[None, :, None] * 4
                + tl.arange(0, 4)[None, None, :]
            )
        return tl.load(x_row + k0 + offs, mask=((k0 + offs) < KDIM) & valid, other=0.0).to(
            tl.float32
        )

    @triton.jit
    def _word_sum(acc, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Row sums of a `_word_tile` accumulator, in value order."""
        if FORMAT >= 9:
            return _legacy_sum(acc, BLOCK_N, BLOCK_K)
        return tl.sum(tl.reshape(acc, [BLOCK_N, BLOCK_K]), axis=1)

    @triton.jit
    def _fp4_tile(
        w_rows,
        s_rows,
        g_rows,
        k0,
        row_mask,
        dt,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`_weight_tile`'s fp4 weights as [BLOCK_N, G, 4, 8]: G chunks of 32 values (value
        32 g + 8 w + n of the tile at [:, g, w, n]), read as [BLOCK_N, G, 4] int32 words (one
        16-byte vector a row and chunk), each word's 8 nibbles its 8 values (little-endian:
        byte j's low nibble is value 2 j)."""
        G: tl.constexpr = BLOCK_K // 32
        chunks = tl.arange(0, G)
        words = tl.arange(0, 4)
        word = k0 // 8 + chunks[:, None] * 4 + words[None, :]  # [G, 4]
        mask = row_mask[:, None, None] & (word < KDIM // 8)[None, :, :]
        w_words = w_rows.to(tl.pointer_type(tl.int32))  # (rows of whole words: checked)
        w = tl.load(w_words[:, None, None] + word[None, :, :], mask=mask, other=0)
        chunk_mask = row_mask[:, None] & ((k0 + chunks * 32) < KDIM)[None, :]
        if FORMAT == 2:  # mxfp4: e2m1 * 2^(s - 127), one scale a chunk
            s = tl.load(s_rows[:, None] + (k0 // 32 + chunks)[None, :], mask=chunk_mask, other=0)
            scale = _e8m0(s)[:, :, None, None]
        else:  # nvfp4: (e2m1 * e4m3) * g, one scale per 16 values: two a chunk
            half_mask = row_mask[:, None] & ((k0 + chunks * 32 + 16) < KDIM)[None, :]
            first = s_rows[:, None] + (k0 // 16 + 2 * chunks)[None, :]
            s0 = _e4m3(tl.load(first, mask=chunk_mask, other=0), INTERPRETED)
            s1 = _e4m3(tl.load(first + 1, mask=half_mask, other=0), INTERPRETED)
            scale = tl.where((words < 2)[None, None, :], s0[:, :, None], s1[:, :, None])
            scale = scale[:, :, :, None]
        v = _e2m1(w) * scale
        if FORMAT == 3:
            v = v * g_rows[:, None, None, None]
        return _round_weight(v, dt, W_ROUND)

    @triton.jit
    def _fp4_x(x_row, k0, valid, KDIM: tl.constexpr, BLOCK_K: tl.constexpr):
        """x [G, 4, 8] (fp32) for `_fp4_tile`'s tile of columns k0.."""
        G: tl.constexpr = BLOCK_K // 32
        offs = (
            tl.arange(0, G)[:, None, None] * 32
            + tl.arange(0, 4)[None, :, None] * 8
            + tl.arange(0, 8)[None, None, :]
        )
        return tl.load(x_row + k0 + offs, mask=((k0 + offs) < KDIM) & valid, other=0.0).to(
            tl.float32
        )

    @triton.jit
    def _row_scales(
        s_ptr,
        g_ptr,
        slot,
        rows,
        row_mask,
        stride_ss,
        stride_sn,
        stride_gs,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
    ):
        """(s_rows, g_rows) of `_weight_tile` for bank rows `rows` of a slot."""
        s_rows = s_ptr + slot * stride_ss + (rows // ROW_BLOCK).to(tl.int64) * stride_sn
        g_rows = rows.to(tl.float32)  # (unused but by nvfp4)
        if FORMAT == 3:
            g_rows = tl.load(g_ptr + slot * stride_gs + rows, mask=row_mask, other=0.0)
        return s_rows, g_rows

    @triton.jit
    def _split_columns(
        sp, step, KDIM: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_STEPS: tl.constexpr
    ):
        """(k0, live) of step `step` of split `sp` (SPLIT_STEPS 0: the one split of all KDIM
        columns, every step live). The last split of an uneven division has steps past KDIM:
        they read the last real step's columns again (in bounds: a tile past its row could
        read a scale beyond the bank) against x masked to 0, adding exact zeros (finite
        weights)."""
        k0 = (sp * SPLIT_STEPS + step) * BLOCK_K
        if SPLIT_STEPS > 0:
            live = k0 < KDIM
            k0 = tl.minimum(k0, ((KDIM - 1) // BLOCK_K) * BLOCK_K)
        else:
            live = k0 >= 0
        return k0, live

    # -- the expert kernels --------------------------------------------------------------------

    @triton.jit
    def _gate_up_act_kernel(
        x_ptr,
        slots_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        b_ptr,
        a_ptr,
        stride_xt,
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_bs,
        stride_ar,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        K: tl.constexpr,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """a[r, n] = glu(W_gu[s, n] @ x[t] (+ b[s, n]), W_gu[s, INTER + n] @ x[t] (+ b[s,
        INTER + n])) for one block of n."""
        r = tl.program_id(0)
        nb = tl.program_id(1)
        dt = a_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + r).to(tl.int64)
        valid = slot >= 0
        # A skipped route keeps its pointers in bounds (slot 0) but masks every weight load,
        # so it reads nothing and computes glu(0, 0) = 0 for every supported unit.
        slot = tl.maximum(slot, 0)
        token = r // K
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < INTER
        row_mask = row_ok & valid
        cols = tl.arange(0, BLOCK_K)
        x_row = x_ptr + token.to(tl.int64) * stride_xt
        gate_rows = w_ptr + slot * stride_ws + rows.to(tl.int64) * stride_wn
        up_rows = gate_rows + INTER * stride_wn
        s_gate, g_gate = _row_scales(
            s_ptr, g_ptr, slot, rows, row_mask, stride_ss, stride_sn, stride_gs, FORMAT, ROW_BLOCK
        )
        s_up, g_up = _row_scales(
            s_ptr,
            g_ptr,
            slot,
            rows + INTER,
            row_mask,
            stride_ss,
            stride_sn,
            stride_gs,
            FORMAT,
            ROW_BLOCK,
        )
        if FORMAT >= 5 and FORMAT != 7:  # read as words: tiles of `_word_tile`'s shape
            WA: tl.constexpr = 4 if FORMAT >= 9 else 8  # (the tile's words a block, and
            WB: tl.constexpr = 8 if FORMAT >= 9 else 4  # values a word)
            acc_gw = tl.zeros([BLOCK_N, BLOCK_K // 32, WA, WB], dtype=tl.float32)
            acc_uw = tl.zeros([BLOCK_N, BLOCK_K // 32, WA, WB], dtype=tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                # (the weights' loads first: x's may cross shared memory behind a barrier)
                wg = _word_tile(
                    gate_rows, s_gate, k0, row_mask, dt, HIDDEN, FORMAT, W_ROUND, BLOCK_N, BLOCK_K
                )
                wu = _word_tile(
                    up_rows, s_up, k0, row_mask, dt, HIDDEN, FORMAT, W_ROUND, BLOCK_N, BLOCK_K
                )
                xw = _word_x(x_row, k0, valid, HIDDEN, FORMAT, BLOCK_K)
                acc_gw += wg * xw[None, :, :, :]
                acc_uw += wu * xw[None, :, :, :]
            gate = _word_sum(acc_gw, FORMAT, BLOCK_N, BLOCK_K)
            up = _word_sum(acc_uw, FORMAT, BLOCK_N, BLOCK_K)
        elif FORMAT < 2 or FORMAT >= 4:  # dense, fp8, q8_0, q6_k: [BLOCK_N, BLOCK_K] tiles
            acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                k_ok = (k0 + cols) < HIDDEN
                xv = tl.load(x_row + k0 + cols, mask=k_ok & valid, other=0.0).to(tl.float32)
                wg = _weight_tile(
                    gate_rows,
                    s_gate,
                    g_gate,
                    k0,
                    row_mask,
                    dt,
                    HIDDEN,
                    FORMAT,
                    COL_BLOCK,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
                wu = _weight_tile(
                    up_rows,
                    s_up,
                    g_up,
                    k0,
                    row_mask,
                    dt,
                    HIDDEN,
                    FORMAT,
                    COL_BLOCK,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
                acc_g += wg * xv[None, :]
                acc_u += wu * xv[None, :]
            gate = tl.sum(acc_g, axis=1)
            up = tl.sum(acc_u, axis=1)
        else:  # fp4: the same tiles as [BLOCK_N, BLOCK_K / 32, 4, 8], x to match
            acc_g4 = tl.zeros([BLOCK_N, BLOCK_K // 32, 4, 8], dtype=tl.float32)
            acc_u4 = tl.zeros([BLOCK_N, BLOCK_K // 32, 4, 8], dtype=tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                xv = _fp4_x(x_row, k0, valid, HIDDEN, BLOCK_K)
                wg = _fp4_tile(
                    gate_rows,
                    s_gate,
                    g_gate,
                    k0,
                    row_mask,
                    dt,
                    HIDDEN,
                    FORMAT,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
                wu = _fp4_tile(
                    up_rows,
                    s_up,
                    g_up,
                    k0,
                    row_mask,
                    dt,
                    HIDDEN,
                    FORMAT,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
                acc_g4 += wg * xv[None, :, :, :]
                acc_u4 += wu * xv[None, :, :, :]
            gate = tl.sum(tl.reshape(acc_g4, [BLOCK_N, BLOCK_K]), axis=1)
            up = tl.sum(tl.reshape(acc_u4, [BLOCK_N, BLOCK_K]), axis=1)
        # Round where torch would: h = W @ x is an x.dtype tensor, act(gate) is one, and so is
        # the product (no-ops for fp32).
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        if HAS_BIAS:  # (a skipped route adds 0: it must still compute 0)
            b_row = b_ptr + slot * stride_bs + rows
            gate = gate + tl.load(b_row, mask=row_mask, other=0.0).to(tl.float32)
            up = up + tl.load(b_row + INTER, mask=row_mask, other=0.0).to(tl.float32)
            gate, up = gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32)
        a = _glu(gate, up, dt, ACT)
        tl.store(a_ptr + r.to(tl.int64) * stride_ar + rows, a.to(dt), mask=row_ok)

    @triton.jit
    def _down_kernel(
        a_ptr,
        slots_ptr,
        route_w_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        c_ptr,
        stride_ar,
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_cr,
        stride_cs,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_STEPS: tl.constexpr,
    ):
        """c[r, n] = (route_w[r] * (W_d[s, n] @ a[r])).to(x.dtype) for one block of n; or,
        with SPLIT_STEPS > 0, split sp's fp32 partial sum of W_d[s, n] @ a[r] over its
        SPLIT_STEPS x BLOCK_K columns into c[sp, r, n] (`_sum_routes_kernel` adds the splits
        in order, weighs and rounds)."""
        r = tl.program_id(0)
        nb = tl.program_id(1)
        sp = tl.program_id(2)
        # the steps this program walks: all of INTER, or its split's SPLIT_STEPS (a constant
        # trip count: the interpreter takes no run-time loop bounds)
        STEPS: tl.constexpr = SPLIT_STEPS if SPLIT_STEPS > 0 else (INTER + BLOCK_K - 1) // BLOCK_K
        dt = a_ptr.dtype.element_ty  # (x.dtype: c is fp32 when split)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        valid = slot >= 0
        slot = tl.maximum(slot, 0)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < HIDDEN
        row_mask = row_ok & valid
        cols = tl.arange(0, BLOCK_K)
        a_row = a_ptr + r.to(tl.int64) * stride_ar
        w_rows = w_ptr + slot * stride_ws + rows.to(tl.int64) * stride_wn
        s_rows, g_rows = _row_scales(
            s_ptr, g_ptr, slot, rows, row_mask, stride_ss, stride_sn, stride_gs, FORMAT, ROW_BLOCK
        )
        if FORMAT >= 5 and FORMAT != 7:  # read as words: tiles of `_word_tile`'s shape
            WA: tl.constexpr = 4 if FORMAT >= 9 else 8  # (as in the gate/up kernel)
            WB: tl.constexpr = 8 if FORMAT >= 9 else 4
            accw = tl.zeros([BLOCK_N, BLOCK_K // 32, WA, WB], dtype=tl.float32)
            for step in range(0, STEPS):
                k0, live = _split_columns(sp, step, INTER, BLOCK_K, SPLIT_STEPS)
                wd = _word_tile(
                    w_rows, s_rows, k0, row_mask, dt, INTER, FORMAT, W_ROUND, BLOCK_N, BLOCK_K
                )
                aw = _word_x(a_row, k0, valid & live, INTER, FORMAT, BLOCK_K)
                accw += wd * aw[None, :, :, :]
            y = _word_sum(accw, FORMAT, BLOCK_N, BLOCK_K)
        elif FORMAT < 2 or FORMAT >= 4:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for step in range(0, STEPS):
                k0, live = _split_columns(sp, step, INTER, BLOCK_K, SPLIT_STEPS)
                k_ok = (k0 + cols) < INTER
                av = tl.load(a_row + k0 + cols, mask=k_ok & valid & live, other=0.0).to(tl.float32)
                wd = _weight_tile(
                    w_rows,
                    s_rows,
                    g_rows,
                    k0,
                    row_mask,
                    dt,
                    INTER,
                    FORMAT,
                    COL_BLOCK,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
                acc += wd * av[None, :]
            y = tl.sum(acc, axis=1)
        else:
            acc4 = tl.zeros([BLOCK_N, BLOCK_K // 32, 4, 8], dtype=tl.float32)
            for step in range(0, STEPS):
                k0, live = _split_columns(sp, step, INTER, BLOCK_K, SPLIT_STEPS)
                av = _fp4_x(a_row, k0, valid & live, INTER, BLOCK_K)
                wd = _fp4_tile(
                    w_rows,
                    s_rows,
                    g_rows,
                    k0,
                    row_mask,
                    dt,
                    INTER,
                    FORMAT,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                )
                acc4 += wd * av[None, :, :, :]
            y = tl.sum(tl.reshape(acc4, [BLOCK_N, BLOCK_K]), axis=1)
        if SPLIT_STEPS > 0:  # (c is the fp32 partials then; a skipped route's are 0)
            part = c_ptr + sp.to(tl.int64) * stride_cs + r.to(tl.int64) * stride_cr
            tl.store(part + rows, y, mask=row_ok)
        else:
            y = y.to(dt).to(tl.float32)
            # torch: (y * w).to(x.dtype) with y in x.dtype and w in fp32 or x.dtype; the fp32
            # product of two bf16/fp16 values is exact, so one rounding matches both cases. A
            # skipped route contributes exactly 0 whatever its weight (even inf or nan).
            route_w = tl.load(route_w_ptr + r).to(tl.float32)
            c = tl.where(valid, y * route_w, 0.0)
            tl.store(c_ptr + r.to(tl.int64) * stride_cr + rows, c.to(dt), mask=row_ok)

    @triton.jit
    def _sum_routes_kernel(
        c_ptr,
        slots_ptr,
        route_w_ptr,
        out_ptr,
        stride_cs,
        stride_cr,
        stride_ot,
        HIDDEN: tl.constexpr,
        K: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """out[t] = c[t*K] + c[t*K + 1] + ... in order, rounding to x.dtype after each add
        exactly like the reference's `out[t] += contribution` on an x.dtype tensor. With
        SPLIT > 0, c holds the split down kernel's fp32 partials [SPLIT, routes, H]: a route's
        contribution is then made here as the unsplit down kernel makes it, from the partials
        added in split order."""
        t = tl.program_id(0)
        hb = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        offs = hb * BLOCK + tl.arange(0, BLOCK)
        ok = offs < HIDDEN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        first = t.to(tl.int64) * K
        for j in range(0, K):
            r = first + j
            if SPLIT > 0:
                y = tl.zeros([BLOCK], dtype=tl.float32)
                for sp in range(0, SPLIT):
                    y += tl.load(c_ptr + sp * stride_cs + r * stride_cr + offs, mask=ok, other=0.0)
                y = y.to(dt).to(tl.float32)
                valid = tl.load(slots_ptr + r) >= 0
                route_w = tl.load(route_w_ptr + r).to(tl.float32)
                cv = tl.where(valid, y * route_w, 0.0).to(dt)
            else:
                cv = tl.load(c_ptr + r * stride_cr + offs, mask=ok, other=0.0)
            acc = (acc + cv.to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(dt), mask=ok)

    @triton.jit
    def _dequantize_kernel(
        w_ptr,
        s_ptr,
        g_ptr,
        slots_ptr,
        out_ptr,
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_os,
        stride_on,
        N: tl.constexpr,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[i, n, :] = the dense weights of bank row slots[i], rows n of one block."""
        i = tl.program_id(0)
        nb = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + i).to(tl.int64)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + slot * stride_ws + rows.to(tl.int64) * stride_wn
        s_rows, g_rows = _row_scales(
            s_ptr, g_ptr, slot, rows, row_ok, stride_ss, stride_sn, stride_gs, FORMAT, ROW_BLOCK
        )
        out_rows = out_ptr + i.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_on
        for k0 in range(0, KDIM, BLOCK_K):
            w = _weight_tile(
                w_rows,
                s_rows,
                g_rows,
                k0,
                row_ok,
                dt,
                KDIM,
                FORMAT,
                COL_BLOCK,
                W_ROUND,
                INTERPRETED,
                BLOCK_N,
                BLOCK_K,
            )
            mask = row_ok[:, None] & ((k0 + cols) < KDIM)[None, :]
            tl.store(out_rows + k0 + cols[None, :], w.to(dt), mask=mask)


def triton_available() -> bool:
    return triton is not None


def launch_params(format_name: str = "dense") -> dict[str, int]:
    """The decode kernels' launch parameters for a format (dense: the module's constants;
    quantized: QUANTIZED_LAUNCH's entry), read at call time so the benchmark can sweep them."""
    if format_name == "dense":
        return {name: globals()[name] for name in LAUNCH_NAMES}
    return QUANTIZED_LAUNCH[format_name]


def _weight_rounding(bank: Bank, dtype: torch.dtype, interpreted: bool) -> int:
    """The kernels' W_ROUND for a bank's weights in `dtype` (see `_round_weight`)."""
    if isinstance(bank, Tensor) or dtype == torch.float32:
        return 0
    if bank.format.name == "mxfp4" and dtype == torch.bfloat16:
        return 0  # e2m1 (2 significant bits) x 2^e: every value is a bf16 (same exponent range)
    return 2 if interpreted and dtype == torch.bfloat16 else 1


def _bank_args(bank: Bank, dtype: torch.dtype, interpreted: bool) -> tuple[list, dict]:
    """A bank as the kernels take it: [w, s, g, stride_ws, stride_wn, stride_ss, stride_sn,
    stride_gs] and the format's constexprs."""
    if isinstance(bank, Tensor):
        if bank.stride(2) != 1:
            # Copying a slot bank per call would cost more than the computation; the pool owner
            # must keep the inner dimension contiguous (any layout of the outer two is fine).
            raise ValueError("expert weight banks must be contiguous in their last dimension")
        args = [bank, bank, bank, bank.stride(0), bank.stride(1), 0, 0, 0]
        return args, dict(FORMAT=0, ROW_BLOCK=1, COL_BLOCK=1, W_ROUND=0)
    fmt, w, s, g = bank.format, bank.w, bank.s, bank.g
    if w.stride(2) != 1 or s.stride(-1) != 1 or (g is not None and g.stride(1) != 1):
        raise ValueError("quantized banks' parts must be contiguous in their last dimension")
    why = bank.mismatch(dtype)  # (refuses an input width the fp4 blocks cannot lay out)
    if why is not None:
        raise ValueError(why)
    if fmt.pack == 2 and (w.data_ptr() % 4 or w.stride(0) % 4 or w.stride(1) % 4):
        raise ValueError("fp4 codes are read as 4-byte words: rows must start 4-byte aligned")
    align = _SCALE_ALIGN.get(fmt.name, 1)
    if s.data_ptr() % align or s.stride(0) % align or s.stride(1) % align:
        raise ValueError(
            f"{fmt.name} scales are read {align} bytes at a time: their rows must "
            f"start {align}-byte aligned"
        )
    args = [
        w,
        s,
        w if g is None else g,
        w.stride(0),
        w.stride(1),
        s.stride(0),
        s.stride(1),
        0 if g is None else g.stride(0),
    ]
    consts = dict(
        FORMAT=fmt.code,
        ROW_BLOCK=fmt.row_block,
        COL_BLOCK=fmt.col_block,
        W_ROUND=_weight_rounding(bank, dtype, interpreted),
    )
    return args, consts


# Formats whose other bytes the decode kernels read as wider words (`_word_tile`): the legacy
# types' fp16 halves, q5_k's and k_mixed's high-bit words.
_SCALE_ALIGN = {"q5_k": 4, "k_mixed": 4, **dict.fromkeys(LEGACY_REST, 2)}


def _check_blocks(format_code: int, params: dict[str, int], proj: str) -> None:
    """Refuse tiles a format's kernel cannot take (`proj`: "GATE_UP" or "DOWN")."""
    if format_code >= 2 and params[f"{proj}_BLOCK_K"] % 32:
        raise ValueError(
            f"fp4 and GGUF tiles take whole chunks of 32 values: {proj}_BLOCK_K "
            f"{params[f'{proj}_BLOCK_K']}"
        )
    if format_code >= 5 and format_code != 7 and params[f"{proj}_BLOCK_N"] < WORD_MIN_BLOCK_N:
        raise ValueError(
            f"word tiles need {proj}_BLOCK_N >= {WORD_MIN_BLOCK_N} (smaller ones "
            f"computed wrong sums on the GPU), got {params[f'{proj}_BLOCK_N']}"
        )


def triton_grouped_expert_forward(
    x: Tensor,
    slots: Tensor,
    weights: Tensor,
    w_gate_up: Bank,
    w_down: Bank,
    act: str = "silu",
    b_gate_up: Tensor | None = None,
) -> Tensor:
    """The Triton path of `grouped_expert_forward`, on whatever device Triton runs on (CUDA, or
    CPU tensors under TRITON_INTERPRET=1 for tests). Slot ids must be < S; this is not checked
    because checking would sync the host with the device. Quantized banks are dequantized in
    the kernels (the result is the dense kernels' on the dequantized banks)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    t, k, h, i = _check_args(x, slots, weights, w_gate_up, w_down)
    _check_bias(b_gate_up, w_gate_up, x.dtype)
    act_code = activation_code(act)  # (a clear error for an unknown name)
    gu_args, gu_consts = _bank_args(w_gate_up, x.dtype, INTERPRETED)
    d_args, d_consts = _bank_args(w_down, x.dtype, INTERPRETED)
    if b_gate_up is not None and b_gate_up.stride(1) != 1:
        raise ValueError("the bias bank must be contiguous in its last dimension")
    routes = t * k
    if routes == 0:
        return torch.zeros_like(x)
    # each projection's kernel launched with its own format's parameters (a Q4_K_M file's
    # gate/up Q5_0 and down k_mixed)
    dense = isinstance(w_gate_up, Tensor)
    p = launch_params("dense" if dense else w_gate_up.format.name)
    p_down = launch_params("dense" if dense else w_down.format.name)
    _check_blocks(gu_consts["FORMAT"], p, "GATE_UP")
    _check_blocks(d_consts["FORMAT"], p_down, "DOWN")
    x = x.contiguous()
    slots = slots.contiguous()
    weights = weights.contiguous()
    a = torch.empty(routes, i, dtype=x.dtype, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)

    w, s, g, stride_ws, stride_wn, stride_ss, stride_sn, stride_gs = gu_args
    _gate_up_act_kernel[(routes, triton.cdiv(i, p["GATE_UP_BLOCK_N"]))](
        x,
        slots,
        w,
        s,
        g,
        w if b_gate_up is None else b_gate_up,  # (not read without a bias)
        a,
        x.stride(0),
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        0 if b_gate_up is None else b_gate_up.stride(0),
        a.stride(0),
        HIDDEN=h,
        INTER=i,
        K=k,
        ACT=act_code,
        HAS_BIAS=b_gate_up is not None,
        INTERPRETED=INTERPRETED,
        BLOCK_N=p["GATE_UP_BLOCK_N"],
        BLOCK_K=p["GATE_UP_BLOCK_K"],
        num_warps=p["GATE_UP_WARPS"],
        num_stages=p["GATE_UP_STAGES"],
        **gu_consts,
    )
    row_blocks = triton.cdiv(h, p_down["DOWN_BLOCK_N"])
    split, split_steps = down_split(routes * row_blocks, i, p_down)
    if split > 1:  # fp32 partials [split, routes, H]
        c = torch.empty(split, routes, h, dtype=torch.float32, device=x.device)
    else:
        c = torch.empty(1, routes, h, dtype=x.dtype, device=x.device)
    w, s, g, stride_ws, stride_wn, stride_ss, stride_sn, stride_gs = d_args
    _down_kernel[(routes, row_blocks, split)](
        a,
        slots,
        weights,
        w,
        s,
        g,
        c,
        a.stride(0),
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        c.stride(1),
        c.stride(0),
        HIDDEN=h,
        INTER=i,
        INTERPRETED=INTERPRETED,
        BLOCK_N=p_down["DOWN_BLOCK_N"],
        BLOCK_K=p_down["DOWN_BLOCK_K"],
        SPLIT_STEPS=split_steps,
        num_warps=p_down["DOWN_WARPS"],
        num_stages=p_down["DOWN_STAGES"],
        **d_consts,
    )
    _sum_routes_kernel[(t, triton.cdiv(h, REDUCE_BLOCK))](
        c,
        slots,
        weights,
        out,
        c.stride(0),
        c.stride(1),
        out.stride(0),
        HIDDEN=h,
        K=k,
        SPLIT=split if split > 1 else 0,
        BLOCK=REDUCE_BLOCK,
        num_warps=4,
    )
    return out


def down_split(programs: int, inter: int, params: dict[str, int]) -> tuple[int, int]:
    """(splits, BLOCK_K steps a split) of the down kernel's columns: (1, 0) keeps each
    program walking all INTER columns. A format's DOWN_SPLIT_STEPS > 0 splits a call whose
    programs walk more steps than that, while the grid stays under DOWN_SPLIT_MAX_PROGRAMS,
    the splits as even as whole steps allow (19 steps at 4: 4, 4, 4, 4, 3)."""
    steps = -(-inter // params["DOWN_BLOCK_K"])
    most = params["DOWN_SPLIT_STEPS"]
    if most <= 0 or steps <= most:
        return 1, 0
    split = min(-(-steps // most), max(1, DOWN_SPLIT_MAX_PROGRAMS // max(programs, 1)))
    if split <= 1:
        return 1, 0
    per = -(-steps // split)
    return -(-steps // per), per


def triton_dequantize_slots(bank: QuantizedBank, slots: Tensor, dtype: torch.dtype) -> Tensor:
    """`dequantize_slots` as one Triton launch (grid: slots x row blocks), on whatever device
    Triton runs on (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _, n, kdim = bank.shape
    slots = slots.reshape(-1)
    out = torch.empty(slots.numel(), n, kdim, dtype=dtype, device=bank.device)
    if out.numel() == 0:
        return out
    args, consts = _bank_args(bank, dtype, INTERPRETED)
    w, s, g, stride_ws, stride_wn, stride_ss, stride_sn, stride_gs = args
    _dequantize_kernel[(slots.numel(), triton.cdiv(n, DEQUANTIZE_BLOCK_N))](
        w,
        s,
        g,
        slots.contiguous(),
        out,
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        out.stride(0),
        out.stride(1),
        N=n,
        KDIM=kdim,
        INTERPRETED=INTERPRETED,
        BLOCK_N=DEQUANTIZE_BLOCK_N,
        BLOCK_K=DEQUANTIZE_BLOCK_K,
        num_warps=DEQUANTIZE_WARPS,
        **consts,
    )
    return out


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
        if triton is not None:
            return triton_grouped_expert_forward(
                x, slots, weights, w_gate_up, w_down, act, b_gate_up
            )
    return reference_grouped_experts(x, slots, weights, w_gate_up, w_down, act, b_gate_up)
