"""The Lightning Indexer's scores in one kernel, read in place from the paged cache: for each
decoding sequence and each candidate key (a token's index key for DSA, layers/mla.py; a closed
window's index entry for DeepSeek-V4's CSA layers, layers/compressed_attention.py)

    score = sum over heads h of  w[h] * relu(q[h] . key) * scale,   -inf past `valid`

which the torch code computes by gathering every key of the context into a new tensor, then
four or five passes over the [heads, keys] products in fp32: with it a GLM-5-shaped model
decoded 128k tokens of context at 0.83 of its short-context speed on an H100, with this kernel
at 0.96 (batch 1; benchmarks/results/2026-12-06-v4-decode-h100.md). Here each key is read
once, where it lies, and only the [B, keys] scores are written (the top-k stays torch's). Keys
past a sequence's `valid` are not read. The products are summed in fp32 (bf16 keys and
queries exact in it; fp32 ones through an fp32 dot), in another order than torch's, so scores
agree to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from freetoken.kernels import norm_rope

try:  # Triton is optional: CPU-only installs (and CI) take the torch path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

KEYS = 64  # candidate keys a program scores (the tests make it small, so that they cross blocks)

# Whether the kernel runs on a tensor: on CUDA, with Triton (norm_rope's test, under a name of
# its own so that tests switch this kernel apart from the others).
kernel_takes = norm_rope.available


@dataclass(frozen=True)
class PagedKeys:
    """Where candidate keys lie in the paged cache: key j of sequence b is columns [column,
    column + d) of the row (pool [slots, 1, width]) of position first + j * stride, j < count,
    of the sequence on page-table row rows[b]."""

    pool: torch.Tensor
    column: int
    page_table: torch.Tensor
    rows: torch.Tensor
    page_size: int
    first: int = 0
    stride: int = 1
    count: int = 0

    def every(self, tokens: int) -> PagedKeys:
        """Each of the first `tokens` positions (DSA: a key per token)."""
        return replace(self, first=0, stride=1, count=tokens)

    def closing(self, windows: int, ratio: int) -> PagedKeys:
        """The rows of the first `windows` windows' last tokens (V4: an entry per window)."""
        return replace(self, first=ratio - 1, stride=ratio, count=windows)


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: PagedKeys,
    valid: torch.Tensor,
    scale: float,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, heads, d] (the keys' dtype, or fp32), weights [B, heads] (any float dtype, rows at
    any stride: the columns of a stacked projection's output) -> scores [B, keys.count] fp32,
    each head's weight taken as `weights.float() * weight_scale`; keys j >= valid[b] score
    -inf."""
    b, heads, d = q.shape
    out = torch.empty(b, keys.count, dtype=torch.float32, device=q.device)
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    if b and keys.count:
        _scores_kernel[(b, triton.cdiv(keys.count, KEYS))](
            q.contiguous(),
            weights,
            weights.stride(0),
            weight_scale,
            keys.pool,
            keys.pool.stride(0),
            keys.column,
            keys.page_table,
            keys.page_table.stride(0),
            keys.rows,
            valid,
            out,
            keys.count,
            keys.page_size,
            keys.first,
            keys.stride,
            scale,
            HEADS=heads,
            D=d,
            HEADS_P=max(16, triton.next_power_of_2(heads)),  # (tl.dot's least tile)
            D_P=max(16, triton.next_power_of_2(d)),
            BLOCK=KEYS,
            IEEE=q.dtype == torch.float32,
        )
    return out


if triton is not None:

    @triton.jit
    def _keys_tile(
        POOL, row_stride, column, TABLE, table_row, first, stride, page_size, j, ok, d, D
    ):
        """The keys of candidates j [BLOCK] as a [D_P, BLOCK] tile (zero where not `ok`)."""
        position = first + j * stride
        page = tl.load(TABLE + table_row + position // page_size, mask=ok, other=0)
        slot = page * page_size + position % page_size
        cells = POOL + slot[None, :] * row_stride + column + d[:, None]
        return tl.load(cells, mask=ok[None, :] & (d[:, None] < D), other=0.0)

    @triton.jit
    def _scores_kernel(
        Q,
        W,
        w_stride,
        w_scale,
        POOL,
        row_stride,
        column,
        TABLE,
        table_stride,
        ROWS,
        VALID,
        OUT,
        count,
        page_size,
        first,
        stride,
        scale,
        HEADS: tl.constexpr,
        D: tl.constexpr,
        HEADS_P: tl.constexpr,
        D_P: tl.constexpr,
        BLOCK: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, D_P)
        valid = tl.load(VALID + b)
        ok = (j < count) & (j < valid)
        table_row = tl.load(ROWS + b) * table_stride
        keys = _keys_tile(
            POOL, row_stride, column, TABLE, table_row, first, stride, page_size, j, ok, d, D
        )
        q_cells = Q + (b * HEADS + h[:, None]) * D + d[None, :]
        q = tl.load(q_cells, mask=(h[:, None] < HEADS) & (d[None, :] < D), other=0.0)
        if IEEE:
            dots = tl.dot(q, keys.to(q.dtype), input_precision="ieee")
        else:
            dots = tl.dot(q, keys.to(q.dtype))  # [HEADS_P, BLOCK], fp32 sums of exact products
        w = tl.load(W + b * w_stride + h, mask=h < HEADS, other=0.0).to(tl.float32) * w_scale
        scores = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
        scores = tl.where(ok, scores, float("-inf"))
        tl.store(OUT + b * count + j, scores, mask=j < count)
