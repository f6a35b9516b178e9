"""Give real coding agents one small task against a running `ft serve`, and read back the run.

Each client runs non-interactively through `ft launch`, pointed at a logging proxy
(`logging_proxy.py`) in front of the server, in a scratch git directory, within a time limit
(then its process group is ended: SIGTERM, SIGKILL 20 s later). Afterwards: whether the task
was done (hello.py exists and `greet("World") == "Hello, World"`); from the proxy's log, per
model request: the API, the prompt tokens and the share the prefix cache held, the time to the
first token the client saw, decode tokens/s, the tool calls the model made (name and
arguments, as the server returned them) and any text; from the server's /metrics, over the
run: mean time to first token, decode tokens/s and prompt tokens reused. The clients must be
on PATH (`npm install @anthropic-ai/claude-code @openai/codex opencode-ai`). The table in
benchmarks/results/2026-12-04-real-model-agents.md comes from this script:

    ft serve --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --port 1931 &
    python tests/clients/agent_task.py --server http://127.0.0.1:1931 --out OUTDIR \
        [claude codex opencode] [--timeout 900] [--cap 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

HERE = Path(__file__).resolve().parent
TASK = (
    "Create a file named hello.py containing a function greet(name) that returns 'Hello, ' + name."
)
ARGS = {
    "claude": ["-p", TASK, "--permission-mode", "acceptEdits"],
    "codex": ["exec", "--skip-git-repo-check", "--sandbox", "workspace-write", TASK],
    "opencode": ["run", TASK],
}
MODEL_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")


# -- reading one logged request ---------------------------------------------------------


def sse_events(text: str) -> list[tuple[int, dict]]:
    """(byte offset of the event's end, its JSON data) for each event of a stream."""
    out, offset = [], 0
    for block in text.split("\n\n"):
        offset += len(block.encode()) + 2
        for line in block.splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                with contextlib.suppress(ValueError):  # not JSON: not an event of ours
                    out.append((offset, json.loads(line[5:])))
    return out


def is_token(path: str, event: dict) -> bool:
    """Whether a stream event carries generated text or a tool call's piece."""
    if path == "/v1/messages":
        return event.get("type") == "content_block_delta"
    if path == "/v1/responses":
        return str(event.get("type", "")).endswith(".delta")
    delta = (event.get("choices") or [{}])[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))


def outcome(path: str, stream: bool, text: str) -> dict:
    """Text, tool calls, stop reason and usage of a response, streamed or whole."""
    calls, pieces, usage, stop = [], [], {}, None
    events = [e for _, e in sse_events(text)] if stream else []
    if not stream:
        try:
            events = [json.loads(text)]
        except ValueError:
            return {"error": text[:300]}
    if path == "/v1/messages":
        for e in events:
            kind = e.get("type")
            blocks = e.get("content") if not stream else None
            for b in blocks or []:
                if b.get("type") == "tool_use":
                    calls.append({"name": b["name"], "arguments": b["input"]})
                elif b.get("type") == "text":
                    pieces.append(b["text"])
            if kind == "content_block_start" and e["content_block"]["type"] == "tool_use":
                calls.append({"name": e["content_block"]["name"], "arguments": ""})
            elif kind == "content_block_delta":
                d = e["delta"]
                if d.get("type") == "input_json_delta":
                    calls[-1]["arguments"] += d["partial_json"]
                elif d.get("type") == "text_delta":
                    pieces.append(d["text"])
            usage |= (e.get("message") or {}).get("usage") or e.get("usage") or {}
            stop = (e.get("delta") or {}).get("stop_reason") or e.get("stop_reason") or stop
        prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
        cached, output = usage.get("cache_read_input_tokens", 0), usage.get("output_tokens", 0)
    elif path == "/v1/responses":
        final = {}
        for e in events:
            final = e.get("response") or (e if "output" in e else final)
        for item in final.get("output") or []:
            if item.get("type") == "function_call":
                calls.append({"name": item["name"], "arguments": item["arguments"]})
            for part in item.get("content") or []:
                pieces.append(part.get("text") or "")
        usage, stop = final.get("usage") or {}, final.get("status")
        prompt, output = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    else:
        by_index: dict[int, dict] = {}
        for e in events:
            usage = e.get("usage") or usage
            for c in e.get("choices") or []:
                d = c.get("delta") or c.get("message") or {}
                pieces.append(d.get("content") or "")
                for i, t in enumerate(d.get("tool_calls") or []):
                    call = by_index.setdefault(t.get("index", i), {"name": "", "arguments": ""})
                    call["name"] += t["function"].get("name") or ""
                    call["arguments"] += t["function"].get("arguments") or ""
                stop = c.get("finish_reason") or stop
        calls = list(by_index.values())
        prompt, output = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for call in calls:
        if isinstance(call["arguments"], str):
            with contextlib.suppress(ValueError):  # else shown as written
                call["arguments"] = json.loads(call["arguments"] or "{}")
    return {
        "text": "".join(pieces),
        "tool_calls": calls,
        "stop": stop,
        "prompt": prompt,
        "cached": cached,
        "output": output,
    }


