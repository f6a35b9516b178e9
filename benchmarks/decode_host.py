"""The host's own work per decode step against the context length, on any machine.

    python benchmarks/decode_host.py --contexts 1024 32768 65536 --batch 1 --batch 4

A decode step's host work besides launching kernels is building its batch: reserving pages,
bringing the device page table up to date, packing the step's values into one copy
(`ForwardBatch.build`), and committing the lengths. Here it is timed on a KV cache of the
16-layer Qwen3-30B-A3B shape's attention (4 KV heads of 128, bf16) with sequences already
holding `context` tokens, over many steps so pages fill and new ones are added as in real
decoding; no model runs. The median step is reported, with the ratio of each context to the
first.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from decode_offload import report

from freetoken.kv.batch import ForwardBatch, PinnedStaging, commit
from freetoken.kv.paged import KVSequence, PagedKVCache


def step_times(context: int, batch: int, steps: int, device: torch.device) -> list[float]:
    pages = batch * (context + steps) // 16 + 16
    cache = PagedKVCache(
        1, pages, 16, 4, 128, torch.bfloat16, device, max_seq_tokens=context + steps + 16
    )
    seqs = [KVSequence() for _ in range(batch)]
    for seq in seqs:
        cache.reserve(seq, context)
        seq.length = context
    staging = PinnedStaging() if device.type == "cuda" else None
    times = []
    gc.collect()  # the last context's pools freed first, not during the timed steps
    for i in range(steps):
        start = time.perf_counter()
        built = ForwardBatch.build(cache, seqs, [[i % 1000]] * batch, device, staging=staging)
        commit(seqs, built)
        times.append(time.perf_counter() - start)
    return times[steps // 10 :]  # the first steps send the whole rows once


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768, 65536])
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    commit_id = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "# decode_host: the host's work per decode step (ForwardBatch.build + commit)",
        "",
        f"- device: {device}; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"commit: {commit_id}; {args.steps} steps, median of all but the first tenth, the lowest "
        "of three runs",
        "",
        "| batch | "
        + " | ".join(f"ctx {c} (us)" for c in args.contexts)
        + " | "
        + " | ".join(f"{c} / {args.contexts[0]}" for c in args.contexts[1:])
        + " |",
        "|---|" + "---|" * (2 * len(args.contexts) - 1),
    ]
    for batch in args.batch or [1, 4]:
        # The lowest of three runs' medians: this machine's other tenants add noise, never
        # take it away.
        medians = [
            min(statistics.median(step_times(c, batch, args.steps, device)) for _ in range(3)) * 1e6
            for c in args.contexts
        ]
        ratios = [f"{m / medians[0]:.2f}" for m in medians[1:]]
        lines.append(
            f"| {batch} | "
            + " | ".join(f"{m:.0f}" for m in medians)
            + " | "
            + " | ".join(ratios)
            + " |"
        )
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
