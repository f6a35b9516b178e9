"""RMSNorm, rotary embeddings and top-k routing in one kernel launch each, on the GPU;
RMSNorm and rotary embeddings of a decode step's rows in one native call each, on the CPU.

At batch 1 a decode step's kernels are tiny and their count sets the time: torch's RMSNorm is
six launches (to fp32, square, mean, rsqrt, scale, cast and weight) and a rotation five, four
norms and two rotations per attention layer; on the H200 machine the model without its routed
experts took 2.16 ms a step, most of it in such launches; routing (softmax, top-k, renormalise,
cast) is five more per MoE layer. Each kernel here does a row's whole
computation, in the reference's order of roundings (layers/norm.py, layers/rope.py), so it
gives the same values (the norm's sum of squares and the softmax's sum may differ in their last
fp32 bit: their order is a tree here). The torch code stays the reference, and the CPU path for
prompts.

On the CPU the same holds at decode for another reason: each torch op is a dispatch of several
microseconds, and a norm or a rotation of one row is a few thousand values. The native library
(cpu_layers.c, `ft_cpu_rms_norm`, `ft_cpu_rotary`) does each in one call on the calling thread,
in the same order of roundings: a 0.5B Qwen's decode step on a 2-core Intel machine went from
47.7 to 44.8 ms (benchmarks/results/2026-12-05-cpu-row-ops-and-drafts.md).
"""

from __future__ import annotations

import torch

from freetoken.kernels import cpu_team
from freetoken.kernels.cpu_team import I64, INT, F, P, Signatures, declare

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


_CPU_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
CPU_MAX_ROWS = 16  # a decode batch's; a prompt's rows are torch's, which vectorises across rows
_NORM_MODES = {(False, False): 0, (False, True): 1, (True, True): 2}  # (zero_centered, fp32)
SIGNATURES: Signatures = {  # the row operations' (cpu_layers.c)
    # dtype, x, delta, weight, T, H, eps, mode, sum, out: a decode step's RMSNorm
    "ft_cpu_rms_norm": ([INT, P, P, P, I64, I64, F, INT, P, P], None),
    # dtype, x, row stride, head stride, T, heads, D, cos, sin, cos row stride, rot, out
    "ft_cpu_rotary": ([INT, P, I64, I64, I64, I64, I64, P, P, I64, I64, P], None),
}
declare(SIGNATURES)


def native_takes(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the native library computes x's rows on the CPU: a decode step's few rows in bf16
    or fp32, with `others` (weights, deltas, cos and sin) on the CPU in x's dtype."""
    return (
        x.device.type == "cpu"
        and x.dtype in _CPU_DTYPES
        and x.dim() >= 2
        and x.numel() <= CPU_MAX_ROWS * x.shape[-1] * (x.shape[-2] if x.dim() == 3 else 1)
        and all(o.device.type == "cpu" and o.dtype == x.dtype for o in others)
        and not torch.is_grad_enabled()
        and cpu_team.library() is not None
    )


def cpu_rms_norm(x, delta, weight, eps, zero_centered: bool, scale_fp32: bool):
    """(s, RMSNorm(s)) for s = x + delta (x itself where delta is None) on the CPU, as
    layers/norm.py computes it (check `native_takes` first)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(rows)
    total = rows
    if delta is not None:
        delta = delta.reshape(-1, shape[-1]).contiguous()
        total = torch.empty_like(rows)
    weight = weight.contiguous()
    cpu_team.library().ft_cpu_rms_norm(
        _CPU_DTYPES[x.dtype],
        rows.data_ptr(),
        delta.data_ptr() if delta is not None else None,
        weight.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        eps,
        _NORM_MODES[zero_centered, scale_fp32 or zero_centered],
        total.data_ptr(),
        out.data_ptr(),
    )
    return total.view(shape), out.view(shape)


def cpu_apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated on the CPU, as layers/rope.py does (check `native_takes`
    first); x may be a view with any row and head strides whose last dimension is contiguous."""
    t, heads, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    if cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(t, heads, d, dtype=x.dtype)
    cpu_team.library().ft_cpu_rotary(
        _CPU_DTYPES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        t,
        heads,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        cos.shape[-1],
        out.data_ptr(),
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, scale_fp32: bool
):
    """RMSNorm over the last dimension of x (any leading shape), as layers/norm.py computes it."""
    return _norm(x, None, weight, eps, zero_centered, scale_fp32)[1]


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    scale_fp32: bool,
):
    """(s, RMSNorm(s)) for s = x + delta rounded to x.dtype, as torch's add then the norm: a
    decoder's residual add joined to the norm that reads it, one launch where they were two
    (at batch 1 the add is a whole kernel's latency for a few KB)."""
    return _norm(x, delta, weight, eps, zero_centered, scale_fp32)


