"""DeepSeek-V4's hyper-connections in a few launches: the mixes in one (from the projection of
the normed streams, `pre` (sigmoid), `post` (2 x sigmoid) and `comb` (softmax, then
Sinkhorn-Knopp to a doubly stochastic matrix) for every token), and one each for the streams'
norm, their collapse by `pre` and their merge with a block's output, after torch's matmul of
the streams by `comb`, kept for its rounding (layers/hyper_connections.py is the torch
definition of those three, and the CPU path; about 25 launches a layer there).

In torch that is about 120 launches a block (each Sinkhorn iteration sums and divides rows,
then columns, of a 4 x 4 matrix), twice a layer: half of a decode step's kernels, each a
microsecond or two of a GPU that has nothing else to do at batch 1. Here one program per token
holds its n x n matrix in registers through every iteration. `hc_mix_reference` is the torch
definition (and the CPU path); the kernel computes the same operations in the same order, in
fp32, so the two agree to float rounding (fused multiply-adds aside).
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


def hc_mix_reference(mixes, base, scale, n: int, iters: int, hc_eps: float):
    """mixes [T, (2 + n) n] fp32, base [(2 + n) n], scale [3] -> pre [T, n], post [T, n],
    comb [T, n, n] (each row of comb, and each column, summing to ~1)."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def kernel_takes(mixes: torch.Tensor, n: int) -> bool:
    """Whether the kernel runs these mixes: on CUDA, with Triton, n a power of two."""
    return triton is not None and mixes.is_cuda and n >= 1 and n & (n - 1) == 0


# Whether the norm, collapse and merge kernels run on the streams: on CUDA, with Triton
# (norm_rope's test, under a name of its own so that tests switch these kernels apart).
streams_kernel_takes = norm_rope.available


def hc_mix(mixes, base, scale, n: int, iters: int, hc_eps: float):
    """`hc_mix_reference`'s results, in one launch where `kernel_takes`."""
    if not kernel_takes(mixes, n):
        return hc_mix_reference(mixes, base, scale, n, iters, hc_eps)
    return launch_hc_mix(mixes, base, scale, n, iters, hc_eps)


def launch_hc_mix(mixes, base, scale, n: int, iters: int, hc_eps: float):
    """The kernel on any tensors Triton can run (CPU ones under its interpreter: the tests)."""
    mixes = mixes.float().contiguous()
    t = mixes.shape[0]
    pre = mixes.new_empty(t, n)
    post = mixes.new_empty(t, n)
    comb = mixes.new_empty(t, n, n)
    if t:
        _hc_mix_kernel[(t,)](
            mixes,
            base.float().contiguous(),
            scale.float().contiguous(),
            pre,
            post,
            comb,
            hc_eps,
            N=n,
            ITERS=iters,
        )
    return pre, post, comb


_BLOCK = 1024  # hidden values a program of collapse and merge takes


def hc_normed(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, n, H] flattened to [T, n H] in fp32 and normed without a weight."""
    t = streams.shape[0]
    flat = streams.reshape(t, -1)
    out = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    if t:
        _normed_kernel[(t,)](flat.contiguous(), out, eps, WIDTH=flat.shape[1], BLOCK=_BLOCK * 4)
    return out


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j pre[t, j] streams[t, j] in fp32, cast to the streams' dtype: [T, H]."""
    t, n, hidden = streams.shape
    out = torch.empty(t, hidden, dtype=streams.dtype, device=streams.device)
    if t:
        grid = (t, triton.cdiv(hidden, _BLOCK))
        _collapse_kernel[grid](
            pre.float().contiguous(), streams.contiguous(), out, hidden, N=n, BLOCK=_BLOCK
        )
    return out


