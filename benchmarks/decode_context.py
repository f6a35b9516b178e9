"""Decode speed against context length, beside llama.cpp on the same checkpoint and machine.

    python benchmarks/decode_context.py --layers 16 --contexts 0 8192 32768 65536 \\
        --strategy fused --strategy hybrid --cache 8GiB --batch 1 --batch 4 \\
        --checkpoint DIR --llama-bench BIN --gguf FILE --ncmoe 10 --out results.md

Each (strategy, batch, context) gets a runner whose sequences already hold `context` tokens of
KV (the pages reserved and counted as written: attention reads the same bytes whatever their
values, and filling 64k tokens by prefill would take longer than the measurement), then decodes
`--warmup` steps and `--rounds` timed rounds of `--steps` (median round reported). With
`--checkpoint` the model is loaded from those files (the ones llama.cpp's converter read, or a
GGUF file both engines read: benchmarks/gguf_random.py), else a random Qwen3-30B-A3B-shaped
model is built in memory; routing is uniform random for the
offloaded strategies (decode_offload.py says why). llama-bench runs with `-d` at the same
contexts: all layers on the GPU (`-ngl 99`), and with `--ncmoe N` (repeatable) the experts of
the first N layers on the CPU; on a CPU device, with `-t` threads. `--cache` repeats too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from decode_offload import (
    SHAPES,
    contender_options,
    random_model,
    report,
    sync,
    tiny,
    use_uniform_routing,
)

from freetoken.config import EXPERT_FORMATS
from freetoken.engine.runner import ModelRunner
from freetoken.models import gguf
from freetoken.models.loading import load_model
from freetoken.weights.expert_format import expert_format


def decode_speed(
    loaded, options, batch, context, warmup, steps, rounds, device, graphs: bool = True
) -> dict:
    longest = context + warmup + steps * rounds + 64
    runner = ModelRunner(
        loaded, batch * longest, moe=options, max_model_len=longest, cuda_graphs=graphs
    )
    seqs = [runner.new_sequence() for _ in range(batch)]
    for seq in seqs:
        runner.kv.reserve(seq, max(context, 1))
        seq.length = context  # held, as far as attention is concerned
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    tokens = torch.randint(0, vocab, (warmup + steps * rounds, batch), generator=gen).tolist()

    def step(t, runner=runner):
        # the sampler's wait for the step, as in serving
        runner.forward(seqs, [[x] for x in t])[:, 0].max().item()

    for t in tokens[:warmup]:
        step(t)
    seconds = []
    for r in range(rounds):
        sync(device)
        start = time.perf_counter()
        for t in tokens[warmup + r * steps : warmup + (r + 1) * steps]:
            step(t)
        sync(device)
        seconds.append(time.perf_counter() - start)
    per_round = sorted(batch * steps / s for s in seconds)
    strategy = runner.moe.strategy if runner.moe is not None else "dense"
    if runner.moe is not None and runner.moe.cpu is not None:
        runner.moe.cpu.shutdown()
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "tokens_per_s": per_round[len(per_round) // 2],
        "resolved": strategy,
        "spread": (per_round[-1] - per_round[0]) / per_round[len(per_round) // 2],
    }


def prefill_speed(loaded, options, tokens: int, device) -> float:
    """tok/s of one `tokens`-token prompt in one forward (after one of the same size)."""
    runner = ModelRunner(loaded, 2 * tokens + 64, moe=options, max_model_len=tokens + 64)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(2):
        seq = runner.new_sequence()
        ids = torch.randint(0, loaded.config.vocab_size, (tokens,), generator=gen).tolist()
        sync(device)
        start = time.perf_counter()
        runner.forward([seq], [ids])[:, 0].max().item()
        sync(device)
        seconds.append(time.perf_counter() - start)
        runner.release(seq)
    if runner.moe is not None and runner.moe.cpu is not None:
        runner.moe.cpu.shutdown()
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokens / seconds[-1]


def llama_bench(binary, gguf, contexts, extra, label, prefill: int = 0) -> dict[int, float]:
    """llama-bench tg tok/s per context (`-d`), or {} when it fails; with `prefill`, pp tok/s
    of a prompt of that many tokens instead (keyed -prefill)."""
    test = (
        ["-p", str(prefill), "-n", "0"]
        if prefill
        else ["-p", "0", "-n", "32", "-d", ",".join(map(str, contexts))]
    )
    command = [binary, "-m", str(gguf), *test, "-r", "1", "-o", "json", *extra]
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    print("running", " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"llama-bench ({label}) failed:\n{done.stderr[-3000:]}", flush=True)
        return {}
    results = json.loads(done.stdout)
    if prefill:
        return {-prefill: float(results[-1]["avg_ts"])}
    return {int(r["n_depth"]): float(r["avg_ts"]) for r in results}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3-30b-a3b",
        help="the random model's shape (without --checkpoint)",
    )
    ap.add_argument(
        "--graphs",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="decode steps in CUDA graphs, or eager (both: each config twice)",
    )
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 8192, 32768, 65536])
    ap.add_argument("--strategy", action="append")
    ap.add_argument(
        "--cache", action="append", help="expert cache of the offloaded strategies (default 8GiB)"
    )
    ap.add_argument("--batch", action="append", type=int)
    ap.add_argument("--steps", type=int, default=32)
    # (hybrid's StepModes runs 16 split steps, then trials of each way, before it settles:
    # fewer warm-up steps time the trials; a DeepSeek-V3-shaped side-by-side with 4 read
    # 10.6 ms a token where 16 and 32-step rounds read 8.0, results/2026-12-02-nvfp4-block-route)
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--checkpoint", type=Path, help="load the model from this checkpoint")
    ap.add_argument("--tiny", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument("--llama-bench", help="the llama-bench binary, to run beside")
    ap.add_argument("--gguf", type=Path, help="the checkpoint converted to GGUF, for llama-bench")
    ap.add_argument(
        "--ncmoe", type=int, action="append", help="llama-bench -ncmoe: experts of N layers on CPU"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-bench -t")
    ap.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="also time one prompt of this many tokens (llama-bench: -p)",
    )
    ap.add_argument(
        "--expert-format",
        default="dense",
        choices=EXPERT_FORMATS,
        help="how the random model's experts are stored (dense: bf16; or kept quantized)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    strategies = args.strategy or (["fused", "hybrid"] if device.type == "cuda" else ["fused"])
    batches = args.batch or [1, 4]
    caches = args.cache or ["8GiB"]
    if args.checkpoint and gguf.is_gguf(args.checkpoint):
        args.gguf = args.gguf or args.checkpoint  # (llama-bench reads the very file)
    if args.checkpoint:
        loaded = load_model(gguf.resolve(args.checkpoint), "bfloat16", device)
    else:
        raw = tiny(args.layers) if args.tiny else SHAPES[args.shape](args.layers)
        # Contexts beyond the model's 40k: the shape is what is measured, not its training.
        raw["max_position_embeddings"] = max(
            raw["max_position_embeddings"], max(args.contexts) + 1024
        )
        loaded = random_model(raw, device, expert_format(args.expert_format))
    rows = []
    for strategy in strategies:
        offloaded = strategy not in ("fused", "cpu")
        if offloaded:
            use_uniform_routing(loaded)  # (the fused runs go first and keep the model's router)
        for cache in caches if offloaded else [None]:
            options = contender_options(strategy, cache_size=cache)
            for graphs in args.graphs:
                config = strategy if cache is None else f"{strategy}, {cache}"
                config += "" if args.graphs == ["on"] else f", graphs {graphs}"
                for batch in batches:
                    for context in args.contexts:
                        r = decode_speed(
                            loaded,
                            options,
                            batch,
                            context,
                            args.warmup,
                            args.steps,
                            args.rounds,
                            device,
                            graphs == "on",
                        )
                        row = {
                            "engine": "freetoken",
                            "config": config,
                            "batch": batch,
                            "context": context,
                            **r,
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                if args.prefill:
                    row = {
                        "engine": "freetoken",
                        "config": config,
                        "batch": 1,
                        "context": -args.prefill,
                        "tokens_per_s": prefill_speed(loaded, options, args.prefill, device),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.llama_bench and args.gguf:
        configs = [("all on GPU", ["-ngl", "99"])] if device.type == "cuda" else []
        for n in (args.ncmoe or []) if device.type == "cuda" else []:
            configs.append((f"-ncmoe {n}", ["-ngl", "99", "-ncmoe", str(n)]))
        if device.type == "cpu":
            configs.append((f"CPU, {args.threads} threads", ["-t", str(args.threads)]))
        for label, extra in configs:
            for prefill in [0, args.prefill] if args.prefill else [0]:
                for context, tps in llama_bench(
                    args.llama_bench, args.gguf, args.contexts, extra, label, prefill
                ).items():
                    rows.append(
                        {
                            "engine": "llama.cpp",
                            "config": label,
                            "batch": 1,
                            "context": context,
                            "tokens_per_s": tps,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    experts = "bf16" if loaded.experts is None else loaded.experts.format.name
    experts = "bf16" if experts == "dense" else experts
    lines = [
        f"# decode_context: {args.checkpoint or args.shape} shape, {loaded.config.num_layers} "
        f"layers, experts {experts}",
        "",
        f"- device: {name}, {os.cpu_count()} CPU threads; torch {torch.__version__}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit: {commit}",
        f"- model: {args.checkpoint or 'random, in memory'}; offloaded strategies' expert cache "
        f"{', '.join(caches)}, uniform random routing; {args.rounds} rounds of {args.steps} decode "
        f"steps after {args.warmup} (median round); llama-bench tg32 with -d, 1 repetition",
        "",
        "| engine | config | batch | "
        + " | ".join(f"ctx {c}" for c in args.contexts)
        + " | longest / shortest |"
        + (f" prefill {args.prefill} |" if args.prefill else ""),
        "|---|---|---|" + "---|" * (len(args.contexts) + 1 + bool(args.prefill)),
    ]
    groups: dict[tuple, dict[int, float]] = {}
    for r in rows:
        groups.setdefault((r["engine"], r["config"], r["batch"]), {})[r["context"]] = r[
            "tokens_per_s"
        ]
    for (engine, config, batch), by_context in groups.items():
        cells = [f"{by_context[c]:.1f}" if c in by_context else "-" for c in args.contexts]
        first, last = by_context.get(args.contexts[0]), by_context.get(args.contexts[-1])
        keep = f"{last / first:.2f}" if first and last else "-"
        pp = by_context.get(-args.prefill) if args.prefill else None
        tail = "" if not args.prefill else (f" {pp:.1f} |" if pp else " - |")
        lines.append(
            f"| {engine} | {config} | {batch} | " + " | ".join(cells) + f" | {keep} |" + tail
        )
    report(lines, args.out)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
