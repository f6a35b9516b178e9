"""Prompt and decode speed of real GGUF files, freetoken beside llama.cpp's llama-bench on the
same file and machine (issue 41's side-by-side table).

    python benchmarks/real_models.py FILE.gguf [FILE.gguf ...] --device cpu \\
        --llama-bench /tmp/lb/bin/llama-bench [--cached 0.25 --cached 0.5] [--out res.md]

For each file: freetoken decodes greedily from a real chat prompt (the file's own template) and
prefills a real text (a standard-library Python file, `--prompt-tokens` of it), llama-bench runs
`-p` and `-n` with the same counts. A file with routed experts (an MoE, e.g. one made by `ft
checkpoint moe-from-dense`) is also measured with `--cached` fractions of its experts in the
cache (hybrid on CUDA; the cache tier is the host's own memory on a CPU-only machine, where only
`fused` means anything and the fractions are skipped) against llama-bench `-ncmoe N`, N the
layers whose experts stay on the CPU so that the same fraction of the expert bytes is on the GPU.

freetoken's decode is timed as (t(warm + n) - t(warm)) / n over two greedy generations from the
same prompt, the prefix cache off, so prefill and the first steps' graph captures are not
counted; its prefill as one forward of the text after a warm-up. Each figure is the best of
`--rounds`. Routing is the model's own (a real prompt decoded), which a cache exploits; llama.cpp's
`-ncmoe` placement is static and the same whatever the routing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from freetoken.config import EngineConfig, MoEOptions
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams
from freetoken.models import gguf, gguf_header

QUESTION = (
    "Write a Python function that checks whether a string is a palindrome, with a "
    "docstring and two examples."
)
CHAT = [{"role": "user", "content": QUESTION}]


def real_text() -> str:
    """A real text every machine has: a standard-library module's source."""
    return Path(inspect.getsourcefile(textwrap)).read_text()


def engine_for(path, device: str, dtype: str, strategy: str, cache: str | None):
    config = EngineConfig(
        model=gguf.resolve(path),
        dtype=dtype,
        device=device,
        kv_cache_tokens=4096,
        max_model_len=4096,
        prefix_cache=False,
        max_batch_size=1,
        moe=MoEOptions(strategy=strategy, cache_size=cache),
        # llama-bench's decode drafts nothing: compare one token a step (issue 46 measures
        # drafting on its own workloads)
        speculative="off",
    )
    return LLMEngine.from_config(config)


def timed_generate(engine, ids: list[int], n: int) -> float:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([ids], params)
    return time.perf_counter() - start


def freetoken_speed(engine, prompt_tokens: int, decode_tokens: int, rounds: int) -> dict:
    tok = engine.tokenizer
    chat = tok.encode(tok.render_chat(CHAT) if tok.has_chat_template else CHAT[0]["content"])
    text = tok.encode(real_text())[:prompt_tokens]
    warm = 8
    timed_generate(engine, chat, warm + 8)  # graphs, caches, the CPU team: warm
    decode, prefill = [], []
    for _ in range(rounds):
        short = timed_generate(engine, chat, warm)
        long = timed_generate(engine, chat, warm + decode_tokens)
        decode.append(decode_tokens / (long - short))
        prefill.append(len(text) / timed_generate(engine, text, 1))
    return {"decode_tok_s": max(decode), "prefill_tok_s": max(prefill)}


def llama_bench(
    binary: str,
    path: Path,
    device: str,
    threads: int,
    prompt_tokens: int,
    decode_tokens: int,
    rounds: int,
    ncmoe: int | None,
) -> dict:
    cmd = [
        binary,
        "-m",
        str(path),
        "-p",
        str(prompt_tokens),
        "-n",
        str(decode_tokens),
        "-r",
        str(rounds),
        "-t",
        str(threads),
        "-o",
        "json",
    ]
    if device == "cuda":
        cmd += ["-ngl", "99"]
        if ncmoe:
            cmd += ["-ncmoe", str(ncmoe)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1:]}
    rows = json.loads(out.stdout)
    found = {}
    for row in rows:
        key = "prefill_tok_s" if row["n_prompt"] else "decode_tok_s"
        found[key] = row["avg_ts"]
    return found


def moe_layers(path: Path) -> int:
    """The number of layers with routed experts in a GGUF file (0 for a dense one)."""
    types = gguf_header.read(path).tensor_types
    return len({name.split(".")[1] for name in types if "_exps." in name})


def experts(path: Path) -> int:
    """Routed experts per layer of a GGUF file."""
    header = gguf_header.read(path)
    return int(header.metadata[f"{header.architecture}.expert_count"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--llama-bench")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cached", type=float, action="append", help="fractions of the experts")
    ap.add_argument("--strategy", default="hybrid", help="freetoken's, for the --cached rows")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for path in args.files:
        layers = moe_layers(path)
        runs = [("all", None, None)]
        if layers and args.device == "cuda":
            runs += [(f"{f:.0%} cached", f, round(layers * (1 - f))) for f in args.cached or []]
        for label, fraction, ncmoe in runs:
            strategy, cache = "fused", None
            if fraction is not None:  # (slots: every layer's experts, `layers` x E)
                strategy, cache = args.strategy, str(round(layers * experts(path) * fraction))
            engine = engine_for(path, args.device, args.dtype, strategy, cache)
            ours = freetoken_speed(engine, args.prompt_tokens, args.decode_tokens, args.rounds)
            del engine
            theirs = {}
            if args.llama_bench:
                theirs = llama_bench(
                    args.llama_bench,
                    path,
                    args.device,
                    args.threads,
                    args.prompt_tokens,
                    args.decode_tokens,
                    args.rounds,
                    ncmoe,
                )
            row = {
                "file": path.name,
                "placement": label,
                "strategy": strategy,
                "cache": cache,
                "ncmoe": ncmoe,
                "freetoken": ours,
                "llama.cpp": theirs,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        "| file | experts | freetoken decode | llama.cpp decode | ratio | freetoken prefill "
        "| llama.cpp prefill | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["freetoken"], r["llama.cpp"]

        def ratio(key, a=a, b=b):
            return f"{a[key] / b[key]:.2f}x" if b.get(key) else "-"

        lines.append(
            f"| {r['file']} | {r['placement']} | {a['decode_tok_s']:.1f} | "
            f"{b.get('decode_tok_s', 0):.1f} | {ratio('decode_tok_s')} | "
            f"{a['prefill_tok_s']:.0f} | {b.get('prefill_tok_s', 0):.0f} | "
            f"{ratio('prefill_tok_s')} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n\n" + "\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    sys.exit(main())
