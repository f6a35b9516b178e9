"""The host's own time per MoE layer step, by phase, on any machine: the decisions each strategy
makes per layer (lookup and split, the CPU job's start, victims and fills, the policy's update)
with the cache tier placed on the CPU. Experts have Qwen3-30B-A3B's hidden size and routing
(128 experts, top-8) but a tiny intermediate size, so their math costs little and the
bookkeeping shows. On a GPU these phases come on top of the round trip and the transfers
(`decode_offload.py` prints the same phases there); this catches a slower host path before
device time is spent on it. One difference: here `fill` includes the CPU tier's copies, made
with torch, where a GPU's fills are queued by one native call and run on the copy engine.

    python benchmarks/host_step.py --layers 16 --steps 100 --out host.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from decode_offload import qwen3_30b_a3b, report

from freetoken.config import MoEOptions
from freetoken.models.families import family_for
from freetoken.moe.runtime import build_runtime
from freetoken.moe.store import HostExpertStore

PHASES = ("plan", "cpu_start", "fill", "policy")


def expert_store(layers: int, experts: int, top_k: int, hidden: int, inter: int):
    """The expert pool of `decode_offload.py`'s model shape, resized as asked."""
    raw = qwen3_30b_a3b(layers)
    raw.update(
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
    )
    store = HostExpertStore.for_model(family_for(raw).parse_config(raw), torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for bank in (store.w_gate_up, store.w_down):
        bank.copy_(torch.randn(bank.shape, generator=gen) * 0.05)
    return store


def measure(store, strategy: str, slots: int, batch: int, top_k: int, steps: int, warmup: int):
    """Mean host time per layer step of each phase (us) and the hit rate, over `steps` decode
    steps of uniform random routing after `warmup`."""
    # the host's decisions (device control's take no host time on a GPU: its twin here would
    # time torch's CPU ops instead)
    options = MoEOptions(strategy, str(slots), device_control=False)
    rt = build_runtime(store, torch.device("cpu"), options)
    gen = torch.Generator().manual_seed(1)
    E, H = store.num_experts, store.shape.hidden
    x = torch.randn(batch, H, generator=gen).to(torch.bfloat16)

    def run(n: int) -> None:
        for _ in range(n):
            for layer in range(store.num_layers):
                ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(batch)])
                weights = torch.rand(batch, top_k, generator=gen).to(torch.bfloat16)
                rt(layer, x, ids, weights)

    run(warmup)
    rt.telemetry.reset()
    start = time.perf_counter()
    run(steps)
    seconds = time.perf_counter() - start
    total = rt.telemetry.total()
    calls = max(1, total.calls)
    # (getattr: commits before cpu_start_s counted the CPU job's start in plan_s)
    row = {p: getattr(total, f"{p}_s", 0.0) / calls * 1e6 for p in PHASES}
    row["layer step"] = seconds / calls * 1e6
    row["hit rate"] = total.hits / max(1, total.accesses)
    if rt.cpu is not None:
        rt.cpu.shutdown()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=16)
    ap.add_argument("--cache", type=float, default=0.37, help="share of the pool in the cache")
    ap.add_argument("--strategy", action="append")
    ap.add_argument("--batch", action="append", type=int)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    # As beside a GPU (build_runtime does the same there): torch's own CPU work is small ops,
    # on one thread. Its OpenMP pool would otherwise spin on the cores after each of the tier's
    # expert products and preempt the CPU expert team (600 us per job start on 2 cores).
    torch.set_num_threads(1)
    store = expert_store(args.layers, args.experts, args.top_k, args.hidden, args.intermediate)
    slots = max(1, int(store.num_pairs * args.cache))
    lines = [
        f"# host_step: {args.layers} layers x {args.experts} experts, top-{args.top_k}, hidden "
        f"{args.hidden}, cache {slots} slots ({args.cache:.0%}), torch {torch.__version__}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.steps} decode steps "
        f"after {args.warmup}; uniform random routing; the cache tier on the CPU",
        "- us per layer step; `layer step`: the whole call, the (tiny) expert math included",
        "",
        "| strategy | batch | " + " | ".join(PHASES) + " | layer step | hit rate |",
        "|---|---|" + "---|" * (len(PHASES) + 2),
    ]
    for strategy in args.strategy or ["static", "hybrid", "offload", "cpu"]:
        for batch in args.batch or [1, 4]:
            row = measure(store, strategy, slots, batch, args.top_k, args.steps, args.warmup)
            cells = " | ".join(f"{row[p]:.0f}" for p in (*PHASES, "layer step"))
            lines.append(f"| {strategy} | {batch} | {cells} | {row['hit rate']:.3f} |")
            print(lines[-1], flush=True)
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
