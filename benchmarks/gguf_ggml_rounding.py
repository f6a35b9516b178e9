"""An experiment on why a quantized GGUF's greedy tokens differ between freetoken and llama.cpp:
freetoken run with llama.cpp's roundings emulated, against llama-cpp-python, as
`gguf_vs_llama_cpp.py` runs them (same prompts, same ids in).

    python benchmarks/gguf_ggml_rounding.py FILE.gguf --llama-python PY [--tokens 32]
        [--round none|activations|activations+qkv] [--attention native|explicit]

The roundings llama.cpp's CPU path makes and freetoken's fp32 path does not:
- `activations`: every product with quantized weights first rounds its input to 8-bit blocks
  of 32 (ggml's Q8_0 and Q8_1: a block's scale its largest magnitude / 127 held in fp16, each
  value its nearest multiple). The file this was made for (SmolLM2 Q4_1) has every matrix
  quantized, so every product is rounded here;
- `qkv`: queries, keys and values in fp16 (llama.cpp's KV cache is fp16; its attention
  products convert the queries to the keys' type).
`--attention explicit` computes attention by its explicit fp32 products on every step
(freetoken's own path: SDPA for prompts, the native kernel for decode; the two differ from
each other by about 2e-5 in this file's logits). Monkeypatches the engine: an experiment,
not a mode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import freetoken.kernels.paged_attention as paged_attention
import freetoken.layers.attention as attention
import freetoken.layers.linear as linear
import freetoken.models.decoder as decoder
from freetoken.config import EngineConfig, MoEOptions
from freetoken.engine.generate import LLMEngine
from freetoken.kv.paged import PagedKVCache

sys.path.insert(0, str(Path(__file__).parent))
from gguf_vs_llama_cpp import PROMPTS, freetoken_greedy, llama_cpp_greedy

BLOCK = 32


def ggml_q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ggml's quantize_row_q8_0/q8_1 round it, blocks of 32 along the last dim."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inverse)  # (ggml's AVX-512 path rounds half to even too)
    return (codes * scale.half().float()).reshape(x.shape).to(x.dtype)


def emulate(rounding: str, explicit_attention: bool) -> None:
    if "activations" in rounding:
        exact = linear.linear

        def rounded(x, weight, bias=None):
            return exact(ggml_q8(x), weight, bias)

        linear.linear = decoder.linear = rounded
    if "qkv" in rounding:
        rotary, write = attention.apply_rotary, PagedKVCache.write
        attention.apply_rotary = lambda x, cos, sin: rotary(x, cos, sin).half().float()
        PagedKVCache.write = lambda self, layer, slots, k, v: write(
            self, layer, slots, k.half().float(), v.half().float()
        )
    if explicit_attention:
        paged_attention.cpu_decode_takes = lambda q, k_pool: False

        def explicit(q, k, v, scale, mask=None):
            n, length = q.shape[2], k.shape[2]
            if mask is None:
                keys, queries = torch.arange(length), torch.arange(length - n, length)
                mask = keys[None, :] <= queries[:, None]
            return paged_attention._explicit_attention(q, k, v, mask, scale, None)

        paged_attention.causal_attention = explicit


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llama-python", default=sys.executable)
    ap.add_argument(
        "--round", default="activations+qkv", choices=["none", "activations", "activations+qkv"]
    )
    ap.add_argument("--attention", default="native", choices=["native", "explicit"])
    args = ap.parse_args()
    theirs = llama_cpp_greedy(args.llama_python, args.gguf, args.tokens)
    emulate(args.round, args.attention == "explicit")
    config = EngineConfig(
        model=args.gguf,
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        moe=MoEOptions("fused"),
    )
    engine = LLMEngine.from_config(config)
    same = 0
    for prompt, their in zip(PROMPTS, theirs, strict=True):
        ours = freetoken_greedy(engine, their["ids"], args.tokens)
        same += ours == their["greedy"]
        print(f"{prompt[:30]!r}: {'same' if ours == their['greedy'] else 'differs'}", flush=True)
    print(
        f"round={args.round} attention={args.attention}: {same} / {len(PROMPTS)} prompts give "
        "llama.cpp's greedy tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
