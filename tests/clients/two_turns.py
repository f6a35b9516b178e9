"""Run real coding agents for two turns of one session against a running `ft serve`.

Each client goes through `ft launch` with nothing but an output cap (the demo model's noise
never ends a reply); what every request reused of its prompt is read from /v1/stats. The
clients must be on PATH (`npm install @anthropic-ai/claude-code @openai/codex opencode-ai`).
The figures in docs/agents.md come from this script:

    ft serve &            # the demo model, or --model DIR
    python tests/clients/two_turns.py [claude codex opencode] [--url URL] [--cap 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from urllib.request import urlopen

TURNS = {
    "claude": (["-p", "Say hello"], ["-p", "--continue", "Now say goodbye"]),
    "codex": (
        ["exec", "--skip-git-repo-check", "Say hello"],
        ["exec", "--skip-git-repo-check", "resume", "--last", "Now say goodbye"],
    ),
    "opencode": (["run", "Say hello"], ["run", "--continue", "Now say goodbye"]),
}


def reuse(url: str) -> dict:
    with urlopen(url + "/v1/stats") as r:
        return json.load(r)["prefix_reuse"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clients", nargs="*", default=list(TURNS))
    parser.add_argument("--url", default="http://127.0.0.1:1919")
    parser.add_argument("--cap", type=int, default=64, help="output tokens per request")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="ft-agents-")
    subprocess.run(["git", "init", "-q", workdir], check=True)
    for client in args.clients:
        for turn, client_args in enumerate(TURNS[client], 1):
            seen = reuse(args.url)["requests"]
            command = [
                "ft",
                "launch",
                "--url",
                args.url,
                "--max-output-tokens",
                str(args.cap),
                client,
                *client_args,
            ]
            start = time.time()
            # OpenCode takes its working directory from $PWD, not from the process's own.
            env = os.environ | {"PWD": workdir}
            done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
            after = reuse(args.url)
            requests = after["recent"][len(after["recent"]) - (after["requests"] - seen) :]
            print(
                f"{client} turn {turn}: exit {done.returncode} in {time.time() - start:.0f} s,"
                f" {len(requests)} requests"
            )
            for r in requests:
                share = r["reused_tokens"] / r["prompt_tokens"]
                print(
                    f"  prompt {r['prompt_tokens']:6d}  reused {r['reused_tokens']:6d}"
                    f"  ({share:.1%})"
                )
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-2000:])


if __name__ == "__main__":
    main()
