"""Another process takes the GPU's free memory while requests run, then gives it back: the
expert cache shrinks (engine/memory_watch.py), serving goes on, and the cache grows back.

    python benchmarks/gpu_memory_pressure.py --model DIR --out pressure.md

Rounds of the same greedy requests through the engine: two before (the second, a control:
in bf16 a hybrid step's sum depends on which experts ran on which side, so outputs can move
between rounds whatever the cache's size), one while a second process holds all but
`--leave` of the free memory, two after it has exited. Reports the cache's slots seen in each
round, the share of output tokens equal to the first round's, whether any request failed,
and the watch's counts; exits 1 unless the cache shrank under pressure and grew back. The
engine runs in this process (LLMEngine, as `ft serve` drives it; the GPU machine has no HTTP
stack installed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from decode_offload import report

from freetoken.config import EngineConfig, MoEOptions
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams

HOG = """
import sys, torch
leave = int(sys.argv[1])
free, _ = torch.cuda.mem_get_info()
held = torch.empty(max(0, free - leave), dtype=torch.uint8, device="cuda")
print(f"held {held.numel() / 2**30:.1f} GiB", flush=True)
sys.stdin.readline()
"""


def run_round(engine: LLMEngine, prompts, tokens: int) -> tuple[list[list[int]], list[int]]:
    """Every prompt to `tokens` greedy tokens, together; (outputs, cache slots per step)."""
    requests = [
        engine.add_request(p, SamplingParams(max_new_tokens=tokens, temperature=0.0))
        for p in prompts
    ]
    outputs = {r.id: [] for r in requests}
    slots = []
    while engine.running or engine.preempted:
        for out in engine.step():
            outputs[out.request.id].append(out.token_id)
        slots.append(engine.runner.moe.cache.num_slots)
    return [outputs[r.id] for r in requests], slots


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--strategy", default="hybrid")
    ap.add_argument("--cache", default="8GiB")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--leave", type=float, default=0.25, help="GiB the other process leaves free")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    engine = LLMEngine.from_config(
        EngineConfig(
            model=args.model,
            kv_cache_tokens=8192,
            max_batch_size=args.requests,
            progress=False,
            moe=MoEOptions(args.strategy, args.cache),
        )
    )
    watch = engine.memory_watch
    watch.every = 8  # (the default 32 reacts within a second of decode steps as well)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.config.vocab_size
    prompts = [torch.randint(0, vocab, (24,), generator=gen).tolist() for _ in range(args.requests)]
    rows = []
    reference, slots = run_round(engine, prompts, args.tokens)

    def agree(outputs) -> float:
        pairs = [
            (a, b)
            for out, ref in zip(outputs, reference, strict=True)
            for a, b in zip(out, ref, strict=True)
        ]
        return sum(a == b for a, b in pairs) / len(pairs)

    rows.append(("before", slots, 1.0, ""))
    outputs, slots = run_round(engine, prompts, args.tokens)
    rows.append(("before again (control)", slots, agree(outputs), ""))
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(int(args.leave * 2**30))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    held = hog.stdout.readline().strip()
    outputs, slots = run_round(engine, prompts, args.tokens)
    free = torch.cuda.mem_get_info()[0] / 2**30
    rows.append(("while another process " + held, slots, agree(outputs), f"{free:.2f}"))
    hog.stdin.write("\n")
    hog.stdin.flush()
    hog.wait(60)
    time.sleep(0.5)
    for name in ("after it exited", "after, again"):
        outputs, slots = run_round(engine, prompts, args.tokens)
        free = torch.cuda.mem_get_info()[0] / 2**30
        rows.append((name, slots, agree(outputs), f"{free:.1f}"))
    lines = [
        f"# gpu_memory_pressure: {args.model.name}, {args.strategy} {args.cache}, "
        f"{args.requests} greedy requests of {args.tokens} tokens a round, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| round | cache slots (first, min, last) | output tokens equal to the first round's | "
        "free GiB after |",
        "|---|---|---|---|",
    ]
    for name, seen, same, free in rows:
        lines.append(f"| {name} | {seen[0]}, {min(seen)}, {seen[-1]} | {same:.1%} | {free} |")
    lines += ["", f"memory watch: {watch.snapshot()}; no request failed (a failure raises)"]
    report(lines, args.out)
    shrank = min(rows[2][1]) < watch.target
    grew = rows[-1][1][-1] == watch.target
    return 0 if shrank and grew else 1


if __name__ == "__main__":
    sys.exit(main())
