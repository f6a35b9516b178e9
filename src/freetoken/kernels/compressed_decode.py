"""DeepSeek-V4's compressed attention (layers/compressed_attention.py) in a few launches on the
GPU: the RoPE of its last `rope_dim` values (with the queries' unweighted RMSNorm before it),
the pooling of a window's rows into one entry, and a decode step's attention over the sliding
window, the chosen entries and the sinks.

Why: in torch a V4 layer's decode step was ~240 kernels (a rotation alone is a dozen: the
interleave, the halves, the stack, the casts), each one or two microseconds of a GPU with
nothing else to do at batch 1, so the non-expert step cost more than the experts' transfer
(benchmarks/results/2026-12-06-deepseek-v4-flash-shape.md). Each kernel here computes what its
torch definition in layers/compressed_attention.py computes (which stays the CPU path and the
reference), in the same order of roundings where the dtype rounds, so the two agree to fp32
rounding (fused multiply-adds and the order of a sum aside).
"""

from __future__ import annotations

import torch

from freetoken.kernels import norm_rope

try:  # Triton is optional: CPU-only installs (and CI) take the torch path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


# Rows a pooling program reads at a time, keys an attention program takes at a time (the tests
# make them small, so that their prompts cross blocks).
POOL_ROWS, KEYS = 16, 32
# Decode attention over many keys with few programs splits the keys (`key_splits`): up to this
# many programs in all, each walking at least this many blocks of KEYS.
SPLIT_PROGRAMS, SPLIT_BLOCKS = 64, 4


# Whether these kernels run on a tensor: on CUDA, with Triton (norm_rope's test, under a name of
# its own so that tests switch these kernels apart from the others).
kernel_takes = norm_rope.available


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rms_eps: float | None = None):
    """x [T, D] or [T, H, D] (last dimension contiguous) with V4's interleaved RoPE on its last
    2 * cos.shape[-1] values (cos, sin [T, rope_dim / 2] in x's dtype), as
    `compressed_attention.rope_tail`; with `rms_eps`, x first normed without a weight, as
    `compressed_attention.unweighted_rms`. A new contiguous tensor."""
    flat = x.dim() == 2
    x3 = x[:, None] if flat else x
    t, heads, d = x3.shape
    half = cos.shape[-1]
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t and heads:
        cos, sin = cos.contiguous(), sin.contiguous()
        _rope_tail_kernel[(t, heads)](
            x3,
            cos,
            sin,
            out,
            x3.stride(0),
            x3.stride(1),
            d,
            half,
            0.0 if rms_eps is None else rms_eps,
            NORM=rms_eps is not None,
            BLOCK=_pow2(d - 2 * half),
            HALF=_pow2(half),
        )
    return out[:, 0] if flat else out


def pool_entries(
    pool,
    page_table,
    rows_of,
    positions,
    write_slots,
    page_size: int,
    ratio: int,
    overlap: bool,
    cols: tuple[int, int, int, int],
    ape,
    norm_weight,
    eps: float,
    cos,
    sin,
) -> None:
    """Write into `pool` [slots, 1, W], at each new token's row (`write_slots` [T], column
    `cols[2]`, `cols[3]` values wide), the entry of the window ending at that token, as
    `Compressor.pool` computes it from the rows of the window's tokens (columns `cols[0]`
    (projections) and `cols[1]` (gate logits), found through `page_table` from `rows_of` [T]
    and `positions` [T]), normed by `norm_weight` (fp32) and turned by cos, sin [T, half]."""
    t, d = positions.shape[0], cols[3]
    if not t:
        return
    series = 2 if overlap else 1
    _pool_kernel[(t,)](
        pool,
        page_table,
        rows_of,
        positions,
        write_slots,
        ape,
        norm_weight,
        cos.contiguous(),
        sin.contiguous(),
        pool.stride(0),
        page_table.stride(0),
        page_size,
        cols[0],
        cols[1],
        cols[2],
        eps,
        cos.shape[-1],
        R=ratio,
        SERIES=series,
        D=d,
        D_BLOCK=_pow2(d),
        S_BLOCK=min(_pow2(series * ratio), POOL_ROWS),
        HALF=_pow2(cos.shape[-1]),
        num_warps=8,
    )


