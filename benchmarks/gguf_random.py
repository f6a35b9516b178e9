"""A random Qwen3-MoE model written straight as a Q8_0 GGUF file, for side-by-side runs on the
same file: llama.cpp reads it as any GGUF, freetoken converts it once (models/gguf.py) with its
experts kept in Q8_0.

llama.cpp's converter would quantize a bf16 checkpoint with numpy (about 0.1 G weights a
second: minutes for a 16-layer Qwen3-30B-A3B shape); speed depends on bytes, not values, so the
Q8_0 blocks here are windows of one shared buffer of random codes with fp16 scales that keep
the weights ~ N(0, 1/K) in size. The norms are ones and the router F32, as llama.cpp keeps them.

    python benchmarks/gguf_random.py OUT.gguf --layers 16 --tokenizer .carry/tokenizer
    python benchmarks/gguf_random.py OUT.gguf --layers 2 --tiny   # a smoke test's file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# the tests' GGUF metadata writer
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_gguf import BYTE_VOCAB, qwen3_writer

BLOCK_BYTES = 34  # Q8_0: an fp16 scale and 32 int8 codes


def q8_0_buffer(blocks: int, cols: int, seed: int = 0) -> np.ndarray:
    """`blocks` Q8_0 blocks of random codes, scales ~ 1 / (64 sqrt(cols)) (|code| ~ 64)."""
    rng = np.random.default_rng(seed)
    buffer = rng.integers(0, 256, blocks * BLOCK_BYTES, dtype=np.uint8).reshape(blocks, -1)
    scales = (rng.random(blocks, dtype=np.float32) + 0.5) / (64 * cols**0.5)
    buffer[:, :2] = scales.astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return buffer


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensors of a qwen3moe model (numpy order: the last dimension is K)."""
    h, d, e, i = (
        cfg["hidden_size"],
        cfg["head_dim"],
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
    )
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = {
        "token_embd.weight": (cfg["vocab_size"], h),
        "output_norm.weight": (h,),
        "output.weight": (cfg["vocab_size"], h),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"blk.{layer}."
        out.update(
            {
                p + "attn_norm.weight": (h,),
                p + "ffn_norm.weight": (h,),
                p + "attn_q.weight": (q, h),
                p + "attn_k.weight": (kv, h),
                p + "attn_v.weight": (kv, h),
                p + "attn_output.weight": (h, q),
                p + "attn_q_norm.weight": (d,),
                p + "attn_k_norm.weight": (d,),
                p + "ffn_gate_inp.weight": (e, h),
                p + "ffn_gate_exps.weight": (e, i, h),
                p + "ffn_up_exps.weight": (e, i, h),
                p + "ffn_down_exps.weight": (e, h, i),
            }
        )
    return out


def write_random_q8_0_gguf(cfg: dict, tokenizer: Path | str, out: Path) -> Path:
    """`tokenizer`: the Qwen tokenizer's directory, or "byte" for the tests' byte-level one (a
    `BYTE_VOCAB`-token `cfg`)."""
    import gguf

    writer = qwen3_writer(cfg, tokenizer, out)
    tensors = shapes(cfg)
    largest = max(int(np.prod(s)) for s in tensors.values()) // 32
    buffer = q8_0_buffer(largest + 4096, cfg["hidden_size"])
    rng = np.random.default_rng(1)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for n, (name, shape) in enumerate(tensors.items()):
        if len(shape) == 1:  # norms: ones
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        elif "ffn_gate_inp" in name:  # the router: F32
            writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * 0.05)
        else:  # a window of the shared blocks (each tensor its own start)
            blocks = int(np.prod(shape)) // 32
            start = (n * 977) % (buffer.shape[0] - blocks + 1)
            data = buffer[start : start + blocks].reshape(*shape[:-1], -1)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> int:
    from decode_offload import qwen3_30b_a3b, tiny

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokenizer", type=Path, help="the Qwen tokenizer's files")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="small shapes and the tests' byte-level tokenizer (a 151k-token vocabulary costs "
        "a smoke test's every write and read seconds)",
    )
    ap.add_argument("--max-context", type=int, default=131072)
    args = ap.parse_args()
    cfg = qwen3_30b_a3b(args.layers)
    if args.tiny:
        cfg, args.tokenizer = {**tiny(args.layers), "vocab_size": BYTE_VOCAB}, "byte"
    elif args.tokenizer is None:
        ap.error("--tokenizer: the Qwen tokenizer's files (or --tiny)")
    cfg["max_position_embeddings"] = args.max_context
    write_random_q8_0_gguf(cfg, args.tokenizer, args.out)
    print(json.dumps({"file": str(args.out), "bytes": args.out.stat().st_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
