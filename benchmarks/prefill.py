"""Prefill speed with whole-layer expert streaming, against the PCIe transfer floor.

    python benchmarks/prefill.py --layers 16 --cache 8GiB --tokens 1024 --tokens 4096 ...

On a random model of one of decode_offload.py's shapes (`--shape`, Qwen3-30B-A3B's by default;
uniform random routing), with
the expert cache capped, prefills one chunk of each size with streaming overlap on and off and
reports tokens/s, the chunk time, bytes over PCIe and device to device, the GPU's wait for
copies, and the chunk time divided by the transfer floor (expert pool bytes / measured B_P).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from decode_offload import (
    SHAPES,
    random_model,
    report,
    sync,
    tiny,
    use_uniform_routing,
)

from freetoken.config import MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.moe.bandwidth import measure


def prefill(loaded, options, tokens: int, overlap: bool, device) -> dict:
    runner = ModelRunner(loaded, kv_cache_tokens=tokens + 64, moe=options)
    streamer = runner.moe.streamer
    streamer.overlap = overlap
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, loaded.config.vocab_size, (tokens,), generator=gen).tolist()
    runner.forward([runner.new_sequence()], [ids[:64]])  # warm-up: kernels, allocator
    sync(device)
    start = time.perf_counter()
    runner.forward([runner.new_sequence()], [ids])
    sync(device)
    seconds = time.perf_counter() - start
    chunk = streamer.counters.history[-1]
    if runner.moe.cpu is not None:
        runner.moe.cpu.shutdown()
    return dict(
        tokens=tokens,
        overlap=overlap,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        bytes_h2d=chunk["bytes_h2d"],
        bytes_d2d=chunk["bytes_d2d"],
        copy_wait_s=chunk["copy_wait_s"],
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--cache", default="8GiB")
    ap.add_argument("--tokens", type=int, action="append")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    loaded = random_model((tiny if args.tiny else SHAPES[args.shape])(args.layers), device)
    use_uniform_routing(loaded)
    store = loaded.experts
    bw = measure(store.shape, device, seconds=0.3 if args.tiny else 1.5)
    b_p = bw.pcie or bw.cpu_experts
    floor = store.nbytes / b_p
    options = MoEOptions("hybrid", args.cache, prefill_stream_threshold=64)
    rows = []
    for tokens in args.tokens or [1024, 4096, 8192, 16384]:
        for overlap in (True, False):
            row = prefill(loaded, options, tokens, overlap, device)
            row["floor_ratio"] = row["seconds"] / floor
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        f"# prefill: {'tiny' if args.tiny else args.shape} shape, {args.layers} layers, "
        f"cache {args.cache}",
        "",
        f"- GPU: {bw.gpu}; CPU: {bw.cpu}; torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- expert pool {store.nbytes / 2**30:.1f} GiB; B_P {b_p / 1e9:.1f} GB/s; "
        f"transfer floor {floor * 1e3:.0f} ms per chunk",
        "",
        "| tokens | overlap | tok/s | chunk ms | / floor | PCIe GB | D2D GB | GPU copy wait ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {'on' if r['overlap'] else 'off'} | {r['tokens_per_s']:.0f} | "
            f"{r['seconds'] * 1e3:.0f} | {r['floor_ratio']:.2f} | {r['bytes_h2d'] / 1e9:.2f} | "
            f"{r['bytes_d2d'] / 1e9:.2f} | {r['copy_wait_s'] * 1e3:.0f} |"
        )
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
