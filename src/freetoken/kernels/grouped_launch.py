"""The grouped expert kernels' launches: their parameters per format, the checks of the banks
they take, and the Python launchers (`triton_grouped_expert_forward` for decode,
`triton_dequantize_slots` for the grouped GEMMs' quantized banks).

Each launcher runs on whatever device Triton runs on (CUDA, or CPU tensors under
TRITON_INTERPRET=1 for tests). The launch parameters are module globals read at call time
(`launch_params`), so the benchmarks and tests may set them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freetoken.activations import activation_code
from freetoken.kernels import INTERPRETED
from freetoken.kernels.grouped_kernels import (
    _dequantize_kernel,
    _down_kernel,
    _gate_up_act_kernel,
    _sum_routes_kernel,
)
from freetoken.kernels.grouped_reference import Bank, check_args, check_bias
from freetoken.weights.expert_format import QuantizedBank
from freetoken.weights.quantized import K_QUANT_REST, LEGACY_REST

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
    t, k, h, i = check_args(x, slots, weights, w_gate_up, w_down)
    check_bias(b_gate_up, w_gate_up, x.dtype)
    act_code = activation_code(act)  # (a clear error for an unknown name)
    gate_up = _bank_args(w_gate_up, x.dtype, INTERPRETED)
    down = _bank_args(w_down, x.dtype, INTERPRETED)
    if b_gate_up is not None and b_gate_up.stride(1) != 1:
        raise ValueError("the bias bank must be contiguous in its last dimension")
    routes = t * k
    if routes == 0:
        return torch.zeros_like(x)
    p, p_down = _projection_params(w_gate_up, w_down, gate_up[1], down[1])
    x = x.contiguous()
    slots = slots.contiguous()
    weights = weights.contiguous()
    a = torch.empty(routes, i, dtype=x.dtype, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    _launch_gate_up(x, slots, gate_up, b_gate_up, a, p, k, act_code)
    c, split = _launch_down(a, slots, weights, down, p_down, h)
    _launch_sum_routes(c, slots, weights, out, split, k)
    return out


def _projection_params(
    w_gate_up: Bank, w_down: Bank, gu_consts: dict, d_consts: dict
) -> tuple[dict[str, int], dict[str, int]]:
    """Each projection's launch parameters, its own format's (a Q4_K_M file's gate/up Q5_0 and
    down k_mixed), refused where its kernel cannot take them."""
    dense = isinstance(w_gate_up, Tensor)
    p = launch_params("dense" if dense else w_gate_up.format.name)
    p_down = launch_params("dense" if dense else w_down.format.name)
    _check_blocks(gu_consts["FORMAT"], p, "GATE_UP")
    _check_blocks(d_consts["FORMAT"], p_down, "DOWN")
    return p, p_down


def _launch_gate_up(
    x: Tensor,
    slots: Tensor,
    bank: tuple[list, dict],
    b_gate_up: Tensor | None,
    a: Tensor,
    p: dict[str, int],
    k: int,
    act_code: int,
) -> None:
    """a [routes, I] = the gated unit of each route's gate/up projections (`_bank_args`' bank)."""
    (w, s, g, stride_ws, stride_wn, stride_ss, stride_sn, stride_gs), consts = bank
    routes, i = a.shape
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
        HIDDEN=x.shape[1],
        INTER=i,
        K=k,
        ACT=act_code,
        HAS_BIAS=b_gate_up is not None,
        INTERPRETED=INTERPRETED,
        BLOCK_N=p["GATE_UP_BLOCK_N"],
        BLOCK_K=p["GATE_UP_BLOCK_K"],
        num_warps=p["GATE_UP_WARPS"],
        num_stages=p["GATE_UP_STAGES"],
        **consts,
    )


def _launch_down(
    a: Tensor,
    slots: Tensor,
    weights: Tensor,
    bank: tuple[list, dict],
    p_down: dict[str, int],
    h: int,
) -> tuple[Tensor, int]:
    """(c, splits): each route's weighted down projection c [1, routes, H] in a's dtype, or,
    where the columns are split (`down_split`), the fp32 partials [splits, routes, H]."""
    (w, s, g, stride_ws, stride_wn, stride_ss, stride_sn, stride_gs), consts = bank
    routes, i = a.shape
    row_blocks = triton.cdiv(h, p_down["DOWN_BLOCK_N"])
    split, split_steps = down_split(routes * row_blocks, i, p_down)
    if split > 1:  # fp32 partials [split, routes, H]
        c = torch.empty(split, routes, h, dtype=torch.float32, device=a.device)
    else:
        c = torch.empty(1, routes, h, dtype=a.dtype, device=a.device)
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
        **consts,
    )
    return c, split


def _launch_sum_routes(
    c: Tensor, slots: Tensor, weights: Tensor, out: Tensor, split: int, k: int
) -> None:
    """out [T, H] = each token's k route contributions of `_launch_down`'s c, added in order."""
    t, h = out.shape
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
