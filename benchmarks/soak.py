"""Soak `ft serve`: many clients over the three APIs for minutes, a share of streams cancelled
mid-answer, the server's resident memory sampled throughout.

    python benchmarks/soak.py --minutes 10 --clients 16 --cancel 0.2 --out soak.md

Starts `ft serve` (the demo model unless `--model`) as a subprocess, as a user would. Each
client loops: it picks an API (chat completions, messages, responses), streaming or not, sends
a conversation that shares a prefix with the others' (so the prefix cache takes and evicts
pages all along), and for `--cancel` of its streams closes the connection after a few events.
An error is any answer that is not a 200 with its API's complete shape: a status, a stream
without its terminal event, a stream error event, a dropped connection. Resident memory is
VmRSS from /proc/PID/status every `--sample-s` seconds; its drift is the mean of the last
minute against the mean of the first minute after `--warmup-s`. At the end the server must
hold no request and no KV page outside the prefix cache.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

import httpx
from server_process import free_port, stop

APIS = ("chat", "messages", "responses")
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "tests",
    "file",
    "path",
    "error",
    "value",
    "import",
    "class",
    "return",
]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def conversation(rng: random.Random) -> list[dict]:
    """A shared system prompt, then a few turns of its own."""
    system = "You are a careful coding agent. " + " ".join(WORDS * 8)
    turns = [{"role": "system", "content": system}]
    for _ in range(rng.randint(0, 3)):
        turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=12))})
        turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=8))})
    turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))})
    return turns


def request(api: str, model: str, messages: list[dict], tokens: int, stream: bool):
    if api == "chat":
        return "/v1/chat/completions", {
            "model": model,
            "messages": messages,
            "max_tokens": tokens,
            "stream": stream,
        }
    if api == "messages":
        return "/v1/messages", {
            "model": model,
            "system": messages[0]["content"],
            "messages": messages[1:],
            "max_tokens": tokens,
            "stream": stream,
        }
    return "/v1/responses", {
        "model": model,
        "instructions": messages[0]["content"],
        "input": messages[1:],
        "max_output_tokens": tokens,
        "stream": stream,
    }


TERMINAL = {
    "chat": ("data: [DONE]",),
    "messages": ("event: message_stop",),
    "responses": ("event: response.completed", "event: response.incomplete"),
}
STREAM_ERRORS = ("event: error", "event: response.failed")  # and OpenAI's {"error": ...} chunk


def whole_answer_ok(api: str, body: dict) -> bool:
    if api == "chat":
        return body["choices"][0]["message"]["content"] is not None
    if api == "messages":
        return body["type"] == "message" and body["content"] is not None
    return body["status"] in ("completed", "incomplete")


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.errors: list[str] = []

    def add(self, key: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if error is not None:
                self.counts["errors"] += 1
                if len(self.errors) < 20:
                    self.errors.append(error)


def client(base: str, model: str, seed: int, until: float, cancel: float, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=300) as http:
        while time.monotonic() < until:
            api, stream = rng.choice(APIS), rng.random() < 0.7
            path, body = request(api, model, conversation(rng), rng.randint(8, 48), stream)
            try:
                if not stream:
                    r = http.post(path, json=body)
                    ok = r.status_code == 200 and whole_answer_ok(api, r.json())
                    error = None if ok else f"{api}: {r.status_code} {r.text[:200]}"
                    tally.add(f"{api} whole", error)
                    continue
                cut = rng.randint(2, 6) if rng.random() < cancel else None
                with http.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        tally.add(f"{api} stream", f"{api} stream: {r.status_code}")
                        continue
                    lines = []
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                        if cut is not None and len(lines) >= cut:
                            break
                if cut is not None and len(lines) >= cut:
                    tally.add(f"{api} cancelled")
                    continue
                failed = not any(line in TERMINAL[api] for line in lines) or any(
                    line.startswith('data: {"error"') or line in STREAM_ERRORS for line in lines
                )
                tally.add(f"{api} stream", f"{api} stream: {lines[-2:]}"[:300] if failed else None)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                tally.add(f"{api} dropped", f"{api}: {type(e).__name__}: {e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--cancel", type=float, default=0.2, help="share of streams cut short")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--model", default="random-demo", help="default: the random demo (offline)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    port, model = free_port(), "soak"
    command = [
        sys.executable,
        "-m",
        "freetoken.cli.main",
        "serve",
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--served-model-name",
        model,
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
        "--max-queued-requests",
        str(4 * args.clients),
    ]
    if args.model:
        command[4:4] = ["--model", args.model]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"ft serve exited: {server.stderr.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("ft serve did not come up in 300 s")
            time.sleep(0.5)

        start = time.monotonic()
        until = start + args.minutes * 60
        tally = Tally()
        threads = [
            threading.Thread(target=client, args=(base, model, i, until, args.cancel, tally))
            for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        samples: list[tuple[float, int]] = []
        health: list[float] = []
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic() - start, rss_bytes(server.pid)))
            t0 = time.perf_counter()
            httpx.get(base + "/health", timeout=30)
            health.append(time.perf_counter() - t0)
            time.sleep(args.sample_s)
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        time.sleep(1.0)  # cancelled requests end at the next engine step
        stats = httpx.get(base + "/v1/stats").json()
        samples.append((time.monotonic() - start, rss_bytes(server.pid)))
    finally:
        stop(server, timeout=30)

    first = [r for t, r in samples if args.warmup_s <= t < args.warmup_s + 60]
    last = [r for t, r in samples if t >= samples[-1][0] - 60]
    drift = statistics.mean(last) / statistics.mean(first) - 1
    leftover = stats["requests"]["running"] + stats["requests"]["queued"]
    leftover_pages = stats["kv_pages"]["used"]
    counts = tally.counts
    answered = sum(v for k, v in counts.items() if k != "errors")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    mib = 2**20
    mib = 2**20
    lines = [
        f"Soak of `ft serve` ({args.model or 'demo model'}, {args.device}, {args.dtype}): "
        f"{args.clients} clients for {elapsed / 60:.1f} min, {args.cancel:.0%} of streams cut "
        f"short; {platform.node()}, {os.cpu_count()} cores, {date.today()}, commit {commit}.",
        "",
        "| requests | errors | cancelled | tokens decoded | RSS after warm-up | RSS at the end "
        "| RSS max | drift (last min / first min) | /health max | left running/queued "
        "| KV pages held by requests |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {answered} | {counts['errors']} | "
        f"{sum(v for k, v in counts.items() if k.endswith('cancelled'))} | "
        f"{stats['tokens']['decode']} | {first[0] / mib:.0f} MiB | {samples[-1][1] / mib:.0f} MiB "
        f"| {max(r for _, r in samples) / mib:.0f} MiB | {drift:+.1%} | "
        f"{max(health) * 1000:.0f} ms "
        f"| {leftover} | {leftover_pages} |",
        "",
        "By API: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "errors"),
    ]
    if tally.errors:
        lines += ["", "First errors:", *[f"- {e}" for e in tally.errors]]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if counts["errors"] == 0 and leftover == 0 and leftover_pages == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