def hc_merge(streams, post, comb, out) -> torch.Tensor:
    """`HyperConnection.merge`: post[t, k] out[t] + sum_j comb[t, j, k] streams[t, j], with
    post and comb cast to the streams' dtype and each result rounded as torch rounds it.

    On CUDA, DeepSeek-V4's bf16 decode left transformers' tokens in 7 of 10 prompts while this
    merge ran as a kernel, and kept them bitwise with it in torch (benchmarks/bf16_drift.py;
    benchmarks/results/2026-12-06-v4-decode-h100.md): the compiler had fused the rounded
    product and the sum into one bf16 fma, rounding once where torch rounds twice, and a few
    values came out one bf16 step apart. The kernel now rounds by integer arithmetic, which
    nothing fuses (tests/test_hyper_mix.py checks the compiled code), and the streams' mix by
    `comb` stays torch's batched matmul, the call transformers makes, for its sum order."""
    t, n, hidden = streams.shape
    mixed = torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams)
    merged = torch.empty_like(streams)
    if t:
        grid = (t, triton.cdiv(hidden, _BLOCK))
        _merge_kernel[grid](
            mixed, post.float().contiguous(), out.contiguous(), merged, hidden, N=n, BLOCK=_BLOCK
        )
    return merged


if triton is not None:

    @triton.jit
    def _hc_mix_kernel(
        mixes,
        base,
        scale,
        pre_out,
        post_out,
        comb_out,
        hc_eps,
        N: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        row = mixes + t * (2 + N) * N
        i = tl.arange(0, N)
        cells = i[:, None] * N + i[None, :]  # [row, column] of the n x n matrix
        pre = tl.sigmoid(tl.load(row + i) * tl.load(scale) + tl.load(base + i)) + hc_eps
        post = 2 * tl.sigmoid(tl.load(row + N + i) * tl.load(scale + 1) + tl.load(base + N + i))
        comb = tl.load(row + 2 * N + cells) * tl.load(scale + 2) + tl.load(base + 2 * N + cells)
        e = tl.exp(comb - tl.max(comb, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(pre_out + t * N + i, pre)
        tl.store(post_out + t * N + i, post)
        tl.store(comb_out + t * N * N + cells, comb)

    @triton.jit
    def _normed_kernel(X, OUT, eps, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], tl.float32)
        for c0 in tl.static_range(0, WIDTH, BLOCK):
            x = tl.load(X + t * WIDTH + c0 + i, mask=c0 + i < WIDTH, other=0.0).to(tl.float32)
            total += x * x
        r = tl.rsqrt(tl.sum(total, 0) / WIDTH + eps)
        for c0 in tl.static_range(0, WIDTH, BLOCK):
            ok = c0 + i < WIDTH
            x = tl.load(X + t * WIDTH + c0 + i, mask=ok, other=0.0).to(tl.float32)
            tl.store(OUT + t * WIDTH + c0 + i, x * r, mask=ok)

    @triton.jit
    def _collapse_kernel(PRE, S, OUT, hidden, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = h < hidden
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(N):
            s = tl.load(S + (t * N + j) * hidden + h, mask=ok, other=0.0).to(tl.float32)
            acc += tl.load(PRE + t * N + j) * s
        tl.store(OUT + t * hidden + h, acc.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rounded_to_bf16(x):
        """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32, by integer
        arithmetic: written as casts, the compiler fuses a rounded product and the sum after
        it into one bf16 fma (`fma.rn.bf16`), which rounds once where torch rounds twice."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _rounded(x, dt: tl.constexpr):
        """fp32 x rounded to the streams' dtype `dt`, kept in fp32."""
        if dt == tl.bfloat16:
            return _rounded_to_bf16(x)
        return x.to(dt).to(tl.float32)

    @triton.jit
    def _merge_kernel(MIXED, POST, X, OUT, hidden, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = h < hidden
        dt: tl.constexpr = OUT.dtype.element_ty
        x = tl.load(X + t * hidden + h, mask=ok, other=0.0).to(tl.float32)
        for k in tl.static_range(N):
            post = _rounded(tl.load(POST + t * N + k), dt)
            spread = _rounded(post * x, dt)  # torch's product in the streams' dtype, then its sum
            mixed = tl.load(MIXED + (t * N + k) * hidden + h, mask=ok, other=0.0).to(tl.float32)
            value = (spread + mixed).to(dt)
            tl.store(OUT + (t * N + k) * hidden + h, value, mask=ok)
