"""The hybrid decode bound of an MoE made by `ft checkpoint moe-from-dense`, from its routing
alone (CPU, no GPU): the routers fitted as the converter fits them, a held-out text routed
through them, that trace replayed through the expert cache at the given capacities (the
runtime's policies, LRU, the static and Belady oracles), and what the misses cost per token at
the given PCIe fill and CPU expert bandwidths, against a target speed.

    python benchmarks/moe_cache_bound.py DENSE.gguf [--tokens 1024] [--fused-ms 2.72]
        [--target-tok-s 360] [--pcie-gbs 50] [--cpu-gbs 50]

A token's hybrid step is at least its fused step (every expert resident) plus the misses'
bytes over the fill and CPU bandwidths together (each miss either filled or computed on the
CPU where it lies, both in parallel at best); the replay fills every miss, so its hit rate is
an upper bound on the split's (which leaves the CPU's misses uncached).
"""

from __future__ import annotations

import argparse
import inspect
import json.decoder
import textwrap
from pathlib import Path

import numpy as np

from freetoken.models import moe_from_dense
from freetoken.moe.policy import make_policy
from freetoken.moe.trace import Trace, belady, capacity_slots, replay, static_oracle


def expert_bytes(dense: Path) -> float:
    """Mean bytes of one expert (a layer's ffn_gate, ffn_up and ffn_down as stored)."""
    import gguf

    reader = gguf.GGUFReader(str(dense))
    total, layers = 0, set()
    for t in reader.tensors:
        if t.name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
            total += int(t.n_bytes)
            layers.add(t.name.split(".")[1])
    return total / len(layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dense", type=Path)
    ap.add_argument("--tokens", type=int, default=1024, help="held-out tokens routed")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacities", default="0.25,0.5,0.75")
    ap.add_argument("--policies", default="reuse-density,lru")
    ap.add_argument("--fused-ms", type=float, default=2.72, help="fused step, ms a token")
    ap.add_argument("--target-tok-s", type=float, default=360.0)
    ap.add_argument("--pcie-gbs", type=float, default=50.0, help="fill bandwidth, GB/s")
    ap.add_argument("--cpu-gbs", type=float, default=50.0, help="CPU expert bandwidth, GB/s")
    args = ap.parse_args()

    # routers as the converter fits them (its text, tokens and seed), then a held-out text
    _, fit_inputs = moe_from_dense.mlp_inputs(args.dense, moe_from_dense.default_text(),
                                              moe_from_dense.FIT_TOKENS)  # fmt: skip
    routing = moe_from_dense.fit_routers(fit_inputs, args.experts, args.top_k)
    del fit_inputs
    model, tokenizer = moe_from_dense.reference_model(args.dense)
    held_out = (Path(inspect.getsourcefile(json.decoder)).read_text()
                + Path(inspect.getsourcefile(textwrap)).read_text())  # fmt: skip
    ids = tokenizer(held_out, add_special_tokens=False)["input_ids"][: args.tokens]
    inputs = moe_from_dense.layer_inputs(model, ids)
    experts = np.stack([(x @ r.T).topk(args.top_k, dim=-1).indices.numpy()
                        for x, r in zip(inputs, routing.routers, strict=True)], axis=1)  # fmt: skip
    trace = Trace(len(inputs), args.experts, args.top_k, (experts.astype(np.int64),))

    per_expert = expert_bytes(args.dense)
    routes = trace.num_layers * args.top_k
    budget_ms = 1e3 / args.target_tok_s
    rate = (args.pcie_gbs + args.cpu_gbs) * 1e9
    print(f"{args.dense.name}: {trace.num_layers} layers x {args.experts} experts, top-"
          f"{args.top_k}, {len(ids)} held-out tokens; {per_expert / 1e6:.2f} MB an expert; "
          f"misses at {rate / 1e9:.0f} GB/s (fill + CPU); fused step {args.fused_ms} ms; "
          f"target {args.target_tok_s} tok/s = {budget_ms:.2f} ms")  # fmt: skip
    print(
        "\n| cached | policy | hit rate | misses a token | miss ms a token (floor) | "
        "bound tok/s | misses a token the target allows at this fused step |"
    )
    print("|---|---|---|---|---|---|---|")
    allowed = max(0.0, (budget_ms - args.fused_ms) * 1e-3 * rate / per_expert)
    for frac in (float(c) for c in args.capacities.split(",")):
        slots = capacity_slots(trace, frac)
        results = [replay(trace, slots, make_policy(p)) for p in args.policies.split(",")]
        results += [static_oracle(trace, slots), belady(trace, slots)]
        for r in results:
            misses = r.misses / trace.num_tokens
            miss_ms = misses * per_expert / rate * 1e3
            print(f"| {frac:.0%} ({slots} slots) | {r.policy} | {r.hit_rate:.3f} | "
                  f"{misses:.2f} of {routes} | {miss_ms:.2f} | "
                  f"{1e3 / (args.fused_ms + miss_ms):.0f} | {allowed:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
