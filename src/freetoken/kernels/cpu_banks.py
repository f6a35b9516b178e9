"""A weight bank as the native CPU kernels read it (cpu_native.h's proj_t; the formats:
cpu_formats.c): its parts' pointers and block shape, and one expert of it decoded by the
library's decoders (cpu_decoders.c). Below both the experts' wrapper (cpu_experts.py) and the
torch executor of cached experts (grouped_reference.py), which decodes a quantized slot here on
the CPU."""

from __future__ import annotations

import numpy as np
import torch

from freetoken.kernels.cpu_team import I64, INT, P, Signatures, declare, library
from freetoken.weights.expert_format import K_FAMILY, LEGACY, QuantizedBank

DTYPES = {torch.bfloat16: 0, torch.float32: 1}  # the kernels' dtype codes
SIGNATURES: Signatures = {  # the decoders' (cpu_decoders.c)
    # dtype, fmt, w, s, g, block rows, block cols, pair, N, K, out: one expert's rows decoded
    "ft_cpu_experts_decode": ([INT, INT, P, P, P, I64, I64, I64, I64, I64, P], None),
    "ft_cpu_experts_decoder_bits": ([], INT),  # the decoders' vector width (tests)
    # whether bf16 jobs compute GGUF's scaled formats with the file's values (cpu_dots.c)
    "ft_cpu_bf16_scaled_codes": ([], INT),
}
declare(SIGNATURES)


def bf16_scaled_codes(fmt) -> bool:
    """Whether this build's bf16 jobs compute `fmt` with the file's values (GGUF's legacy and
    K-quant blocks by scaled codes, cpu_dots.c's `scaled_format`: built with AVX512-BF16), not
    with their bf16 roundings as every other format."""
    lib = library()
    return (
        lib is not None
        and bool(lib.ft_cpu_bf16_scaled_codes())
        and (fmt.name in K_FAMILY or fmt.name in LEGACY)
    )


def ptr(a: np.ndarray | torch.Tensor | None) -> int | None:
    if a is None:
        return None
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def projection(bank, rows: int, cols: int, dtype: torch.dtype) -> tuple | None:
    """A projection's (weights, scales, per-row scales, block rows, block cols) for the kernel,
    or None where it cannot take the bank (a layout, dtype or device it does not read)."""
    if isinstance(bank, torch.Tensor):
        if bank.dtype != dtype or tuple(bank.shape[1:]) != (rows, cols):
            return None
        parts, blocks = (bank, None, None), (0, 0)
    else:
        if tuple(bank.shape[1:]) != (rows, cols) or bank.mismatch(dtype) is not None:
            return None
        parts, blocks = (bank.w, bank.s, bank.g), (bank.format.row_block, bank.format.col_block)
    if not all(p is None or (p.is_contiguous() and p.device.type == "cpu") for p in parts):
        return None
    return (*parts, *blocks)


def decodes(bank: QuantizedBank, dtype: torch.dtype) -> bool:
    """Whether `decode_expert` takes this bank here (a CPU bank, a dtype the kernels write, a
    compiled library)."""
    _, rows, cols = bank.shape
    return dtype in DTYPES and projection(bank, rows, cols, dtype) is not None and bool(library())


def decode_expert(bank: QuantizedBank, pair: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `pair` of a quantized bank as the native kernel decodes it, [N, K] in `dtype`:
    `bank.dequantize`'s values (the definition, which tests hold it to), one call in C where
    torch's definition of a K-quant takes 0.2-1 s for a 0.5B Qwen's MLP on a 2-core CPU."""
    _, rows, cols = bank.shape
    parts = projection(bank, rows, cols, dtype)
    lib = library()
    if parts is None or lib is None or dtype not in DTYPES:
        raise ValueError("the native kernel cannot decode this bank here")
    w, s, g, block_rows, block_cols = parts
    out = torch.empty(rows, cols, dtype=dtype)
    lib.ft_cpu_experts_decode(
        DTYPES[dtype],
        bank.format.code,
        ptr(w),
        ptr(s),
        ptr(g),
        block_rows,
        block_cols,
        pair,
        rows,
        cols,
        out.data_ptr(),
    )
    return out
