"""`ft generate`'s decode speed with every core free and with one core taken by another process
(issue 42: a process spinning on one of the 2-core machine's cores cut it from 37 to 10 tok/s).

Each run is a fresh `ft generate` (its own code path: `freetoken.cli.main.main`) in a child
process of the tree given by `--src`, with `LLMEngine.stream` timed from its first token to its
last; "busy" runs start a process that spins on the CPU (`while True: pass`, one core's worth)
first and end it after. Runs alternate idle and busy, so a change in the machine's own load
falls on both. The machine's load average is recorded beside each run.

    PYTHONPATH=src python benchmarks/busy_core.py --runs 3 --out busy.md
    python benchmarks/busy_core.py --src /path/to/older/checkout/src --runs 3   # "before"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, sys, time
from freetoken.engine import generate
stream = generate.LLMEngine.stream
times = []
def timed(self, prompt_ids, params):
    for out in stream(self, prompt_ids, params):
        times.append(time.perf_counter())
        yield out
generate.LLMEngine.stream = timed
from freetoken.cli.main import main
rc = main(sys.argv[1:])
n = len(times)
rate = (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0
print("BUSYCORE " + json.dumps({"rc": rc, "tokens": n, "tok_s": rate}), file=sys.stderr)
"""

SPIN = "while True: pass"


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def one_run(src: Path, argv: list[str], busy: bool, env: dict) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        if spinner is not None:
            time.sleep(0.5)  # (the spinner running before the engine sizes its threads)
        before = load()
        p = subprocess.run(
            [sys.executable, "-c", CHILD, *argv],
            env={**env, "PYTHONPATH": str(src)},
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("BUSYCORE ")]
    if not lines:
        raise SystemExit(f"ft generate failed:\n{p.stderr[-3000:]}")
    result = json.loads(lines[-1].split(" ", 1)[1])
    return {**result, "busy": busy, "load": before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parent.parent / "src")
    ap.add_argument("--runs", type=int, default=3, help="runs of each condition")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="Tell me a long story about a dragon and a knight.")
    ap.add_argument("--model", help="--model for ft generate (default: the demo)")
    ap.add_argument("--label", default="", help="names this tree in the table")
    ap.add_argument("--out", type=Path, help="append the table here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    argv = ["generate", "--chat", "--prompt", args.prompt, "--max-tokens", str(args.max_tokens)]
    argv += ["--temperature", "0"]
    if args.model:
        argv += ["--model", args.model]
    env = dict(os.environ)
    runs = []
    for i in range(args.runs):
        for busy in (False, True):
            r = one_run(args.src, argv, busy, env)
            print(f"run {i} {'busy' if busy else 'idle'}: {r}", file=sys.stderr, flush=True)
            runs.append(r)
    idle = [r["tok_s"] for r in runs if not r["busy"]]
    busy = [r["tok_s"] for r in runs if r["busy"]]
    ratio = statistics.median(busy) / statistics.median(idle)
    if args.json:
        print(json.dumps({"label": args.label, "runs": runs, "ratio": ratio}))
    lines = [
        f"{args.label or args.src}: tokens/s idle "
        f"{' '.join(f'{x:.1f}' for x in idle)}, one core busy {' '.join(f'{x:.1f}' for x in busy)}"
        f" (median busy / idle {ratio:.2f}); load averages before each run: "
        + "; ".join(r["load"] for r in runs),
    ]
    print("\n".join(lines))
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
