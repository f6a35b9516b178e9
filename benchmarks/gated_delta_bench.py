"""The gated delta rule (Qwen3-Next, Qwen3.5) on the GPU: freetoken's own paths beside
flash-linear-attention's Triton kernels (`fla-core` on PyPI), in time and in error against the
fp32 reference (layers/gated_deltanet.py's recurrent rule, in float64 here).

    python benchmarks/gated_delta_bench.py --tokens 1400 8192 --batch 1 4 --out gdn.md

Prefill: `_prepare` + `chunk_gated_delta_rule` (the torch chunked form, freetoken's prefill)
against fla's `chunk_gated_delta_rule` (q/k L2-normalised in the kernel, bf16 inputs as a model
gives them). Decode: `kernels/gated_delta.recurrent_step` (one launch: gates, norms and rule)
against fla's `fused_recurrent_gated_delta_rule` with its gate in the kernel. Shapes: Qwen3-Next's
linear attention (16 key heads, 32 value heads, 128 wide). Needs CUDA; fla is optional (its rows
are left out without it).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from freetoken.kernels import gated_delta
from freetoken.layers.gated_deltanet import _prepare, chunk_gated_delta_rule

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
except ImportError:
    fla_chunk = fla_recurrent = None

HK, HV, D = 16, 32, 128


def timed(fn, reps: int = 10) -> float:
    """Median seconds of fn() on the device, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def raw_inputs(batch: int, tokens: int, gen: torch.Generator):
    """A layer's inputs as the model has them (bf16), and its gate parameters."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = randn(batch, tokens, HK, D).bfloat16(), randn(batch, tokens, HK, D).bfloat16()
    v = randn(batch, tokens, HV, D).bfloat16()
    a, b = randn(batch, tokens, HV).bfloat16(), randn(batch, tokens, HV).bfloat16()
    a_log, dt_bias = randn(HV).abs().log() - 2, randn(HV) * 0.5
    return q, k, v, a, b, a_log, dt_bias


def gates(a, b, a_log, dt_bias):
    """g (log decay) and beta as the layer computes them, fp32."""
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    return g, b.float().sigmoid()


def reference(q, k, v, g, beta, state):
    """The recurrence in float64, token by token: what each fp32 path approximates."""
    groups = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).double() for t in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = state.double()
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t][..., None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t][..., None] * delta[..., None, :]
        out[:, :, t] = (state * q[:, :, t][..., None]).sum(-2)
    return out.transpose(1, 2), state


def prefill_rows(batch: int, tokens: int, check: bool) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, a, b, a_log, dt_bias = raw_inputs(batch, tokens, gen)
    g, beta = gates(a, b, a_log, dt_bias)
    state = torch.zeros(batch, HV, D, D, device="cuda")

    def ours():
        out, final = chunk_gated_delta_rule(*_prepare(q, k, v, g, beta), state)
        return out.transpose(1, 2), final

    runs = {"freetoken (torch chunked)": ours}
    if fla_chunk is not None:
        runs["fla chunk_gated_delta_rule"] = lambda: fla_chunk(
            q,
            k,
            v,
            g,
            beta,
            scale=D**-0.5,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    want = reference(q, k, v, g, beta, state)[0] if check else None
    rows = []
    for name, fn in runs.items():
        seconds = timed(fn)
        err = "n/a"
        if want is not None:
            err = f"{(fn()[0].double() - want).abs().max().item():.1e}"
        rows.append(
            f"| prefill | {batch} | {tokens} | {name} | {seconds * 1e3:.2f} | "
            f"{batch * tokens / seconds:,.0f} | {err} |"
        )
        print(rows[-1], flush=True)
    return rows


def decode_rows(batch: int) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, a, b, a_log, dt_bias = raw_inputs(batch, 1, gen)
    pool = torch.randn(batch + 3, HV, D, D, generator=gen, device="cuda") * 0.01
    slots = torch.arange(batch, device="cuda") + 2
    g, beta = gates(a, b, a_log, dt_bias)
    want = reference(q, k, v, g, beta, pool[slots])[0][:, 0]

    def ours():
        return gated_delta.recurrent_step(
            q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], a_log, dt_bias, pool.clone(), slots
        )

    def ours_in_place():  # (the timed call: the clone above is for the error's fixed start)
        return gated_delta.recurrent_step(
            q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], a_log, dt_bias, pool, slots
        )

    runs = {"freetoken recurrent_step": (ours_in_place, ours)}
    if fla_recurrent is not None:
        state = pool[slots].clone()

        def theirs():
            out, _ = fla_recurrent(
                q,
                k,
                v,
                g=a.float(),
                beta=b.float(),
                scale=D**-0.5,
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                A_log=a_log,
                dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True,
            )
            return out[:, 0]

        runs["fla fused_recurrent (gate in kernel)"] = (theirs, theirs)
    rows = []
    for name, (fn, checked) in runs.items():
        # (the error first: the timed calls advance the pool's states in place)
        err = f"{(checked().double() - want).abs().max().item():.1e}"
        seconds = timed(fn, reps=50)
        rows.append(
            f"| decode | {batch} | 1 | {name} | {seconds * 1e3:.3f} | "
            f"{batch / seconds:,.0f} | {err} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1400, 8192])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--check-up-to",
        type=int,
        default=2048,
        help="prefill lengths checked against the float64 rule",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    head = [
        "| phase | batch | tokens | kernel | ms a layer | tokens/s | max abs error |",
        "|---|---|---|---|---|---|---|",
    ]
    print(*head, sep="\n", flush=True)
    rows = []
    for batch in args.batch:
        rows += decode_rows(batch)
        for tokens in args.tokens:
            rows += prefill_rows(batch, tokens, tokens <= args.check_up_to)
    if args.out:
        lines = [
            "# The gated delta rule on the GPU: freetoken and flash-linear-attention",
            "",
            f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
            f"fla-core {getattr(sys.modules.get('fla'), '__version__', 'absent')}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- shapes: {HK} key heads, {HV} value heads, {D} wide (Qwen3-Next's linear "
            "attention); one layer; inputs bf16; error: max abs against the rule in float64",
            "",
            *head,
            *rows,
        ]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