def read_request(record: dict) -> dict:
    body = record.get("body") or {}
    stream, path = bool(body.get("stream")), record["path"]
    out = {
        "n": record["n"],
        "api": path,
        "status": record["status"],
        "stream": stream,
        "tools": len(body.get("tools") or []),
        "seconds": record["t_end"] - record["t"],
    }
    if record["status"] != 200:
        return out | {"error": record["response"][:300]}
    out |= outcome(path, stream, record["response"])
    arrivals = record.get("arrivals") or []
    if stream and arrivals:
        # The first token the client saw. An untagged tool call (parsers/untagged.py) is held
        # to the end of the reply and arrives whole: no decode rate from such a reply.
        tokens = [end for end, e in sse_events(record["response"]) if is_token(path, e)]
        when = [t for t, size in arrivals if tokens and size >= tokens[0]]
        if when:
            out["ttft"] = when[0]
            span = arrivals[-1][0] - when[0]
            if len(tokens) > 2 and out.get("output", 0) > 1 and span > 0:
                out["decode_tps"] = (out["output"] - 1) / span
    return out


def read_log(outdir: Path) -> list[dict]:
    records = [json.loads(p.read_text()) for p in sorted(outdir.glob("[0-9]*.json"))]
    records = [r for r in records if r["method"] == "POST" and r["path"] in MODEL_PATHS]
    return [read_request(r) for r in sorted(records, key=lambda r: r["t"])]


# -- running one client -----------------------------------------------------------------


def metrics(server: str) -> dict[str, float]:
    """The server's Prometheus counters (name -> value), read straight from it."""
    with urlopen(server + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    pairs = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs if "{" not in name}