def attend(
    q,
    pool,
    page_table,
    rows,
    positions,
    page_size: int,
    window: int,
    kv_col: int,
    entry_ids,
    ratio: int,
    entry_col: int,
    sinks,
    scale: float,
) -> torch.Tensor:
    """A decode step's attention, as `CompressedAttention._softmax_attend` over `_decode`'s
    keys: each sequence's queries q [B, H, D] over the K=V rows of its last `window` tokens
    (column `kv_col`) and the entries (column `entry_col`) of the windows `entry_ids` [B, E]
    names (-1: none; the window w's entry sits in the row of its last token, (w + 1) * ratio -
    1), with the per-head `sinks` (fp32) in the softmax. Rows are found through `page_table`
    from `rows` [B] and `positions` [B] (the new token's)."""
    b, heads, d = q.shape
    out = torch.empty_like(q)
    if not b:
        return out
    q = q.contiguous()
    n_entries = entry_ids.shape[1] if entry_ids is not None else 0
    ids = entry_ids.contiguous() if entry_ids is not None else positions
    hb = 16
    blocks = triton.cdiv(window + n_entries, KEYS)
    splits = key_splits(b * triton.cdiv(heads, hb), blocks)
    span = triton.cdiv(blocks, splits) * KEYS  # keys a program walks (whole blocks)
    splits = triton.cdiv(blocks * KEYS, span)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # (fp32 tests: no TF32)
    args = [
        q,
        pool,
        page_table,
        rows,
        positions,
        ids,
        sinks,
        pool.stride(0),
        page_table.stride(0),
        page_size,
        window,
        kv_col,
        n_entries,
        max(ratio, 1),
        entry_col,
        heads,
        scale,
    ]
    shapes = dict(D=d, D_BLOCK=max(_pow2(d), 16), HB=hb, KB=KEYS, PRECISION=precision)
    grid = (b, triton.cdiv(heads, hb))
    if splits == 1:
        _attend_kernel[grid](*args, out, **shapes, num_warps=8)
        return out
    # Each split's softmax max and sum, then each split's keys mixed with the probabilities
    # of the whole softmax (rounded as the reference rounds them), then the splits summed.
    stats = torch.empty(b, splits, 2, heads, dtype=torch.float32, device=q.device)
    partial = torch.empty(b, splits, heads, d, dtype=torch.float32, device=q.device)
    split_args = [*args, span, splits, stats, partial]
    split_shapes = dict(shapes, SPLITS_P=_pow2(splits))
    _attend_split_kernel[(*grid, splits)](*split_args, **split_shapes, MIX=0, num_warps=8)
    _attend_split_kernel[(*grid, splits)](*split_args, **split_shapes, MIX=1, num_warps=8)
    return partial.sum(1).to(q.dtype)


