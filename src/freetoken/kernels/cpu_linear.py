"""Dense layers of decode-sized batches on the CPU through the native kernel's thread team.

A decode step multiplies a few rows of activations by each weight matrix: a matrix-vector
product bound by how fast the weights stream from memory. torch's bf16 GEMV streamed them at
about 8 GB/s on the 2-core test machine, a third of its memory bandwidth; the lm_head alone
(152k x 2048 in bf16, 622 MB on Qwen3-30B-A3B) then took most of a step. The native kernel
(cpu_layers.c, `ft_cpu_linear_submit`) reads each weight row once for all rows of x, on the
same team of threads as the CPU experts. Results follow torch's: a dot product in fp32, the
bias added, one rounding to the layer's dtype (only the order of the sums differs).

A dense layer kept quantized (weights/expert_format.py's QuantizedWeight: a GGUF file's blocks)
goes the same way through `ft_cpu_qlinear_submit`, which reads each weight row once from its
blocks through the expert kernel's decoders and dot products: each value is the dense layer's on
the dequantized weight, and a step streams the blocks' bytes only (a Q8_0 row is 53% of its bf16
row, a Q4_K row 28%).
"""

from __future__ import annotations

import torch

from freetoken.kernels.cpu_team import (
    I64,
    INT,
    U64,
    P,
    Signatures,
    declare,
    library,
    team_threads,
    wait,
)
from freetoken.weights.expert_format import QuantizedWeight

SIGNATURES: Signatures = {  # the dense layers' (cpu_layers.c)
    # dtype, w, bias, N, H, x, x_bf16, T, out, threads
    "ft_cpu_linear_submit": ([INT, P, P, I64, I64, P, INT, I64, P, INT], U64),
    # dtype, fmt, w, s, g, block rows, block cols, bias, N, H, x, x_bf16, T, out, threads: a
    # dense layer kept quantized
    "ft_cpu_qlinear_submit": (
        [INT, INT, P, P, P, I64, I64, P, I64, I64, P, INT, I64, P, INT],
        U64,
    ),
    # dtype, fmt, w, s, g, block rows, block cols, N, K, out, threads: such a layer's weight
    # dequantized
    "ft_cpu_dequantize_submit": ([INT, INT, P, P, P, I64, I64, I64, I64, P, INT], U64),
}
declare(SIGNATURES)
_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
# Below this many weight bytes torch's own call, which costs no handoff to the team, is as
# fast (a router of 128 x 2048 in bf16, 512 KiB, still gained).
MIN_WEIGHT_BYTES = 1 << 18
MAX_ROWS = 16  # decode batches; longer inputs (prefill) are GEMMs, which torch does well


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the native kernel computes this layer: CPU tensors of a decode-sized batch, a
    large enough weight in bf16 or fp32, the activations in the same dtype."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dtype in _DTYPES
        and x.dtype == weight.dtype
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.numel() * weight.element_size() >= MIN_WEIGHT_BYTES
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
        and library() is not None
    )


def native_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None = None
) -> torch.Tensor:
    """x [T, H] . weight [N, H]^T + bias, in x's dtype (check `takes` first)."""
    return _run(
        library().ft_cpu_linear_submit,
        (_DTYPES[weight.dtype], weight.data_ptr()),
        x,
        weight.shape[0],
        bias,
        threads,
    )


def _run(
    submit,
    weight_args: tuple,
    x: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    threads: int | None,
) -> torch.Tensor:
    """One linear job on the team: `submit(*weight_args, bias, N, K, x, x is bf16, T, out,
    threads)`, waited for; the result in x's dtype."""
    x = x.contiguous()
    t, k = x.shape
    out = torch.empty(t, n, dtype=torch.float32)
    bias = bias.to(x.dtype).contiguous() if bias is not None else None  # (held until done)
    ticket = submit(
        *weight_args,
        bias.data_ptr() if bias is not None else None,
        n,
        k,
        x.data_ptr(),
        x.dtype == torch.bfloat16,
        t,
        out.data_ptr(),
        threads or team_threads(),
    )
    if ticket == 0:
        raise RuntimeError("could not start a CPU linear job (threads or memory)")
    wait(ticket)  # this thread works on it too
    return out.to(x.dtype)  # exact: every value is already rounded to x's dtype


def _parts(weight: QuantizedWeight) -> tuple:
    """The weight's arguments for the kernel: its format's code, its parts and fp8's block."""
    fmt = weight.format
    g = weight.g.data_ptr() if weight.g is not None else None
    return (fmt.code, weight.w.data_ptr(), weight.s.data_ptr(), g, fmt.row_block, fmt.col_block)


def takes_quantized(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether the native kernel computes this layer kept quantized: `takes`'s rule but for the
    weight's size (the alternative, dequantizing it for torch, costs more than the handoff
    whatever its size)."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and not torch.is_grad_enabled()
        and library() is not None
    )


def native_qlinear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    threads: int | None = None,
) -> torch.Tensor:
    """x [T, K] . weight [N, K]^T + bias, in x's dtype (check `takes_quantized` first): the
    dense layer's on weight.dequantize(x.dtype)."""
    return _run(
        library().ft_cpu_qlinear_submit,
        (_DTYPES[x.dtype], *_parts(weight)),
        x,
        weight.shape[0],
        bias,
        threads,
    )


def dequantized(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """weight.dequantize(dtype), by the native decoders on the team where they take it (a
    prompt's layer dequantizes its weight per call: torch's K-quant definition took 0.2-1 s
    for one of the 0.5B Qwen's down projections on the 2-core machine)."""
    if weight.device.type != "cpu" or dtype not in _DTYPES or library() is None:
        return weight.dequantize(dtype)
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype)
    ticket = library().ft_cpu_dequantize_submit(
        _DTYPES[dtype], *_parts(weight), n, k, out.data_ptr(), team_threads()
    )
    if ticket == 0:
        raise RuntimeError("could not start a CPU dequantizing job (threads or memory)")
    wait(ticket)
    return out
