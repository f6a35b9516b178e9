"""Start to first answered request through `ft serve`, the HTTP layer in (issue 18's measure):
a fresh `ft serve --model DIR` on a weight directory (or, with `--format safetensors`, on the
safetensors checkpoint it would be converted from), timed from its launch to the answer of
a one-token `/v1/completions` request sent as soon as the port takes connections, beside the
floor, the bytes / the file system's sequential read bandwidth (a plain single-threaded read of
the same files, load_time.py's), from a warm page cache and, with `--page-cache cold`, a cold
one. `load_time.py` measures the same start without the server (its imports and uvicorn).

    python benchmarks/serve_start.py --layers 16 --work /tmp/lt --tokenizer .carry/tokenizer \
        --repeat 3 --out serve.md

Random Qwen3-30B-A3B-shaped bf16 weights (benchmarks/checkpoint.py, written once under WORK,
reused), `hybrid` with an 8 GiB expert cache and a 4096-token KV cache, as load_time.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from checkpoint import write_random_checkpoint, write_random_weight_dir
from decode_offload import qwen3_30b_a3b, report, tiny
from load_time import drop_cache, plain_read
from server_process import free_port, stop

from freetoken.weights.weight_dir import is_weight_dir


def serve_once(
    model: Path, strategy: str, cache: str, env: dict, log: Path | None, timeout: float = 300.0
) -> dict:
    """Seconds from launching `ft serve` to its port taking connections and to its first
    answer, and the answer's text. With a `log`, the server's debug log goes there, each line
    timed from its start (`ft -v`)."""
    port = free_port()
    verbose = ["-v"] if log else []
    cmd = [
        sys.executable,
        "-m",
        "freetoken.cli.main",
        *verbose,
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--moe-strategy",
        strategy,
        "--kv-cache-tokens",
        "4096",
    ]
    if cache != "none":
        cmd += ["--moe-cache-size", cache]
    # ("!": one token of a low id, inside --tiny's 1000-token vocabulary too)
    body = json.dumps(
        {"model": model.name, "prompt": "!", "max_tokens": 1, "temperature": 0}
    ).encode()
    err = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    listening = None
    try:
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                raise SystemExit(
                    f"ft serve exited with {proc.returncode}" + (f"; its log: {log}" if log else "")
                )
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    listening = listening or time.time() - t0
            except OSError:
                time.sleep(0.005)
                continue
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                body,
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                text = json.loads(answer.read())["choices"][0]["text"]
            return dict(listening_s=listening, answered_s=time.time() - t0, text=text)
        raise SystemExit(f"ft serve did not answer within {timeout:.0f} s")
    finally:
        stop(proc, timeout=60)
        if log:
            err.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/load-time"))
    ap.add_argument("--tokenizer", type=Path, help="Qwen3 tokenizer files to copy")
    ap.add_argument("--tiny", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument(
        "--format",
        choices=["weight-dir", "safetensors"],
        default="weight-dir",
        help="what `ft serve --model` reads (written once under WORK)",
    )
    ap.add_argument("--strategy", default="hybrid")
    ap.add_argument("--cache", default="8GiB", help="expert cache, or none")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--page-cache", nargs="+", default=["warm"], choices=["cold", "warm"])
    ap.add_argument(
        "--logs", type=Path, help="directory for each start's debug log (ft -v: a timeline)"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    raw = tiny(args.layers) if args.tiny else qwen3_30b_a3b(args.layers)
    model = args.work / args.format
    if args.format == "weight-dir" and not is_weight_dir(model):
        write_random_weight_dir(raw, model, tokenizer=args.tokenizer)
    elif args.format == "safetensors" and not (model / "model.safetensors.index.json").exists():
        write_random_checkpoint(raw, model, tokenizer=args.tokenizer)
    # Bytecode compiled once and kept (load_time.py's directory): a read-only environment
    # compiles every module from source at each start otherwise
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", str(args.work / "pycache"))
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    first = serve_once(model, args.strategy, args.cache, env, None)  # kernels into their caches
    print(f"primed (one untimed start): {first['answered_s']:.1f} s", flush=True)
    rows = []
    for rep in range(args.repeat):
        for state in args.page_cache:
            drop_cache(model)
            if state == "warm":
                plain_read(model)
            nbytes, floor = plain_read(model)
            drop_cache(model)
            if state == "warm":
                plain_read(model)
            log = args.logs / f"{args.format}-{state}-{rep}.txt" if args.logs else None
            t = serve_once(model, args.strategy, args.cache, env, log)
            rows.append(
                dict(
                    page_cache=state,
                    gb=nbytes / 1e9,
                    floor_s=floor,
                    **t,
                    ratio=t["answered_s"] / floor,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"# serve_start: `ft serve` to its first answer from a {args.format}; Qwen3-30B-A3B "
        f"shape, {args.layers} layers, random bf16, {args.strategy} {args.cache}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| page cache | GB | floor s | port open s | first answer s | first answer / floor | "
        "answer |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['page_cache']} | {r['gb']:.1f} | {r['floor_s']:.2f} | "
            f"{r['listening_s']:.2f} | {r['answered_s']:.2f} | {r['ratio']:.2f} | "
            f"{r['text']!r} |"
        )
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