def key_splits(programs: int, blocks: int) -> int:
    """How many programs share a (sequence, head block)'s keys: one where enough programs run
    or the keys are few; else as many as fill ~SPLIT_PROGRAMS programs, each walking at least
    SPLIT_BLOCKS blocks of keys. (At batch 1 V4's 64 heads are 4 programs; at 128k tokens an
    HCA layer's ~1,150 keys were 72 blocks walked in turn by each, over both passes.)"""
    if programs >= SPLIT_PROGRAMS or blocks < 2 * SPLIT_BLOCKS:
        return 1
    return max(1, min(blocks // SPLIT_BLOCKS, SPLIT_PROGRAMS // programs))


if triton is not None:

    @triton.jit
    def _turn(even, odd, cos, sin, dt):
        """V4's RoPE of interleaved pairs (even, odd) in fp32: (e c - o s, o c + e s), rounded."""
        return (even * cos - odd * sin).to(dt), (odd * cos + even * sin).to(dt)

    @triton.jit
    def _rope_tail_kernel(
        X,
        COS,
        SIN,
        OUT,
        stride_t,
        stride_h,
        d,
        half,
        eps,
        NORM: tl.constexpr,
        BLOCK: tl.constexpr,
        HALF: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dt = OUT.dtype.element_ty
        src = X + t * stride_t + head * stride_h
        dst = OUT + (t * tl.num_programs(1) + head) * d
        nope = d - 2 * half
        i = tl.arange(0, BLOCK)
        j = tl.arange(0, HALF)
        ok, pair = i < nope, j < half
        x = tl.load(src + i, mask=ok, other=0.0)
        even = tl.load(src + nope + 2 * j, mask=pair, other=0.0)
        odd = tl.load(src + nope + 2 * j + 1, mask=pair, other=0.0)
        if NORM:  # x * rsqrt(mean(x^2) + eps), the factor rounded to the dtype first
            xf, ef, of = x.to(tl.float32), even.to(tl.float32), odd.to(tl.float32)
            total = tl.sum(xf * xf, 0) + tl.sum(ef * ef, 0) + tl.sum(of * of, 0)
            r = tl.rsqrt(total / d + eps).to(dt).to(tl.float32)
            x = (xf * r).to(dt)
            even, odd = (ef * r).to(dt), (of * r).to(dt)
        tl.store(dst + i, x, mask=ok)
        c = tl.load(COS + t * half + j, mask=pair, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * half + j, mask=pair, other=0.0).to(tl.float32)
        e2, o2 = _turn(even.to(tl.float32), odd.to(tl.float32), c, s, dt)
        tl.store(dst + nope + 2 * j, e2, mask=pair)
        tl.store(dst + nope + 2 * j + 1, o2, mask=pair)

    @triton.jit
    def _slot(PT, pt_stride, row, position, page_size):
        """The cache slot of `position` of the sequence on page-table row `row`."""
        page = tl.load(PT + row * pt_stride + position // page_size).to(tl.int64)
        return page * page_size + position % page_size

    @triton.jit
    def _window_rows(
        PT,
        pt_stride,
        page_size,
        row,
        p,
        s0,
        closes,
        c,
        c_ok,
        R: tl.constexpr,
        SERIES: tl.constexpr,
        D: tl.constexpr,
        S_BLOCK: tl.constexpr,
    ):
        """(s, slot, col, both) of block s0 of the S = SERIES * R rows of the window closing at
        position p: the rows, their cache slots, the columns of channels c and what to read
        (nothing unless the token closes its window; no row before the sequence's start)."""
        S: tl.constexpr = SERIES * R
        s = s0 + tl.arange(0, S_BLOCK)
        at = p - S + 1 + s
        ok = (s < S) & (at >= 0) & closes
        slot = _slot(PT, pt_stride, row, tl.maximum(at, 0), page_size)
        # (CSA: a window's own tokens take the second series, the previous window's the first)
        part = (s // R == SERIES - 1).to(tl.int64) * (SERIES - 1)
        col = part[:, None] * D + c[None, :]
        both = ok[:, None] & c_ok[None, :]
        return s, slot, col, both

    @triton.jit
    def _store_rope_tail(dst, y, c, nope, COS, SIN, t, half, closes, dt, HALF: tl.constexpr):
        """The RoPE of the entry's last 2 * half values (pairs interleaved; y re-read as pairs)
        into dst, where the token closes its window."""
        j = tl.arange(0, HALF)
        pair = (j < half) & closes
        yf = y.to(tl.float32)[None, :]
        even = tl.sum(tl.where(c[None, :] == nope + 2 * j[:, None], yf, 0.0), 1)
        odd = tl.sum(tl.where(c[None, :] == nope + 2 * j[:, None] + 1, yf, 0.0), 1)
        cs = tl.load(COS + t * half + j, mask=pair, other=0.0).to(tl.float32)
        sn = tl.load(SIN + t * half + j, mask=pair, other=0.0).to(tl.float32)
        e2, o2 = _turn(even, odd, cs, sn, dt)
        tl.store(dst + nope + 2 * j, e2, mask=pair)
        tl.store(dst + nope + 2 * j + 1, o2, mask=pair)

    @triton.jit
    def _pool_kernel(
        POOL,
        PT,
        ROWS_OF,
        POS,
        WRITE,
        APE,
        NW,
        COS,
        SIN,
        row_w,
        pt_stride,
        page_size,
        kv_col,
        gate_col,
        entry_col,
        eps,
        half,
        R: tl.constexpr,
        SERIES: tl.constexpr,
        D: tl.constexpr,
        D_BLOCK: tl.constexpr,
        S_BLOCK: tl.constexpr,
        HALF: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        dt = POOL.dtype.element_ty
        row = tl.load(ROWS_OF + t).to(tl.int64)
        p = tl.load(POS + t).to(tl.int64)
        # Only the entry of a token closing its window is ever read (the last row of each
        # window): the others are not computed, every load and store masked off.
        closes = (p + 1) % R == 0
        c = tl.arange(0, D_BLOCK)
        c_ok = c < D
        S: tl.constexpr = SERIES * R
        # Pass 1: each channel's largest gate logit and its softmax sum over the window's rows.
        # (finite: a block whose rows all precede the sequence's start leaves it as it was)
        m = tl.full([D_BLOCK], -1e30, tl.float32)
        total = tl.zeros([D_BLOCK], tl.float32)
        for s0 in range(0, S, S_BLOCK):
            s, slot, col, both = _window_rows(
                PT, pt_stride, page_size, row, p, s0, closes, c, c_ok, R, SERIES, D, S_BLOCK
            )
            g = tl.load(POOL + slot[:, None] * row_w + gate_col + col, mask=both, other=0.0)
            a = tl.load(APE + (s % R)[:, None] * (SERIES * D) + col, mask=both, other=0.0)
            g = tl.where(both, g.to(tl.float32) + a, float("-inf"))
            m_new = tl.maximum(m, tl.max(g, 0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(g - m_new[None, :]), 0)
            m = m_new
        # Pass 2: the weights rounded to the dtype, each product rounded, summed in fp32.
        acc = tl.zeros([D_BLOCK], tl.float32)
        for s0 in range(0, S, S_BLOCK):
            s, slot, col, both = _window_rows(
                PT, pt_stride, page_size, row, p, s0, closes, c, c_ok, R, SERIES, D, S_BLOCK
            )
            g = tl.load(POOL + slot[:, None] * row_w + gate_col + col, mask=both, other=0.0)
            a = tl.load(APE + (s % R)[:, None] * (SERIES * D) + col, mask=both, other=0.0)
            w = (tl.exp(g.to(tl.float32) + a - m[None, :]) / total[None, :]).to(dt)
            kv = tl.load(POOL + slot[:, None] * row_w + kv_col + col, mask=both, other=0.0)
            prod = (kv.to(tl.float32) * w.to(tl.float32)).to(dt).to(tl.float32)
            acc += tl.sum(tl.where(both, prod, 0.0), 0)
        pooled = acc.to(dt).to(tl.float32)
        # The compressor's RMSNorm (weight in fp32, applied before the cast).
        h = pooled * tl.rsqrt(tl.sum(pooled * pooled, 0) / D + eps)
        y = (tl.load(NW + c, mask=c_ok, other=0.0) * h).to(dt)
        dst = POOL + tl.load(WRITE + t).to(tl.int64) * row_w + entry_col
        nope = D - 2 * half
        tl.store(dst + c, y, mask=(c < nope) & closes)
        _store_rope_tail(dst, y, c, nope, COS, SIN, t, half, closes, dt, HALF)

    @triton.jit
    def _attend_kernel(
        Q,
        POOL,
        PT,
        ROWS,
        POS,
        IDS,
        SINKS,
        row_w,
        pt_stride,
        page_size,
        window,
        kv_col,
        n_entries,
        ratio,
        entry_col,
        heads,
        scale,
        OUT,
        D: tl.constexpr,
        D_BLOCK: tl.constexpr,
        HB: tl.constexpr,
        KB: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        q, row, p, d, hd = _query(Q, ROWS, POS, b, h, heads, D, D_BLOCK)
        # The softmax starts from the sinks: a logit each, attending nothing.
        m = tl.load(SINKS + h, mask=h < heads, other=0.0).to(tl.float32)
        total = tl.full([HB], 1.0, tl.float32)
        acc = tl.zeros([HB, D_BLOCK], tl.float32)
        ids = IDS + b * n_entries
        # Two passes, as the reference rounds: the softmax's max and sum, then the probabilities
        # rounded to the dtype and mixed.
        for MIX in tl.static_range(2):
            m, total, acc = _attend_span(
                q,
                m,
                total,
                acc,
                0,
                window + n_entries,
                POOL,
                PT,
                ids,
                row,
                p,
                row_w,
                pt_stride,
                page_size,
                window,
                kv_col,
                n_entries,
                ratio,
                entry_col,
                scale,
                D,
                D_BLOCK,
                KB,
                PRECISION,
                MIX,
            )
        tl.store(
            OUT + (b * heads + h)[:, None] * D + d[None, :], acc.to(OUT.dtype.element_ty), mask=hd
        )

    @triton.jit
    def _attend_split_kernel(
        Q,
        POOL,
        PT,
        ROWS,
        POS,
        IDS,
        SINKS,
        row_w,
        pt_stride,
        page_size,
        window,
        kv_col,
        n_entries,
        ratio,
        entry_col,
        heads,
        scale,
        span,
        splits,
        STATS,
        PARTIAL,
        D: tl.constexpr,
        D_BLOCK: tl.constexpr,
        HB: tl.constexpr,
        KB: tl.constexpr,
        PRECISION: tl.constexpr,
        SPLITS_P: tl.constexpr,
        MIX: tl.constexpr,
    ):
        """`_attend_kernel`'s keys [split * span, + span) of a sequence's head block: the
        softmax's max and sum over them into STATS [B, splits, 2, heads] (split 0 starting from
        the sinks), or (MIX) the whole softmax's from every split's STATS, and their keys mixed
        into PARTIAL [B, splits, heads, D] in fp32."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        split = tl.program_id(2)
        q, row, p, d, hd = _query(Q, ROWS, POS, b, h, heads, D, D_BLOCK)
        start = split * span
        end = tl.minimum(start + span, window + n_entries)
        stats = STATS + b * splits * 2 * heads
        if MIX:
            m, total = _whole_softmax(stats, splits, heads, h, HB, SPLITS_P)
        else:
            m, total = _split_start(SINKS, split, heads, h, HB)
        acc = tl.zeros([HB, D_BLOCK], tl.float32)
        m, total, acc = _attend_span(
            q,
            m,
            total,
            acc,
            start,
            end,
            POOL,
            PT,
            IDS + b * n_entries,
            row,
            p,
            row_w,
            pt_stride,
            page_size,
            window,
            kv_col,
            n_entries,
            ratio,
            entry_col,
            scale,
            D,
            D_BLOCK,
            KB,
            PRECISION,
            MIX,
        )
        if MIX:
            cells = PARTIAL + ((b * splits + split) * heads + h)[:, None] * D + d[None, :]
            tl.store(cells, acc, mask=hd)
        else:  # (m's row, then total's)
            tl.store(stats + split * 2 * heads + h, m, mask=h < heads)
            tl.store(stats + (split * 2 + 1) * heads + h, total, mask=h < heads)

    @triton.jit
    def _query(Q, ROWS, POS, b, h, heads, D: tl.constexpr, D_BLOCK: tl.constexpr):
        """Sequence b's queries of heads h [HB, D_BLOCK], its page-table row and position, the
        dimension indices and the mask of real heads and dimensions."""
        d = tl.arange(0, D_BLOCK)
        hd = (h < heads)[:, None] & (d < D)[None, :]
        q = tl.load(Q + (b * heads + h)[:, None] * D + d[None, :], mask=hd, other=0.0)
        return q, tl.load(ROWS + b).to(tl.int64), tl.load(POS + b).to(tl.int64), d, hd

    @triton.jit
    def _split_start(SINKS, split, heads, h, HB: tl.constexpr):
        """A split's softmax before its keys: split 0's from the sinks (a logit each,
        attending nothing), the others' empty (m finite: a span may hold no key)."""
        sink = tl.load(SINKS + h, mask=h < heads, other=0.0).to(tl.float32)
        first = split == 0
        return tl.where(first, sink, -1e30), tl.where(first, 1.0, 0.0) + tl.zeros([HB], tl.float32)

    @triton.jit
    def _whole_softmax(stats, splits, heads, h, HB: tl.constexpr, SPLITS_P: tl.constexpr):
        """The softmax's max and sum over every split's, per head: [HB] each."""
        s = tl.arange(0, SPLITS_P)
        ok = (s < splits)[:, None] & (h < heads)[None, :]
        ms = tl.load(stats + (s * 2)[:, None] * heads + h[None, :], mask=ok, other=-1e30)
        ts = tl.load(stats + (s * 2 + 1)[:, None] * heads + h[None, :], mask=ok, other=0.0)
        m = tl.max(ms, 0)
        return m, tl.sum(ts * tl.exp(ms - m[None, :]), 0)

    @triton.jit
    def _attend_span(
        q,
        m,
        total,
        acc,
        start,
        end,
        POOL,
        PT,
        ids,
        row,
        p,
        row_w,
        pt_stride,
        page_size,
        window,
        kv_col,
        n_entries,
        ratio,
        entry_col,
        scale,
        D: tl.constexpr,
        D_BLOCK: tl.constexpr,
        KB: tl.constexpr,
        PRECISION: tl.constexpr,
        MIX: tl.constexpr,
    ):
        """Keys [start, end) block by block into (m, total) or, MIX, into acc. (A while, not a
        for over a runtime bound: Triton's interpreter, the CPU tests', cannot range over one.)"""
        k0 = start
        while k0 < end:
            m, total, acc = _attend_block(
                q,
                m,
                total,
                acc,
                k0,
                POOL,
                PT,
                ids,
                row,
                p,
                row_w,
                pt_stride,
                page_size,
                window,
                kv_col,
                n_entries,
                ratio,
                entry_col,
                scale,
                D,
                D_BLOCK,
                KB,
                PRECISION,
                MIX,
            )
            k0 += KB
        return m, total, acc

    @triton.jit
    def _attend_block(
        q,
        m,
        total,
        acc,
        k0,
        POOL,
        PT,
        ids,
        row,
        p,
        row_w,
        pt_stride,
        page_size,
        window,
        kv_col,
        n_entries,
        ratio,
        entry_col,
        scale,
        D: tl.constexpr,
        D_BLOCK: tl.constexpr,
        KB: tl.constexpr,
        PRECISION: tl.constexpr,
        MIX: tl.constexpr,
    ):
        """Keys k0..k0 + KB (the window's, oldest first, then the named entries'): taken into
        the softmax's running max and sum, or (MIX, the sum final) mixed into acc weighted by
        their probabilities rounded to the dtype; the logits rounded as the reference's einsum
        and scale round them."""
        dt = POOL.dtype.element_ty
        k = k0 + tl.arange(0, KB)
        in_window = k < window
        at = p - (window - 1) + k  # (a window key's position)
        named = (k >= window) & (k < window + n_entries)
        e = tl.load(ids + (k - window), mask=named, other=-1).to(tl.int64)
        ok = tl.where(in_window, at >= 0, e >= 0)
        position = tl.where(in_window, at, (e + 1) * ratio - 1)
        slot = _slot(PT, pt_stride, row, tl.maximum(position, 0), page_size)
        col = tl.where(in_window, kv_col, entry_col)
        d = tl.arange(0, D_BLOCK)
        keys = tl.load(
            POOL + (slot * row_w + col)[:, None] + d[None, :],
            mask=ok[:, None] & (d < D)[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
        s = (s.to(dt).to(tl.float32) * scale).to(dt).to(tl.float32)
        s = tl.where(ok[None, :], s, float("-inf"))
        if MIX:
            probs = (tl.exp(s - m[:, None]) / total[:, None]).to(dt)
            return m, total, acc + tl.dot(probs, keys, input_precision=PRECISION)
        m_new = tl.maximum(m, tl.max(s, 1))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        return m_new, total, acc
