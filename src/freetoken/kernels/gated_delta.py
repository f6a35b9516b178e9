"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5; Kimi Delta Attention: Kimi-Linear)
on the GPU: one decode step in one kernel launch, and prompts through flash-linear-attention's
chunked kernels where installed (gated DeltaNet's only).

The torch step (layers/gated_deltanet.py: `_prepare`, `recurrent_gated_delta_rule`, the state
pool's gather and scatter) is some 35 launches a layer: head expansion, casts, two L2 norms, the
decay and step size, and each product and sum of the rule. At batch 1 a decode step's kernels
are tiny and their count sets its time (48 layers of Qwen3.5-35B-A3B, 40 of them linear). Here a
program takes one sequence, value head and block of value columns: it reads the sequence's
state block where it lies in the pool (by its slot), computes the decay exp(g) and step size
beta from the raw projections (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b),
rounded to b's dtype as torch's sigmoid leaves it), the L2-normalised q (scaled by dk^-0.5) and
k of its key head, applies the rule and writes the state back in place:

    S <- S exp(g);  delta = (v - k S) beta;  S <- S + k delta^T;  out = q S

in fp32, the reference's order of operations; its sums run in a tree where torch's run in
another (the last fp32 bit may differ). The torch code stays the CPU path and the reference.
KDA's decay is per key channel (a [dk] and dt_bias [dk] a head, `PER_CHANNEL`): exp(g) scales
each row of S by its own factor; everything else is the same step.

Prompts (`chunked`): fla-core's `chunk_gated_delta_rule` (optional: `pip install fla-core`),
for half-precision models on CUDA: the UT-transform chunks the torch rule computes as batched
matmuls and a Python loop over chunks, fused into Triton kernels that keep the inputs' dtype
where the torch rule works in fp32 (fp32 models keep the torch rule, the reference).
settings.FLA (=0) turns it off.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from freetoken import settings

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_V = 32  # value columns a program: [dk, 32] fp32 of the state in registers
L2_EPS = 1e-6  # (layers/gated_deltanet.py's _l2norm)
SOFTPLUS_THRESHOLD = 20.0  # torch's: softplus(x) = x above it


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


@functools.cache
def _fla_chunk():
    """fla's chunked rule, or None where fla-core is not installed or is turned off (imported
    on first use: it is seconds of imports a start that serves no prompt yet need not pay)."""
    if not settings.fla() or importlib.util.find_spec("fla") is None:
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def chunked_available(x: torch.Tensor) -> bool:
    """Whether `chunked` takes a prompt of x's dtype and device."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _fla_chunk() is not None


def chunked(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt tokens of n sequences: q, k [n, T, Hk, dk] and v [n, T, Hv, dv] (the conv's
    output, in the model's dtype), g (log decay) and beta [n, T, Hv], state [n, Hv, dk, dv]
    fp32. q and k are L2-normalised in the kernel and q scaled by dk^-0.5, as `_prepare` does;
    each key head serves Hv / Hk consecutive value heads. Returns (out [n, T, Hv, dv] fp32, the
    final states fp32)."""
    out, final = _fla_chunk()(
        q,
        k,
        v,
        g,
        beta,
        scale=q.shape[-1] ** -0.5,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out.float(), final.float()


def recurrent_step(q, k, v, a, b, a_log, dt_bias, ssm, slots) -> torch.Tensor:
    """One token of each of n sequences: q, k [n, Hk, dk], v [n, Hv, dv] (the conv's output),
    a, b [n, Hv] (the decay and step-size projections), a_log and dt_bias [Hv]; ssm [slots, Hv,
    dk, dv] fp32, the layer's states, advanced in place at `slots` [n]. KDA: a [n, Hv, dk] and
    dt_bias [Hv * dk], a decay per key channel (Hk = Hv). Returns out [n, Hv, dv] fp32. Each
    input is read where it lies, by its row stride (q, k and v are column ranges of the conv's
    output rows): only a row's heads must be packed."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    q, k, v, a, b = (_packed_rows(t) for t in (q, k, v, a, b))
    out = torch.empty(n, hv, dv, dtype=torch.float32, device=v.device)
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (n, hv, triton.cdiv(dv, block_v))
    _step_kernel[grid](
        q,
        k,
        v,
        a,
        b,
        a_log,
        dt_bias,
        ssm,
        slots,
        out,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        a.stride(0),
        b.stride(0),
        ssm.stride(0),
        ssm.stride(1),
        ssm.stride(2),
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        SCALE=dk**-0.5,
        EPS=L2_EPS,
        THRESHOLD=SOFTPLUS_THRESHOLD,
        PER_CHANNEL=a.dim() == 3,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        num_warps=4,
    )
    return out


def _packed_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself where each row's values (all but the first dimension) are packed, whatever the
    row stride; else a packed copy."""
    inner = 1
    for i in range(t.dim() - 1, 0, -1):
        if t.shape[i] != 1 and t.stride(i) != inner:
            return t.contiguous()
        inner *= t.shape[i]
    return t


if triton is not None:

    @triton.jit
    def _step_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        a_ptr,
        b_ptr,
        a_log_ptr,
        dt_bias_ptr,
        ssm_ptr,
        slots_ptr,
        out_ptr,
        stride_q,
        stride_k,
        stride_v,
        stride_a,
        stride_b,
        stride_ss,
        stride_sh,
        stride_sk,
        HK: tl.constexpr,
        HV: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        SCALE: tl.constexpr,
        EPS: tl.constexpr,
        THRESHOLD: tl.constexpr,
        PER_CHANNEL: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        i = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        hk = h // (HV // HK)  # (each key head serves HV / HK consecutive value heads)
        keys = tl.arange(0, BLOCK_K)
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        k_ok, v_ok = keys < DK, cols < DV
        row = i.to(tl.int64)
        q = tl.load(q_ptr + row * stride_q + hk * DK + keys, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k + hk * DK + keys, mask=k_ok, other=0.0).to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + EPS) * SCALE
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + EPS)
        v = tl.load(v_ptr + row * stride_v + h * DV + cols, mask=v_ok, other=0.0).to(tl.float32)
        # decay and step size, as the layer computes them (beta rounded to b's dtype)
        if PER_CHANNEL:  # (KDA: one per key channel, [BLOCK_K])
            at = h * DK + keys
            a = tl.load(a_ptr + row * stride_a + at, mask=k_ok, other=0.0).to(tl.float32)
            x = a + tl.load(dt_bias_ptr + at, mask=k_ok, other=0.0).to(tl.float32)
        else:
            a = tl.load(a_ptr + row * stride_a + h).to(tl.float32)
            x = a + tl.load(dt_bias_ptr + h).to(tl.float32)
        raw_b = tl.load(b_ptr + row * stride_b + h)
        e = tl.exp(x)  # softplus: log1p(e), by its series where 1 + e would round e away
        softplus = tl.where(x > THRESHOLD, x, tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e)))
        g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
        beta = (1.0 / (1.0 + tl.exp(-raw_b.to(tl.float32)))).to(raw_b.dtype).to(tl.float32)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        s_ptrs = (
            ssm_ptr + slot * stride_ss + h * stride_sh + keys[:, None] * stride_sk + cols[None, :]
        )
        mask = k_ok[:, None] & v_ok[None, :]
        if PER_CHANNEL:
            state = tl.load(s_ptrs, mask=mask, other=0.0) * tl.exp(g)[:, None]
        else:
            state = tl.load(s_ptrs, mask=mask, other=0.0) * tl.exp(g)
        predicted = tl.sum(state * k[:, None], 0)  # what S already returns for k
        delta = (v - predicted) * beta
        state = state + k[:, None] * delta[None, :]
        tl.store(s_ptrs, state, mask=mask)
        out = tl.sum(state * q[:, None], 0)
        tl.store(out_ptr + (i * HV + h) * DV + cols, out, mask=v_ok)
