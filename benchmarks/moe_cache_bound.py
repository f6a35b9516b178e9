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
import json
import json.decoder
import textwrap
from pathlib import Path

import numpy as np

from freetoken.models import moe_from_dense
from freetoken.moe.policy import make_policy
from freetoken.moe.trace import (
    Trace,
    belady,
    capacity_slots,
    load_trace,
    replay,
    static_oracle,
)


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


def split_replay(trace: Trace, slots: int, policy_name: str, fill: float) -> float:
    """The hit rate when only q = round(m x fill) of a layer's m misses are filled (those of
    the highest pair scores), the rest run on the CPU and left uncached, as hybrid's split
    does (its lo = 1: at least one fill); `replay`'s loop otherwise."""
    import torch

    policy = make_policy(policy_name)
    L, E = trace.num_layers, trace.num_experts
    flat, offsets = trace.step_pairs()
    pairs_all = torch.from_numpy(flat)
    slot_of = torch.full((L * E + 1,), -1, dtype=torch.long)
    pair_of_slot = torch.full((slots,), -1, dtype=torch.long)
    policy.reset(L, E, slots, "cpu")
    hits = used = 0
    for i in range(len(offsets) - 1):
        layer = i % L
        pairs = pairs_all[offsets[i] : offsets[i + 1]]
        cached = slot_of[pairs]
        miss = cached < 0
        m = int(miss.sum())
        hits += len(pairs) - m
        if m:
            q = min(m, max(1, int(m * fill + 0.5)))
            missed = pairs[miss]
            if q < m:  # the q misses of the highest pair scores
                scores = torch.as_tensor(policy.pair_scores(layer, missed), dtype=torch.float)
                missed = missed[scores.topk(q).indices]
            if used + q <= slots:
                target = torch.arange(used, used + q)
                used += q
            else:
                keep = torch.as_tensor(policy.slot_scores(layer, pair_of_slot), dtype=torch.float)
                keep = keep.index_fill(0, cached[~miss], float("inf"))
                target = torch.topk(keep, q, largest=False, sorted=False).indices
                slot_of[pair_of_slot[target]] = -1
                used = slots
            pair_of_slot[target] = missed
            slot_of[missed] = target
        policy.observe(layer, pairs % E)
    return hits / len(flat)


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
    ap.add_argument(
        "--trace",
        type=Path,
        help="routing trace .npz: read if it exists, else "
        "written (the routing takes minutes on a small CPU)",
    )
    args = ap.parse_args()
    if args.trace and args.trace.is_file():
        trace = load_trace(args.trace)
    else:
        trace = route_held_out(args)
        if args.trace:
            meta = {
                "num_layers": trace.num_layers,
                "num_experts": trace.num_experts,
                "top_k": trace.top_k,
                "requests": [{"index": 0, "tokens": trace.num_tokens}],
            }
            np.savez(
                args.trace,
                meta_json=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                experts_0000=trace.requests[0],
            )
    report(args, trace)


def route_held_out(args) -> Trace:
    """The held-out text's routing under routers fitted as the converter fits them (its text,
    tokens and seed)."""
    _, fit_inputs = moe_from_dense.mlp_inputs(
        args.dense, moe_from_dense.default_text(), moe_from_dense.FIT_TOKENS
    )
    routing = moe_from_dense.fit_routers(fit_inputs, args.experts, args.top_k)
    del fit_inputs
    model, tokenizer = moe_from_dense.reference_model(args.dense)
    held_out = (
        Path(inspect.getsourcefile(json.decoder)).read_text()
        + Path(inspect.getsourcefile(textwrap)).read_text()
    )
    ids = tokenizer(held_out, add_special_tokens=False)["input_ids"][: args.tokens]
    inputs = moe_from_dense.layer_inputs(model, ids)
    experts = np.stack(
        [
            (x @ r.T).topk(args.top_k, dim=-1).indices.numpy()
            for x, r in zip(inputs, routing.routers, strict=True)
        ],
        axis=1,
    )
    prefetch_coverage(inputs, routing)
    return Trace(len(inputs), args.experts, args.top_k, (experts.astype(np.int64),))


def prefetch_coverage(inputs, routing) -> None:
    """How many of layer l's routes a prefetch issued one or two layers early could catch: the
    share of its top-k found in the top n of its router applied to layer l - 1's (l - 2's) MLP
    input, which the GPU has that much earlier."""
    k = routing.top_k
    for ahead in (1, 2):
        for n in (k, k + 1, k + 2):
            hit = total = 0
            for layer in range(ahead, len(inputs)):
                true = (inputs[layer] @ routing.routers[layer].T).topk(k, -1).indices
                guess = (inputs[layer - ahead] @ routing.routers[layer].T).topk(n, -1).indices
                hit += int((true[:, :, None] == guess[:, None, :]).any(-1).sum())
                total += true.numel()
            print(
                f"prefetch {ahead} layer(s) ahead, top-{n} of the guess: "
                f"{hit / total:.3f} of the routes"
            )


def report(args, trace: Trace) -> None:
    per_expert = expert_bytes(args.dense)
    routes = trace.num_layers * trace.top_k
    budget_ms = 1e3 / args.target_tok_s
    rate = (args.pcie_gbs + args.cpu_gbs) * 1e9
    print(
        f"{args.dense.name}: {trace.num_layers} layers x {trace.num_experts} experts, top-"
        f"{trace.top_k}, {trace.num_tokens} held-out tokens; "
        f"{per_expert / 1e6:.2f} MB an expert; "
        f"misses at {rate / 1e9:.0f} GB/s (fill + CPU); fused step {args.fused_ms} ms; "
        f"target {args.target_tok_s} tok/s = {budget_ms:.2f} ms"
    )
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
        rows = [(r.policy, r.hit_rate) for r in results]
        fill = args.pcie_gbs / (args.pcie_gbs + args.cpu_gbs)
        rows.append(
            (
                f"hybrid split (fill {fill:.2f} of misses)",
                split_replay(trace, slots, args.policies.split(",")[0], fill),
            )
        )
        for policy, hit_rate in rows:
            misses = (1 - hit_rate) * routes
            miss_ms = misses * per_expert / rate * 1e3
            print(
                f"| {frac:.0%} ({slots} slots) | {policy} | {hit_rate:.3f} | "
                f"{misses:.2f} of {routes} | {miss_ms:.2f} | "
                f"{1e3 / (args.fused_ms + miss_ms):.0f} | {allowed:.2f} |"
            )


if __name__ == "__main__":
    main()
