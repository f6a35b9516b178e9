"""`ft bench cache`: replay a routing trace through the expert cache at several capacities.

Per capacity it prints the hit rate of LRU, the default eviction policy and any policies named
with --policy (all online: they see the trace only as it is replayed), then two oracles that
see the whole trace: the best static set of pairs and Belady's optimum under the same
fill-every-miss rule; and how far the default is from Belady.
"""

from __future__ import annotations

import argparse
import json
import sys

from freetoken.errors import FreetokenError
from freetoken.moe.policy import POLICIES, default_policy, make_policy
from freetoken.moe.trace import (
    ReplayResult,
    Trace,
    belady,
    capacity_slots,
    load_trace,
    replay,
    static_oracle,
)

DEFAULT_CAPACITIES = (0.10, 0.25, 0.37, 0.50)


def _load(path: str, max_tokens: int | None) -> Trace:
    try:
        trace = load_trace(path)
    except FileNotFoundError:
        raise FreetokenError(f"trace file {path} does not exist") from None
    except (OSError, ValueError, KeyError) as e:
        raise FreetokenError(f"cannot read trace {path}: {e}") from None
    if max_tokens is not None and max_tokens < 1:
        raise FreetokenError("--max-tokens must be at least 1")
    return trace.truncated(max_tokens)


def bench(
    trace: Trace, capacities: list[float], policies: list[str], device: str = "cpu"
) -> dict[str, dict[float, ReplayResult]]:
    """{policy name: {capacity fraction: result}} for the online `policies` and both oracles."""
    out: dict[str, dict[float, ReplayResult]] = {}
    for frac in capacities:
        slots = capacity_slots(trace, frac)
        for name in policies:
            out.setdefault(name, {})[frac] = replay(trace, slots, make_policy(name), device)
        out.setdefault("static-oracle", {})[frac] = static_oracle(trace, slots)
        out.setdefault("belady", {})[frac] = belady(trace, slots)
    return out


def _table(results: dict[str, dict[float, ReplayResult]], default: str) -> str:
    names = list(results)
    caps = list(results[names[0]])
    labels = [
        {"static-oracle": "static (oracle)", "belady": "belady (oracle)"}.get(n, n) for n in names
    ]
    head = ["capacity", "slots", *labels, f"{default} - belady"]
    rows = []
    for frac in caps:
        slots = results[names[0]][frac].capacity_slots
        rates = [results[n][frac].hit_rate for n in names]
        gap = results[default][frac].hit_rate - results["belady"][frac].hit_rate
        rows.append(
            [f"{frac:.0%}", str(slots), *(f"{r:.1%}" for r in rates), f"{100 * gap:+.1f} pts"]
        )
    times = [
        "replay seconds",
        "",
        *("/".join(f"{results[n][f].seconds:.0f}" for f in caps) for n in names),
        "",
    ]
    widths = [max(len(r[i]) for r in [head, *rows, times]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(r) for r in rows), line(times)])


def run(args: argparse.Namespace) -> int:
    trace = _load(args.trace, args.max_tokens)
    capacities = list(args.capacity or DEFAULT_CAPACITIES)
    for frac in capacities:
        if not 0 < frac <= 1:
            raise FreetokenError(f"--capacity is a fraction in (0, 1], got {frac}")
    default = default_policy().name
    policies = ["lru", default]
    for name in args.policy or []:
        if name not in POLICIES:
            raise FreetokenError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
        if name not in policies:
            policies.append(name)
    device = getattr(args, "device", None) or "cpu"
    results = bench(trace, capacities, policies, device)
    if args.json:
        doc = {
            "trace": str(args.trace),
            "tokens": trace.num_tokens,
            "num_layers": trace.num_layers,
            "num_experts": trace.num_experts,
            "top_k": trace.top_k,
            "default": default,
            "results": {
                name: {
                    f"{frac:g}": {
                        "slots": r.capacity_slots,
                        "hit_rate": r.hit_rate,
                        "hits": r.hits,
                        "accesses": r.accesses,
                        "seconds": round(r.seconds, 3),
                    }
                    for frac, r in by_cap.items()
                }
                for name, by_cap in results.items()
            },
        }
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    steps = trace.num_steps
    print(
        f"trace {args.trace}: {len(trace.requests)} requests, {trace.num_tokens} decode tokens, "
        f"{trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k} "
        f"({steps} layer-steps, {trace.num_pairs} pairs)"
    )
    print(_table(results, default))
    return 0
