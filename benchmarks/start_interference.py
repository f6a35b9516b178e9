"""What slows a warm start's tokenizer and imports beside the early start's other work (issue
18): in fresh processes, the tokenizer's load (the main thread, holding the GIL) and then the
engine's imports, with nothing beside them, beside each part of the early start alone (the
native preload's loads of torch's libraries; those and the CUDA context; the early read of a
weight directory), and beside all of it as `ft serve` runs it (`early_start.before_imports`).
Each load's wall time and the main thread's CPU time: a wall time above the CPU time is a wait
(a lock, the GIL), one with the CPU time grown too is contention (memory, page faults).

    python benchmarks/start_interference.py /tmp/lt/weight-dir --repeat 3 --out interference.md

The directory's page cache should be warm (as a warm start's); conditions needing a GPU's
driver are skipped without one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from decode_offload import report

from freetoken import native_preload

CONDITIONS = ("alone", "libraries", "libraries+context", "read", "all", "all:late-lock")
# `ft serve`'s early start with a part of it turned off
VARIANTS = {"all:late-lock": {"FREETOKEN_EARLY_LOCK": "0"}}

CHILD = """
import gc, json, sys, time
gc.disable()
model, condition = sys.argv[1], sys.argv[2]
from freetoken import early_start, native_preload, tokenizer
from freetoken.weights import early_read
tokenizer.load_native()
preload = None
wall, cpu = time.perf_counter(), time.thread_time()
if condition.startswith("all"):
    early_start.before_imports(model, "cuda")  # (its tokenizer's load is most of it)
    preload = native_preload.started()
else:
    if condition == "libraries":
        preload = native_preload.Preload(native_preload.torch_lib_dir(), None,
                                         native_preload.LIBRARIES)
        preload.wait_loading()
    elif condition == "libraries+context":
        preload = native_preload.start("cuda")
        preload.wait_loading()
    elif condition == "read":
        early_read.start(model, "cuda")
    wall, cpu = time.perf_counter(), time.thread_time()
    tokenizer.preload(model)
tok_wall, tok_cpu = time.perf_counter() - wall, time.thread_time() - cpu
wall, cpu = time.perf_counter(), time.thread_time()
import torch
from freetoken.engine.generate import LLMEngine
import_wall, import_cpu = time.perf_counter() - wall, time.thread_time() - cpu
read = early_read.claim(model)  # (as the loader does: the rest of the readers join)
lock = read.pool_lock if read is not None else None
lock_s = lock.seconds if lock is not None and lock.wait() else None
if preload is not None:
    preload.wait()
if read is not None:
    for f in read.files:
        read.wait(f)
steps = preload.timings if preload is not None else {}
reads = read.seconds if read is not None else {}
print(json.dumps(dict(condition=condition, tokenizer_s=tok_wall, tokenizer_cpu_s=tok_cpu,
                      import_s=import_wall, import_cpu_s=import_cpu,
                      preload={k: round(v, 3) for k, v in steps.items()},
                      read_s={k: round(v, 3) for k, v in reads.items()}, lock_s=lock_s)))
"""


def run(model: Path, condition: str, env: dict) -> dict:
    env = {**env, **VARIANTS.get(condition, {})}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), condition],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{condition}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path, help="a weight directory (its page cache warm)")
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not native_preload.gpu_driver_present():
        args.conditions = [c for c in args.conditions if c in ("alone", "libraries")]
    # Bytecode kept between the children (a read-only environment compiles every module at
    # each start otherwise); the engine's early read and preload forced on for the children.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.setdefault("PYTHONPYCACHEPREFIX", "/tmp/start-interference-pycache")
    env["FREETOKEN_EARLY_READ"] = "1"
    run(args.model, "alone", env)  # (bytecode written, files in the page cache)
    rows = []
    for _ in range(args.repeat):
        for condition in args.conditions:  # (interleaved: a machine's drift spreads evenly)
            rows.append(run(args.model, condition, env))
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"# start_interference: the tokenizer's load and the engine's imports beside the early "
        f"start's parts; {args.model}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| beside | tokenizer s (CPU s) | imports s (CPU s) | preload's steps s | read s | "
        "pool locked in s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        preload = ", ".join(f"{k} {v}" for k, v in r["preload"].items()) or "-"
        read = ", ".join(f"{k} {v}" for k, v in r["read_s"].items()) or "-"
        tok = f"{r['tokenizer_s']:.3f} ({r['tokenizer_cpu_s']:.3f})"
        imports = f"{r['import_s']:.3f} ({r['import_cpu_s']:.3f})"
        lock = "-" if r["lock_s"] is None else f"{r['lock_s']:.2f}"
        lines.append(f"| {r['condition']} | {tok} | {imports} | {preload} | {read} | {lock} |")
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
