"""Attention over the paged KV cache, reading keys and values where they lie.

Every sequence's keys are its first `lengths[b]` positions, found through its row of the page
table: position j lives at slot `page_table[row, j // page_size] * page_size + j % page_size`
of the flat `[slots, kv_heads, head_dim]` pools. Queries are the batch's new tokens (the last
`counts[b]` positions of each sequence), so the causal mask is implied by positions, and a
sliding window keeps keys within `window` positions of the query. Grouped-query attention reads
each KV head once for its whole group of query heads. Attention sinks (gpt-oss) add one logit
per head to the softmax's denominator.

Three implementations of that one contract:
- `paged_decode_triton`: one new token per sequence on a GPU (flash-decoding; a few per sequence
  too, a verify step's: each token then reads its sequence's keys up to itself,
  `ForwardBatch.per_query`): programs over (sequence, KV head, split of the keys) each run an
  online softmax over their split, a second kernel merges the splits. Lengths are read on the
  device, so a CUDA graph captured once serves every length, and the split count is fixed per
  batch size. Heads wider than 256 take it with 16 query heads a program and 32 keys a step:
  Gemma-4's full layers (512 wide, keys and values in their own pools), and multi-head latent
  attention's (keys [latent, RoPE part], 512 + 64 wide, the values the latent itself: the pool
  read as both), the RoPE part's scores added, the latent read once as key and value, the output
  the latent's width.
- `paged_decode_cpu`: one new token per sequence on the CPU, through the native library's
  thread team (cpu_layers.c, `ft_cpu_attention_submit`): the same splits and online softmax,
  reading bf16 keys and values in place with AVX512-BF16 dot products where the CPU has them.
- `paged_attention_torch`: any batch, any device, the reference and the CPU path: per sequence,
  its keys gathered on the device from the table (no host work per key), then SDPA (a fused
  kernel with an implicit lower-right causal mask on the GPU) or, for one query (decode) and
  with sinks, the explicit softmax as two batched products over the KV heads: on the CPU,
  SDPA's fused kernel cost 0.5 ms of fixed work per call at decode, more than the rest of the
  layer's attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

from freetoken.kernels import INTERPRETED, cpu_team
from freetoken.kv.batch import ForwardBatch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Keys per inner step of a split, warps and pipeline stages: the fastest of 36 variants in CUDA
# graphs on the H200 machine at 32k keys (benchmarks/paged_attention.py: 25.8 us a layer at
# batch 1, 70.9 at batch 4, 3.8 TB/s, against 27.9 and 78.2 for 64 keys, 4 warps, 3 stages).
DECODE_BLOCK_N = 128
DECODE_WARPS = 4
DECODE_STAGES = 3
# Splits per (sequence, KV head): enough programs to fill the GPU at batch 1 (132 SMs on an
# H200) and no more, since each split's partial costs a read and a write in the merge.
DECODE_TARGET_PROGRAMS = 256
DECODE_MAX_SPLITS = 64
# Heads wider than 256 (latent attention's 512, Gemma-4's full layers' 512): a [16, 512]
# accumulator a program and fewer keys a step, so registers and shared memory hold them (not
# swept on a GPU; compiled for sm_90 offline by ptxas 12.8, in bf16 without spills: 161
# registers and 66 KiB of shared memory for 512 + 64 read as values, 250 and 49 KiB for 512
# with its own values; in fp32 the latter takes 162 KiB, within the H100's 227).
WIDE_GROUP_BLOCK = 16
WIDE_BLOCK_N = 32
WIDE_WARPS = 8
WIDE_STAGES = 2
# The merge reads its splits' partials this many columns at a time (a [64, 512] fp32 block at
# once spills its registers).
MERGE_BLOCK_D = 256


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    values: int | None = None,
) -> torch.Tensor:
    """Attention of the batch's new tokens: q [T, heads, d] -> [T, heads, d]. Where the pool
    is read as its own values (`v_pool is k_pool`) and the caller reads only the first
    `values` columns of the result (latent attention), the Triton decode kernel may return
    fewer columns, at least `values`."""
    # (a verify step's few tokens a sequence too, each as a sequence of its own)
    few = batch.is_decode or batch.few_queries
    queries = None if not few else batch if batch.is_decode else batch.per_query
    if queries is not None and q.is_cuda and triton_decode_takes(q, k_pool, v_pool, values):
        return paged_decode_triton(q, k_pool, v_pool, queries, scale, window, sinks)
    if queries is not None and cpu_decode_takes(q, k_pool):
        return paged_decode_cpu(q, k_pool, v_pool, queries, scale, window, sinks)
    return paged_attention_torch(q, k_pool, v_pool, batch, scale, window, sinks)


# ---------------------------------------------------------------------------------------------
# Native CPU decode
# ---------------------------------------------------------------------------------------------

_CPU_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
_P, _I64 = cpu_team.P, cpu_team.I64
SIGNATURES: cpu_team.Signatures = {  # decode attention's (cpu_layers.c)
    # dtype, q, k_pool, v_pool, table, width, page, rows, lengths, B, heads, kv_heads, D,
    # window, scale, sinks, out, split_as, threads
    "ft_cpu_attention_submit": (
        [
            cpu_team.INT,
            _P,
            _P,
            _P,
            _P,
            _I64,
            _I64,
            _P,
            _P,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            cpu_team.F,
            _P,
            _P,
            _I64,
            cpu_team.INT,
        ],
        cpu_team.U64,
    ),
}
cpu_team.declare(SIGNATURES)


def _widths(d: int, values_are_keys: bool) -> tuple[int, int] | None:
    """(value width, key-only width) of heads `d` wide as the Triton decode kernel takes them:
    (d, 0) for a power of two from 16 to 512 (Gemma-4's full layers: 512); where the values
    are the keys' first part (latent attention), a power of two up to 512 and a key-only rest
    of at least 16, itself a power of two (576 = 512 + 64); None otherwise."""
    if 16 <= d <= 512 and not d & (d - 1):
        return d, 0
    main = 1 << (d.bit_length() - 1)
    rest = d - main
    if values_are_keys and main <= 512 and rest >= 16 and not rest & (rest - 1):
        return main, rest
    return None


def triton_decode_width(d: int, values_are_keys: bool = False, values: int = 0) -> bool:
    """Whether the Triton decode kernel takes heads `d` wide (`_widths`), of which `values`
    leading columns are read as values."""
    widths = _widths(d, values_are_keys)
    return triton is not None and widths is not None and widths[0] >= values


def triton_decode_takes(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, values: int | None = None
) -> bool:
    return triton_decode_width(q.shape[-1], v_pool is k_pool and values is not None, values or 0)


def cpu_decode_takes(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype == k_pool.dtype
        and q.dtype in _CPU_DTYPES
        and q.shape[1] // k_pool.shape[1] <= 64
        and k_pool.is_contiguous()
        and cpu_team.library() is not None
    )


def paged_decode_cpu(q, k_pool, v_pool, batch: ForwardBatch, scale, window=None, sinks=None):
    """One query per sequence on the CPU team: q [B, heads, d] -> [B, heads, d]."""
    b, heads, d = q.shape
    q = q.contiguous()
    out = torch.empty(b, heads, d, dtype=torch.float32)
    sink = sinks.float().contiguous() if sinks is not None else None  # held until done
    table = batch.page_table
    ticket = cpu_team.library().ft_cpu_attention_submit(
        _CPU_DTYPES[q.dtype],
        q.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        table.data_ptr(),
        table.shape[1],
        batch.page_size,
        batch.rows.data_ptr(),
        batch.lengths.data_ptr(),
        b,
        heads,
        k_pool.shape[1],
        d,
        window or 0,
        scale,
        sink.data_ptr() if sink is not None else None,
        out.data_ptr(),
        batch.split_as or b,
        cpu_team.team_threads(),
    )
    if ticket == 0:
        return paged_attention_torch(q, k_pool, v_pool, batch, scale, window, sinks)
    cpu_team.wait(ticket)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def sequence_slots(batch: ForwardBatch, b: int) -> torch.Tensor:
    """The KV slots of sequence b's keys, in position order, computed on the device."""
    length, ps = batch.seq_lens[b], batch.page_size
    pages = batch.page_table[batch.row_ids[b], : -(-length // ps)]
    offsets = torch.arange(ps, device=pages.device)
    return (pages[:, None] * ps + offsets).flatten()[:length]


def paged_attention_torch(
    q, k_pool, v_pool, batch: ForwardBatch, scale, window=None, sinks=None
) -> torch.Tensor:
    out = torch.empty_like(q)
    for b, (start, count) in enumerate(zip(batch.starts, batch.counts, strict=True)):
        slots = sequence_slots(batch, b)
        keys = k_pool.index_select(0, slots).transpose(0, 1)[None]  # [1, kvh, L, d]
        values = v_pool.index_select(0, slots).transpose(0, 1)[None]
        queries = q[start : start + count].transpose(0, 1)[None]  # [1, h, n, d]
        length = batch.seq_lens[b]
        mask = None
        if window is not None or sinks is not None:
            q_pos = torch.arange(length - count, length, device=q.device)[:, None]
            k_pos = torch.arange(length, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        if sinks is not None or count == 1:
            o = _explicit_attention(queries, keys, values, mask, scale, sinks)
        else:
            o = causal_attention(queries, keys, values, scale, mask)
        out[start : start + count] = o[0].transpose(0, 1)
    return out


def causal_attention(q, k, v, scale, mask=None) -> torch.Tensor:
    """SDPA of one sequence's n newest queries against its L keys, causal from the bottom
    right (the queries are the last n positions) unless `mask` [n, L] is given: q [1, h, n, d],
    k [1, kvh, L, d], v [1, kvh, L, d_v] -> [1, h, n, d_v]."""
    if mask is None and q.shape[2] != k.shape[2]:
        return _lower_right_causal(q, k, v, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )


# memory-efficient attention's mask types: 0 none, 1 causal from the top left, 2 from the
# bottom right (torch.nn.attention.bias.CausalVariant's values)
LOWER_RIGHT_MASK = 2


def _lower_right_causal(q, k, v, scale) -> torch.Tensor:
    """Fewer queries than keys, causal from the bottom right (a prefill after a cached prefix).
    SDPA's `is_causal` means the top left, so this takes the kernels whose causal mask is the
    bottom right where they apply, as `torch.nn.attention.bias.causal_lower_right` does,
    without that module: it imports torch._dynamo, 3.5-9.6 s of Python on the H200 machine that
    held the GIL beside a fresh server's first requests. Flash attention (its causal is the
    bottom right), memory-efficient attention (mask type 2), else SDPA with the mask made."""
    n, length = q.shape[2], k.shape[2]
    if q.is_cuda:
        params = SDPAParams(q, k, v, None, 0.0, False, True)  # (no mask, dropout; GQA)
        if can_use_flash_attention(params):
            head = q.shape[-1]
            pad = -head % 8  # (flash's head sizes: multiples of 8)
            if pad:
                q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale
            )[0]
            return out[..., :head]
        if can_use_efficient_attention(params):
            return torch.ops.aten._efficient_attention_forward(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                bias=None,
                cu_seqlens_q=None,
                cu_seqlens_k=None,
                max_seqlen_q=None,
                max_seqlen_k=None,
                dropout_p=0.0,
                custom_mask_type=LOWER_RIGHT_MASK,
                compute_log_sumexp=False,
                scale=scale,
                seqlen_k=None,
            )[0].transpose(1, 2)
    mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _explicit_attention(q, k, v, mask, scale, sinks):
    """Softmax attention as products over each KV head's group of query heads (no K/V copied
    per head); the softmax in fp32, its denominator also holding exp(sinks[h]) when given (a
    logit with no value). q [1, h, n, d], k and v [1, kvh, L, d], mask [n, L] or None (all
    keys visible)."""
    _, heads, n, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # [kvh, group * n, d] @ [kvh, d, L]: query heads of a group share their KV head's keys.
    qg = q[0].reshape(kv_heads, group * n, d)
    scores = torch.bmm(qg.float(), k[0].float().transpose(1, 2)) * scale
    scores = scores.view(kv_heads, group, n, length)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(kv_heads, group, 1, 1).expand(kv_heads, group, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs.view(kv_heads, group * n, length).to(v.dtype), v[0])
    return out.view(1, heads, n, d)


# ---------------------------------------------------------------------------------------------
# Triton decode
# ---------------------------------------------------------------------------------------------


def decode_splits(batch_size: int, kv_heads: int) -> int:
    """How many splits each (sequence, KV head) gets: fixed by the batch's shape, so a graph
    captured for a batch size serves every context length."""
    return max(1, min(DECODE_MAX_SPLITS, DECODE_TARGET_PROGRAMS // max(1, batch_size * kv_heads)))


def paged_decode_triton(
    q,
    k_pool,
    v_pool,
    batch: ForwardBatch,
    scale,
    window=None,
    sinks=None,
    splits=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
) -> torch.Tensor:
    """One query per sequence: q [B, heads, d] -> [B, heads, d], or [B, heads, value width]
    for keys wider than their values (`_widths`). `splits`, `block_n`, `num_warps` and
    `num_stages` override the defaults (tests, benchmarks/paged_attention.py)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    b, heads, d = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    widths = _widths(d, v_pool is k_pool)
    if widths is None:
        raise ValueError(
            f"head_dim {d} is not a power of two from 16 to 512 (nor a latent "
            "head read as its own values)"
        )
    width, rope = widths
    wide = width > 256
    group_pad = max(16, triton.next_power_of_2(group))
    group_block = min(group_pad, WIDE_GROUP_BLOCK) if wide else group_pad
    head_blocks = group_pad // group_block
    splits = splits or decode_splits(batch.split_as or b, kv_heads * head_blocks)
    partial = torch.empty(b, heads, splits, width, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    table = batch.page_table
    _decode_split_kernel[(b, kv_heads * head_blocks, splits)](
        q,
        k_pool,
        v_pool,
        table,
        batch.rows,
        batch.lengths,
        partial,
        lse,
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        window or 0,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        table.stride(0),
        splits,
        PAGE=batch.page_size,
        GROUP=group,
        GROUP_BLOCK=group_block,
        HEAD_BLOCKS=head_blocks,
        HEADS=heads,
        HEAD_D=width,
        ROPE_D=rope,
        ROPE_PAD=max(rope, 16),
        VALUES_ARE_KEYS=v_pool is k_pool,
        BLOCK_N=block_n or (WIDE_BLOCK_N if wide else DECODE_BLOCK_N),
        INTERPRETED=INTERPRETED,
        # fp32 (tests, CPU-exact runs) without TF32 rounding; bf16 / fp16 as they are.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (WIDE_WARPS if wide else DECODE_WARPS),
        num_stages=num_stages or (WIDE_STAGES if wide else DECODE_STAGES),
    )
    return _merge_splits(partial, lse, sinks, q.new_empty(b, heads, width))


def _merge_splits(partial, lse, sinks, out: torch.Tensor) -> torch.Tensor:
    """The splits' partial outputs [B, heads, splits, width] (fp32) and their log-sum-exps
    merged into `out` [B, heads, width], the sinks (if any) in the softmax."""
    b, heads, splits, width = partial.shape
    has_sinks = sinks is not None
    _decode_merge_kernel[(b, heads)](
        partial,
        lse,
        sinks if has_sinks else lse,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        HEAD_D=width,
        BLOCK_D=min(width, MERGE_BLOCK_D),
        HAS_SINKS=has_sinks,
    )
    return out


if triton is not None:

    @triton.jit
    def _attend_block(
        q,
        q_rope,
        K,
        V,
        TABLE,
        row,
        start,
        hi,
        m,
        total,
        acc,
        qk_scale,
        stride_table,
        stride_kn,
        head_offset,
        PAGE: tl.constexpr,
        HEAD_D: tl.constexpr,
        ROPE_D: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        VALUES_ARE_KEYS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One block of keys [start, start + BLOCK_N) into the online softmax (m, total, acc).
        ROPE_D > 0: the keys' last ROPE_D values score against q_rope and are no value."""
        j = start + tl.arange(0, BLOCK_N)
        valid = j < hi
        page = tl.load(TABLE + row * stride_table + j // PAGE, mask=valid, other=0)
        slot = page * PAGE + j % PAGE
        offs = slot[:, None] * stride_kn + head_offset + tl.arange(0, HEAD_D)[None, :]
        k = tl.load(K + offs, mask=valid[:, None], other=0.0)
        if VALUES_ARE_KEYS:  # noqa: SIM108  (a constexpr branch: no load at all)
            v = k
        else:
            v = tl.load(V + offs, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if ROPE_D > 0:
            r = tl.arange(0, ROPE_PAD)
            k_rope = tl.load(
                K + slot[:, None] * stride_kn + head_offset + HEAD_D + r[None, :],
                mask=valid[:, None] & (r < ROPE_D)[None, :],
                other=0.0,
            )
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        s = s * qk_scale  # base-2 logits
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, total, acc

    @triton.jit
    def _split_span(LENGTHS, ROWS, seq, split, window, splits, BLOCK_N: tl.constexpr):
        """(row, lo, hi): the sequence's page-table row and the keys [lo, hi) of its split."""
        length = tl.load(LENGTHS + seq)
        row = tl.load(ROWS + seq)
        first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        span = length - first
        # Each split takes a whole number of blocks; later splits may find nothing to do.
        per_split = tl.cdiv(tl.cdiv(span, splits), BLOCK_N) * BLOCK_N
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, length)
        return row, lo, hi

    @triton.jit
    def _queries(
        q_rows,
        d,
        head_ok,
        HEAD_D: tl.constexpr,
        ROPE_D: tl.constexpr,
        ROPE_PAD: tl.constexpr,
    ):
        """(q, q_rope): the heads' queries, and their key-only part (ROPE_D > 0; else q)."""
        q = tl.load(q_rows + d[None, :], mask=head_ok[:, None], other=0.0)
        if ROPE_D > 0:
            r = tl.arange(0, ROPE_PAD)
            q_rope = tl.load(
                q_rows + HEAD_D + r[None, :],
                mask=head_ok[:, None] & (r < ROPE_D)[None, :],
                other=0.0,
            )
        else:
            q_rope = q  # (no key-only part: unused)
        return q, q_rope

    @triton.jit
    def _attend_span_interpreted(
        q,
        q_rope,
        K,
        V,
        TABLE,
        row,
        lo,
        hi,
        m,
        total,
        acc,
        qk_scale,
        stride_table,
        stride_kn,
        head_offset,
        PAGE: tl.constexpr,
        HEAD_D: tl.constexpr,
        ROPE_D: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        VALUES_ARE_KEYS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """`_attend_span`'s loop under the CPU interpreter, which cannot range over loaded
        values: the same blocks by a `while` loop."""
        start = lo
        while start < hi:
            m, total, acc = _attend_block(
                q,
                q_rope,
                K,
                V,
                TABLE,
                row,
                start,
                hi,
                m,
                total,
                acc,
                qk_scale,
                stride_table,
                stride_kn,
                head_offset,
                PAGE,
                HEAD_D,
                ROPE_D,
                ROPE_PAD,
                VALUES_ARE_KEYS,
                BLOCK_N,
                PRECISION,
            )
            start += BLOCK_N
        return m, total, acc

    @triton.jit
    def _attend_span(
        q,
        q_rope,
        K,
        V,
        TABLE,
        row,
        lo,
        hi,
        qk_scale,
        stride_table,
        stride_kn,
        head_offset,
        PAGE: tl.constexpr,
        GROUP_BLOCK: tl.constexpr,
        HEAD_D: tl.constexpr,
        ROPE_D: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        VALUES_ARE_KEYS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        INTERPRETED: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """(m, total, acc): the online softmax of keys [lo, hi), block by block (the compiled
        kernel's `for` loop, which Triton pipelines)."""
        m = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_BLOCK], tl.float32)
        acc = tl.zeros([GROUP_BLOCK, HEAD_D], tl.float32)
        if INTERPRETED:
            return _attend_span_interpreted(
                q,
                q_rope,
                K,
                V,
                TABLE,
                row,
                lo,
                hi,
                m,
                total,
                acc,
                qk_scale,
                stride_table,
                stride_kn,
                head_offset,
                PAGE,
                HEAD_D,
                ROPE_D,
                ROPE_PAD,
                VALUES_ARE_KEYS,
                BLOCK_N,
                PRECISION,
            )
        for start in range(lo, hi, BLOCK_N):
            m, total, acc = _attend_block(
                q,
                q_rope,
                K,
                V,
                TABLE,
                row,
                start,
                hi,
                m,
                total,
                acc,
                qk_scale,
                stride_table,
                stride_kn,
                head_offset,
                PAGE,
                HEAD_D,
                ROPE_D,
                ROPE_PAD,
                VALUES_ARE_KEYS,
                BLOCK_N,
                PRECISION,
            )
        return m, total, acc

    @triton.jit
    def _decode_split_kernel(
        Q,
        K,
        V,
        TABLE,
        ROWS,
        LENGTHS,
        PARTIAL,
        LSE,
        qk_scale,
        window,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_table,
        splits,
        PAGE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_BLOCK: tl.constexpr,
        HEAD_BLOCKS: tl.constexpr,
        HEADS: tl.constexpr,
        HEAD_D: tl.constexpr,
        ROPE_D: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        VALUES_ARE_KEYS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        INTERPRETED: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1) // HEAD_BLOCKS  # (a KV head's query heads, GROUP_BLOCK at
        head_block = tl.program_id(1) % HEAD_BLOCKS  # a time)
        split = tl.program_id(2)
        row, lo, hi = _split_span(LENGTHS, ROWS, seq, split, window, splits, BLOCK_N)

        g = head_block * GROUP_BLOCK + tl.arange(0, GROUP_BLOCK)
        heads = kv_head * GROUP + g
        head_ok = g < GROUP
        d = tl.arange(0, HEAD_D)
        q_rows = Q + seq * stride_qb + heads[:, None] * stride_qh
        q, q_rope = _queries(q_rows, d, head_ok, HEAD_D, ROPE_D, ROPE_PAD)
        m, total, acc = _attend_span(
            q,
            q_rope,
            K,
            V,
            TABLE,
            row,
            lo,
            hi,
            qk_scale,
            stride_table,
            stride_kn,
            kv_head * stride_kh,
            PAGE,
            GROUP_BLOCK,
            HEAD_D,
            ROPE_D,
            ROPE_PAD,
            VALUES_ARE_KEYS,
            BLOCK_N,
            INTERPRETED,
            PRECISION,
        )
        out_offs = (seq * HEADS + heads) * splits + split
        empty = total == 0.0
        tl.store(
            PARTIAL + out_offs[:, None] * HEAD_D + d[None, :],
            acc / tl.where(empty, 1.0, total)[:, None],
            mask=head_ok[:, None],
        )
        # Log-sum-exp in base 2; -inf for a split with no keys, which the merge skips.
        lse = tl.where(empty, float("-inf"), m + tl.log2(total))
        tl.store(LSE + out_offs, lse, mask=head_ok)

    @triton.jit
    def _decode_merge_kernel(
        PARTIAL,
        LSE,
        SINKS,
        OUT,
        stride_ob,
        stride_oh,
        splits,
        SPLITS_PAD: tl.constexpr,
        HEAD_D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, SPLITS_PAD)
        ok = s < splits
        base = (seq * heads + head) * splits
        lse = tl.load(LSE + base + s, mask=ok, other=float("-inf"))
        top = tl.max(lse, 0)
        if HAS_SINKS:
            sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(top, sink)
        w = tl.exp2(lse - top)
        total = tl.sum(w, 0)
        if HAS_SINKS:
            total += tl.exp2(sink - top)
        for first in tl.static_range(0, HEAD_D, BLOCK_D):  # (one block up to 256 wide)
            d = first + tl.arange(0, BLOCK_D)
            part = tl.load(
                PARTIAL + (base + s)[:, None] * HEAD_D + d[None, :], mask=ok[:, None], other=0.0
            )
            o = tl.sum(part * w[:, None], 0) / total
            tl.store(OUT + seq * stride_ob + head * stride_oh + d, o.to(OUT.dtype.element_ty))