def _strided_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., n] as rows the kernels read at their strides, no copy for x [T, n] or
    [T, heads, n] whose last dimension is contiguous (a stacked projection's columns, a head
    view of them): (x or a contiguous copy, heads, row stride, head stride); row r is at
    (r // heads) * row stride + (r % heads) * head stride."""
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    rows = x.reshape(-1, x.shape[-1])
    return x, 1, rows.stride(0), 0


def _norm(x, delta, weight, eps, zero_centered, scale_fp32):
    shape = x.shape
    x, heads, row_stride, head_stride = _strided_rows(x)
    n = shape[-1]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if delta is None:
        deltas = total = out  # (not read nor written)
    else:
        deltas = delta.contiguous()
        total = torch.empty_like(out)
    _rms_norm_kernel[(out.numel() // n,)](
        x,
        deltas,
        total,
        weight,
        out,
        n,
        heads,
        row_stride,
        head_stride,
        eps,
        BLOCK=triton.next_power_of_2(n),
        ZERO_CENTERED=zero_centered,
        SCALE_FP32=scale_fp32,
        HAS_DELTA=delta is not None,
    )
    return (x if delta is None else total), out


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs_first: bool = False
) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (any row and head strides) by cos, sin [T, rotary_dim]
    (partial rotary leaves the rest), as layers/rope.py does, `pairs_first` too: read as
    layers/rope.py's `pairs_to_halves` lays it out, with no copy made for it."""
    t, heads, d = x.shape
    rot = cos.shape[-1]
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    _rotary_kernel[(t, heads)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        d,
        rot // 2,
        BLOCK=triton.next_power_of_2(max(rot // 2, d - rot, 1)),
        PAIRS=pairs_first,
    )
    return out


def route_sqrtsoftplus(logits, bias, top_k: int, scaling: float, ids=None):
    """DeepSeek-V4's routing of logits [T, E] (layers/moe.py `route_sqrtsoftplus`): scores
    sqrt(softplus(logits)) in the logits' dtype, the top-k of score + bias (fp32) or the given
    `ids` (a hash layer's), their scores normalised and scaled, each step rounded to the dtype
    as torch rounds it. -> (weights [T, k] in the logits' dtype, ids [T, k])."""
    t, e = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(t, top_k, device=logits.device, dtype=logits.dtype)
    given = ids is not None
    out_ids = (
        ids.contiguous() if given else torch.empty(t, top_k, device=logits.device, dtype=torch.long)
    )
    has_bias = bias is not None
    _sqrtsoftplus_kernel[(t,)](
        logits,
        bias if has_bias else logits,
        weights,
        out_ids,
        e,
        scaling,
        K=top_k,
        BLOCK=triton.next_power_of_2(e),
        K_BLOCK=triton.next_power_of_2(top_k),
        GIVEN=given,
        HAS_BIAS=has_bias,
    )
    return weights, out_ids


def route_sigmoid(logits, bias, moe):
    """Sigmoid routing of fp32 logits [T, E] with the correction bias [E] and group-limited
    choice (layers/moe.py `route_sigmoid`: DeepSeek-V3, GLM-4.5/5, Kimi-K2): one launch where
    torch takes about fifteen. -> (fp32 weights [T, k], ids [T, k])."""
    t, e = logits.shape
    logits = logits.float().contiguous()
    weights = torch.empty(t, moe.top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(t, moe.top_k, device=logits.device, dtype=torch.long)
    groups = moe.num_groups
    _sigmoid_route_kernel[(t,)](
        logits,
        bias.float().contiguous(),
        weights,
        ids,
        e,
        e // groups,
        moe.routed_scaling,
        K=moe.top_k,
        BLOCK=triton.next_power_of_2(e),
        K_BLOCK=triton.next_power_of_2(moe.top_k),
        GROUPS=groups,
        G_BLOCK=triton.next_power_of_2(groups),
        TOPK_GROUPS=moe.topk_groups,
        TG_BLOCK=triton.next_power_of_2(moe.topk_groups),
        NORMALIZE=moe.norm_topk_prob,
    )
    return weights, ids


def route(logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool):
    """Softmax top-k of router logits [T, E]: (weights [T, k], ids [T, k]), as layers/moe.py."""
    t, e = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(
        t, top_k, device=logits.device, dtype=torch.float32 if fp32_weights else logits.dtype
    )
    ids = torch.empty(t, top_k, device=logits.device, dtype=torch.long)
    _route_kernel[(t,)](
        logits,
        weights,
        ids,
        e,
        K=top_k,
        BLOCK=triton.next_power_of_2(e),
        K_BLOCK=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
    )
    return weights, ids


if triton is not None:

    @triton.jit
    def _top_k(values, cols, slots, K: tl.constexpr, BLOCK: tl.constexpr):
        """The K largest of `values` (over `cols`), in order, the lowest index on a tie: their
        values and indices, each [K_BLOCK] (`slots`)."""
        top = tl.zeros(slots.shape, tl.float32)
        idx = tl.zeros(slots.shape, tl.int64)
        for k in tl.static_range(K):
            best = tl.max(values, 0)
            at = tl.min(tl.where(values == best, cols, BLOCK), 0)
            top = tl.where(slots == k, best, top)
            idx = tl.where(slots == k, at.to(tl.int64), idx)
            values = tl.where(cols == at, float("-inf"), values)
        return top, idx

    @triton.jit
    def _sigmoid_route_kernel(
        LOGITS,
        BIAS,
        WEIGHTS,
        IDS,
        e,
        group_size,
        scaling,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
        K_BLOCK: tl.constexpr,
        GROUPS: tl.constexpr,
        G_BLOCK: tl.constexpr,
        TOPK_GROUPS: tl.constexpr,
        TG_BLOCK: tl.constexpr,
        NORMALIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < e
        x = tl.load(LOGITS + row * e + cols, mask=ok, other=0.0)
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = score + tl.load(BIAS + cols, mask=ok, other=0.0)
        choice = tl.where(ok, choice, float("-inf"))
        if GROUPS > 1:  # only the experts of the TOPK_GROUPS groups best by their best two
            g = tl.arange(0, G_BLOCK)
            member = ((cols[None, :] // group_size) == g[:, None]) & ok[None, :]  # [G, E]
            values = tl.where(member, choice[None, :], float("-inf"))
            first = tl.max(values, 1)
            at = tl.min(tl.where(values == first[:, None], cols[None, :], BLOCK), 1)
            second = tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), values), 1)
            group_score = tl.where(g < GROUPS, first + second, float("-inf"))
            _, best = _top_k(group_score, g, tl.arange(0, TG_BLOCK), TOPK_GROUPS, G_BLOCK)
            best = tl.where(tl.arange(0, TG_BLOCK) < TOPK_GROUPS, best, -1)
            kept = tl.sum((g[:, None] == best[None, :]).to(tl.int32), 1) > 0  # [G]
            keep = tl.sum((member & kept[:, None]).to(tl.int32), 0) > 0  # [E]
            choice = tl.where(keep, choice, float("-inf"))
        slots = tl.arange(0, K_BLOCK)
        _, idx = _top_k(choice, cols, slots, K, BLOCK)
        picked = tl.sum(tl.where(cols[None, :] == idx[:, None], score[None, :], 0.0), 1)
        picked = tl.where(slots < K, picked, 0.0)
        if NORMALIZE:
            picked = picked / (tl.sum(picked, 0) + 1e-20)
        tl.store(WEIGHTS + row * K + slots, picked * scaling, mask=slots < K)
        tl.store(IDS + row * K + slots, idx, mask=slots < K)

    @triton.jit
    def _route_kernel(
        LOGITS,
        WEIGHTS,
        IDS,
        e,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
        K_BLOCK: tl.constexpr,
        RENORMALIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(LOGITS + row * e + cols, mask=cols < e, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        slots = tl.arange(0, K_BLOCK)
        top, idx = _top_k(p, cols, slots, K, BLOCK)
        if RENORMALIZE:
            top = top / tl.sum(tl.where(slots < K, top, 0.0), 0)
        tl.store(WEIGHTS + row * K + slots, top.to(WEIGHTS.dtype.element_ty), mask=slots < K)
        tl.store(IDS + row * K + slots, idx, mask=slots < K)

    @triton.jit
    def _sqrtsoftplus_kernel(
        LOGITS,
        BIAS,
        WEIGHTS,
        IDS,
        e,
        scaling,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
        K_BLOCK: tl.constexpr,
        GIVEN: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        row = tl.program_id(0)
        dt = WEIGHTS.dtype.element_ty
        cols = tl.arange(0, BLOCK)
        x = tl.load(LOGITS + row * e + cols, mask=cols < e, other=0.0).to(tl.float32)
        # softplus as torch's (x past 20 is itself; log1p(exp(x)), a tiny exp taken as is)
        ex = tl.exp(tl.minimum(x, 20.0))
        soft = tl.where(x > 20.0, x, tl.where(ex < 1e-6, ex, tl.log(1.0 + ex)))
        score = tl.sqrt(soft.to(dt).to(tl.float32)).to(dt).to(tl.float32)
        slots = tl.arange(0, K_BLOCK)
        if GIVEN:
            idx = tl.load(IDS + row * K + slots, mask=slots < K, other=0).to(tl.int64)
        else:
            choice = score
            if HAS_BIAS:
                choice = choice + tl.load(BIAS + cols, mask=cols < e, other=0.0).to(tl.float32)
            choice = tl.where(cols < e, choice, float("-inf"))
            _, idx = _top_k(choice, cols, slots, K, BLOCK)
        picked = tl.sum(tl.where(cols[None, :] == idx[:, None], score[None, :], 0.0), 1)
        picked = tl.where(slots < K, picked, 0.0)
        total = tl.sum(picked, 0).to(dt).to(tl.float32)
        total = (total + 1e-20).to(dt).to(tl.float32)
        w = (picked / total).to(dt).to(tl.float32)
        w = (w * scaling).to(dt)
        tl.store(WEIGHTS + row * K + slots, w, mask=slots < K)
        if not GIVEN:
            tl.store(IDS + row * K + slots, idx, mask=slots < K)

    @triton.jit
    def _rms_norm_kernel(
        X,
        D,
        S,
        W,
        OUT,
        n,
        heads,
        row_stride,
        head_stride,
        eps,
        BLOCK: tl.constexpr,
        ZERO_CENTERED: tl.constexpr,
        SCALE_FP32: tl.constexpr,
        HAS_DELTA: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        at = (row // heads) * row_stride + (row % heads) * head_stride
        x = tl.load(X + at + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_DELTA:  # s = x + delta, rounded to the dtype as torch's add, then normed
            d = tl.load(D + row * n + cols, mask=ok, other=0.0).to(tl.float32)
            x = (x + d).to(OUT.dtype.element_ty)
            tl.store(S + row * n + cols, x, mask=ok)
            x = x.to(tl.float32)
        h = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if ZERO_CENTERED:  # (constexpr branches: compiled out)
            y = h * (1.0 + w)
        elif SCALE_FP32:
            y = w * h
        else:
            # weight * h.to(dtype): the normalised row is rounded first, then scaled.
            y = w * h.to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * n + cols, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotary_kernel(
        X,
        COS,
        SIN,
        OUT,
        stride_t,
        stride_h,
        stride_c,
        d,
        half,
        BLOCK: tl.constexpr,
        PAIRS: tl.constexpr,
    ):
        t = tl.program_id(0)
        head = tl.program_id(1)
        base = t * stride_t + head * stride_h
        dt = OUT.dtype.element_ty
        i = tl.arange(0, BLOCK)
        ok = i < half
        if PAIRS:  # DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...: evens, then odds
            x1 = tl.load(X + base + 2 * i, mask=ok, other=0.0)
            x2 = tl.load(X + base + 2 * i + 1, mask=ok, other=0.0)
        else:
            x1 = tl.load(X + base + i, mask=ok, other=0.0)
            x2 = tl.load(X + base + half + i, mask=ok, other=0.0)
        o = (t * tl.num_programs(1) + head) * d  # (OUT is contiguous)
        c1 = tl.load(COS + t * stride_c + i, mask=ok, other=0.0)
        c2 = tl.load(COS + t * stride_c + half + i, mask=ok, other=0.0)
        s1 = tl.load(SIN + t * stride_c + i, mask=ok, other=0.0)
        s2 = tl.load(SIN + t * stride_c + half + i, mask=ok, other=0.0)
        # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them.
        a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32)
        b1 = (-x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)
        a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32)
        b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)
        tl.store(OUT + o + i, (a1 + b1).to(dt), mask=ok)
        tl.store(OUT + o + half + i, (a2 + b2).to(dt), mask=ok)
        rest = i < d - 2 * half  # partial rotary: the dimensions past the rotated ones
        tail = tl.load(X + base + 2 * half + i, mask=rest, other=0.0)
        tl.store(OUT + o + 2 * half + i, tail, mask=rest)
