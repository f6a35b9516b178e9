"""Greedy tokens of one GGUF file from freetoken and from llama.cpp (llama-cpp-python), on the
same prompts, and the two tokenizers' ids for them.

    python3 -m venv /tmp/lcpp && /tmp/lcpp/bin/pip install --no-binary llama-cpp-python \
        llama-cpp-python==0.3.36                      # built here, from its sdist
    python benchmarks/gguf_vs_llama_cpp.py FILE.gguf --llama-python /tmp/lcpp/bin/python \
        [--tokens 32] [--out result.md]

Or, without building: llama-cpp-python's `llama_cpp` package (from the sdist) copied into a venv
with numpy, typing-extensions, diskcache and jinja2, over the llama.cpp libraries prebuilt from
the same sdist (shared/tools/llama.cpp), with LD_LIBRARY_PATH and LLAMA_CPP_LIB_PATH set to
their folder. `gguf_f32_copy.py` makes an F32 copy of a file, where llama.cpp does not round
the activations to 8 bits as its quantized kernels do.

llama.cpp runs in its own process, under that interpreter (llama-cpp-python and torch in one
process crashed here). Each prompt is tokenized by both; the ids llama.cpp makes are then given
to both models, so a difference in the generated ids is the models' (freetoken computes with the
dequantized weights in fp32, llama.cpp with the quantized blocks and its own kernels: near ties
can go either way).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from freetoken.config import EngineConfig, MoEOptions
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Here is a list of three fruits:",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


LLAMA_CPP = """
import json, sys
from llama_cpp import Llama
path, n, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
llm = Llama(path, n_ctx=1024, n_threads=2, verbose=False)
out = []
for prompt in prompts:
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    llm.reset()
    gen = []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
        if token == llm.token_eos() or len(gen) == n:
            break
        gen.append(token)
    out.append({"ids": ids, "greedy": gen, "text": llm.detokenize(gen).decode(errors="replace")})
print(json.dumps(out))
"""


def llama_cpp_greedy(python: str, path: Path, n: int) -> list[dict]:
    done = subprocess.run(
        [python, "-c", LLAMA_CPP, str(path), str(n), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def freetoken_greedy(engine: LLMEngine, ids: list[int], n: int) -> list[int]:
    req = engine.add_request(ids, SamplingParams(max_new_tokens=n, temperature=0.0))
    while not req.finished:
        engine.step()
    return [t for t in req.output_ids if t not in engine.tokenizer.eos_token_ids]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--llama-python", default=sys.executable, help="a Python with llama-cpp-python installed"
    )
    args = ap.parse_args()
    theirs = llama_cpp_greedy(args.llama_python, args.gguf, args.tokens)
    engine = LLMEngine.from_config(
        EngineConfig(
            model=args.gguf,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=2048,
            moe=MoEOptions("fused"),
        )
    )
    lines = [
        f"# {args.gguf.name}: freetoken (fp32, dequantized) against llama-cpp-python, "
        f"greedy, {args.tokens} tokens; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| prompt | same ids in | same greedy tokens | first difference at |",
        "|---|---|---|---|",
    ]
    same_all = True
    for prompt, their in zip(PROMPTS, theirs, strict=True):
        ours_ids = engine.tokenizer.encode(prompt)
        a = their["greedy"]
        b = freetoken_greedy(engine, their["ids"], args.tokens)
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        same_all &= first is None and ours_ids == their["ids"]
        lines.append(
            f"| {prompt[:40]!r} | {'yes' if ours_ids == their['ids'] else 'no'} | "
            f"{'yes' if first is None else 'no'} ({len(a)} / {len(b)}) | "
            f"{'-' if first is None else first} |"
        )
        print(
            repr(prompt),
            "\n  llama.cpp:",
            repr(their["text"]),
            "\n  freetoken:",
            repr(engine.tokenizer.decode(b)),
            flush=True,
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
