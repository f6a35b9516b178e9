"""How an early read's reader threads slow the imports they run beside (issue 18): in fresh
processes, a weight directory's files read on N threads (weights/early_read.py) while Python
imports the engine, against the imports alone and the reads alone. Run it on a directory the
page cache holds (a warm start: the reads are memory copies and page faults).

    python benchmarks/early_read_imports.py /tmp/lt/weight-dir --threads 0 2 4 8 --repeat 2
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

CHILD = """
import json, sys, time
t0 = float(sys.argv[2])
threads, imports = int(sys.argv[3]), sys.argv[4] == "1"
read = None
if threads:
    from freetoken.weights import early_read, weight_dir
    read = early_read.EarlyRead(weight_dir.WeightDir(sys.argv[1]), early_read.FILES, threads)
t_import = None
if imports:
    import torch
    from freetoken.engine.generate import LLMEngine
    t_import = time.time() - t0
if read is not None:
    for f in read.files:
        read.wait(f)
t_read = (time.time() - t0) if read is not None else None
print(json.dumps(dict(import_s=t_import, read_s=t_read,
                      gb=read.nbytes / 1e9 if read is not None else None)))
"""


def once(path: Path, threads: int, imports: bool) -> dict:
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), repr(t0), str(threads), "1" if imports else "0"],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", type=Path, help="a weight directory (warm in the page cache)")
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    for f in args.path.iterdir():  # (into the page cache)
        if f.is_file():
            f.read_bytes()
    # Python's bytecode compiled once, where a read-only environment (the GPU machine's) would
    # compile every module at each start (seconds: load_time.py --prime does the same)
    os.environ.setdefault("PYTHONPYCACHEPREFIX", "/tmp/early-read-imports-pycache")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    once(args.path, 0, True)
    lines = [
        f"# early_read_imports: {args.path}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| reader threads | imports too | run | imports s | reads end s | GB |",
        "|---|---|---|---|---|---|",
    ]
    for threads in args.threads:
        for imports in (True, False) if threads else (True,):
            for run in range(args.repeat):
                r = once(args.path, threads, imports)
                cells = [
                    f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("import_s", "read_s", "gb")
                ]
                lines.append(
                    f"| {threads} | {'yes' if imports else 'no'} | {run} | "
                    + " | ".join(cells)
                    + " |"
                )
                print(lines[-1], flush=True)
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