def server_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server measured over the run: decode tokens/s (tokens over the time between
    them) and the prompt tokens the prefix cache held."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    out = {"requests": delta.get("freetoken_request_duration_seconds_count", 0.0)}
    if delta.get("freetoken_inter_token_latency_seconds_sum"):
        out["decode_tps"] = (
            delta["freetoken_inter_token_latency_seconds_count"]
            / delta["freetoken_inter_token_latency_seconds_sum"]
        )
    reused = delta.get("freetoken_prompt_tokens_reused_total", 0.0)
    total = reused + delta.get("freetoken_prompt_tokens_recomputed_total", 0.0)
    out |= {"prompt_tokens": total, "reused_tokens": reused}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            urlopen(url, timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def end_group(process: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the process's group (the client and what it started), SIGKILL after grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def task_done(workdir: Path) -> str:
    path = workdir / "hello.py"
    if not path.exists():
        return "no hello.py"
    check = "import hello; assert hello.greet('World') == 'Hello, World'"
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=workdir, capture_output=True, text=True, timeout=30
    )
    return "done" if done.returncode == 0 else "hello.py wrong: " + done.stderr.strip()[-200:]


def run_client(client: str, server: str, outdir: Path, timeout: float, cap: int) -> dict:
    outdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "logging_proxy.py"),
            "--upstream",
            server,
            "--port",
            str(port),
            str(outdir),
        ],
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(url + "/health")
        workdir = Path(tempfile.mkdtemp(prefix=f"ft-agent-{client}-"))
        subprocess.run(["git", "init", "-q", str(workdir)], check=True)
        command = [
            sys.executable,
            "-m",
            "freetoken.cli.main",
            "launch",
            "--url",
            url,
            "--max-output-tokens",
            str(cap),
            client,
            *ARGS[client],
        ]
        # OpenCode takes its working directory from $PWD, not from the process's own.
        env = os.environ | {"PWD": str(workdir)}
        before = metrics(server)
        start = time.time()
        with open(outdir / "client.log", "w") as log:
            process = subprocess.Popen(
                command,
                cwd=workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                status = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                end_group(process)
                status = f"stopped after {timeout:.0f} s"
        seconds = time.time() - start
        time.sleep(1)  # the proxy writes a request's record as its response ends
        measured = server_side(before, metrics(server))
    finally:
        end_group(proxy, grace=10)  # it waits for open streams: a client killed mid-reply
    summary = {
        "client": client,
        "exit": status,
        "seconds": round(seconds, 1),
        "task": task_done(workdir),
        "workdir": str(workdir),
        "files": sorted(p.name for p in workdir.iterdir() if p.name != ".git"),
        "server": measured,
        "requests": read_log(outdir),
    }
    (outdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def show(summary: dict) -> None:
    reqs = summary["requests"]
    print(
        f"{summary['client']}: {summary['task']}; exit {summary['exit']} in "
        f"{summary['seconds']:.0f} s; {len(reqs)} model requests; "
        f"files {summary['files']}"
    )
    measured = summary.get("server") or {}
    if measured.get("requests"):
        share = measured["reused_tokens"] / max(1.0, measured["prompt_tokens"])
        print(
            f"  server: {measured['requests']:.0f} requests, decode "
            f"{measured.get('decode_tps', 0):.2f} tok/s, prompt tokens "
            f"{measured['prompt_tokens']:.0f} ({share:.1%} reused)"
        )
    for r in reqs:
        if "error" in r:
            print(f"  #{r['n']} {r['api']} {r['status']}: {r['error'][:200]}")
            continue
        share = r["cached"] / r["prompt"] if r["prompt"] else 0.0
        timing = f"{r['seconds']:.1f} s"
        timing += f", first token seen at {r['ttft']:.1f} s" if "ttft" in r else ""
        timing += f", {r['decode_tps']:.2f} tok/s" if "decode_tps" in r else ""
        if "decode_tps" not in r and r["output"] > 1 and measured.get("decode_tps"):
            # A reply that came whole (a held call): what its tokens took at the run's decode
            # rate was not prefill. (The run's rate is low where requests overlapped: a long
            # prefill step stalls the other's decode.)
            first = r["seconds"] - (r["output"] - 1) / measured["decode_tps"]
            timing += f", first token at ~{first:.1f} s"
        print(
            f"  #{r['n']} {r['api']} tools={r['tools']} prompt {r['prompt']} (cached "
            f"{share:.1%}) out {r['output']} stop {r['stop']}; {timing}"
        )
        for call in r["tool_calls"]:
            print(f"    call {call['name']}({json.dumps(call['arguments'])[:300]})")
        if r["text"].strip():
            print(f"    text {json.dumps(r['text'][:300])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clients", nargs="*", default=list(ARGS))
    parser.add_argument("--server", default="http://127.0.0.1:1919", help="the ft serve")
    parser.add_argument("--out", type=Path, required=True, help="logs and summaries go here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per client")
    parser.add_argument("--cap", type=int, default=1024, help="output tokens per request")
    parser.add_argument("--read", action="store_true", help="only read back OUT/CLIENT's logs")
    args = parser.parse_args()
    for client in args.clients:
        if args.read:
            summary = json.loads((args.out / client / "summary.json").read_text())
            summary["requests"] = read_log(args.out / client)
        else:
            summary = run_client(client, args.server, args.out / client, args.timeout, args.cap)
        show(summary)


if __name__ == "__main__":
    main()
