"""What a start's imports (the engine's, torch with it) spend their time on (issue 18: on the
H200 machines they took 1.6-4.9 s, against 1.2 s on a 2-core CPU machine): in fresh processes,
the imports' wall time against the main thread's CPU time (a wall far above the CPU is waiting:
files, the dynamic loader, locks), and how much Python work a second thread gets done beside
them (a thread that counts in a loop, against the same loop alone for as long): where the
imports wait without the GIL, work of a start's own can run beside them nearly free. Then the
modules whose own import took longest (`python -X importtime`).

    python benchmarks/import_profile.py --repeat 3 --out imports.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from decode_offload import report

IMPORTS = "from freetoken.engine.generate import LLMEngine"
# Bytecode compiled once and kept (a read-only environment, as the GPU machine's, with
# PYTHONDONTWRITEBYTECODE set, compiles every module from source at each start otherwise: 3.8 s
# of imports there, where a start's, cached, took 2.2-2.8 s)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
ENV.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "import-profile-pycache"))

CHILD = """
import json, sys, threading, time
beside = sys.argv[1] == "1"
count, stop = [0], threading.Event()

def spin():  # pure Python: runs only while it holds the GIL
    n = 0
    while not stop.is_set():
        for _ in range(1000):
            n += 1
        count[0] = n

t0, c0 = time.perf_counter(), time.thread_time()
if beside:
    threading.Thread(target=spin, daemon=True).start()
IMPORTS
wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
stop.set()
done_beside = count[0]
alone = 0
if beside:  # the same loop alone for as long: how much of the GIL it got beside the imports
    count[0], stop = [0], threading.Event()
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    time.sleep(wall)
    stop.set()
    t.join()
    alone = count[0]
print(json.dumps(dict(wall=wall, cpu=cpu, share=done_beside / alone if alone else None)))
""".replace("IMPORTS", IMPORTS)


def run(beside: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if beside else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def slowest_modules(top: int) -> list[tuple[str, float, float]]:
    """(module, its own import s, with what it imported s), by its own time."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", IMPORTS],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", line)
        if m:
            rows.append((m.group(3), int(m.group(1)) / 1e6, int(m.group(2)) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    run(False)  # (bytecode compiled and kept, files in the page cache)
    lines = [
        f"# The engine's imports ({sys.version.split()[0]})",
        "",
        "| run | alone: wall s | alone: main thread CPU s | beside a Python thread: wall s | "
        "CPU s | the thread's share of its loop alone |",
        "|---|---|---|---|---|---|",
    ]
    for i in range(args.repeat):
        a, b = run(False), run(True)
        lines.append(
            f"| {i} | {a['wall']:.2f} | {a['cpu']:.2f} | {b['wall']:.2f} | "
            f"{b['cpu']:.2f} | {b['share']:.2f} |"
        )
        print(lines[-1], flush=True)
    total = sum(r[1] for r in slowest_modules(10**6))
    lines += [
        "",
        f"Own import time of every module: {total:.2f} s; the slowest:",
        "",
        "| module | own s | with its imports s |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {own:.3f} | {cum:.3f} |" for m, own, cum in slowest_modules(args.top)]
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
