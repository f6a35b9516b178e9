"""Decode attention alone: the Triton paged kernel's achieved bandwidth by its tuning knobs.

    python benchmarks/paged_attention.py --context 32768 --batch 1 --batch 4
    python benchmarks/paged_attention.py --shape gemma4-full --batch 1

One layer of the Qwen3-30B-A3B shape (32 query heads over 4 KV heads of 128, bf16), or of
Gemma-4's full layers (`gemma4-full`: 16 query heads over 2 KV heads of 512), sequences
of `--context` keys with their pages scattered over the pool; each variant (keys per block,
warps, pipeline stages, programs targeted) is captured in a CUDA graph of 20 calls, as a decode
step replays it (timed calls would measure the host's launches, not the kernel), and the graph
is timed with triton.testing.do_bench (median); the K and V bytes read give its bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import sys

import torch
import triton

from freetoken.kernels import paged_attention as pa
from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import KVSequence, PagedKVCache

# name -> query heads, KV heads, head width, the keys per block swept
SHAPES = {
    "qwen3-30b": (32, 4, 128, (64, 128)),
    "gemma4-full": (16, 2, 512, (16, 32, 64)),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-30b")
    args = ap.parse_args()
    heads, kv_heads, dim, block_ns = SHAPES[args.shape]
    for batch in args.batch or [1, 4]:
        pages = batch * args.context // 16 + 16
        cache = PagedKVCache(1, pages, 16, kv_heads, dim, torch.bfloat16, "cuda")
        every = cache.allocator.alloc(pages)
        random.Random(0).shuffle(every)
        cache.allocator.free(every)
        seqs = [KVSequence() for _ in range(batch)]
        for seq in seqs:
            cache.reserve(seq, args.context)
            seq.length = args.context - 1
        built = ForwardBatch.build(cache, seqs, [[1]] * batch, torch.device("cuda"))
        cache.k[0].normal_()
        cache.v[0].normal_()
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * batch * args.context * kv_heads * dim * 2
        ref = pa.paged_decode_triton(q, cache.k[0], cache.v[0], built, dim**-0.5)
        print(f"batch {batch}, context {args.context}: {nbytes / 1e9:.2f} GB of K and V")
        rows = []
        for block_n, warps, stages, target in itertools.product(
            block_ns, (2, 4, 8), (1, 2, 3), (256, 512)
        ):
            pa.DECODE_TARGET_PROGRAMS = target
            try:
                run = functools.partial(
                    pa.paged_decode_triton,
                    q,
                    cache.k[0],
                    cache.v[0],
                    built,
                    dim**-0.5,
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                )
                out = run()
                err = (out.float() - ref.float()).abs().max().item()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        run()
                ms = (
                    triton.testing.do_bench(graph.replay, warmup=5, rep=30, return_mode="median")
                    / 20
                )
            except Exception as e:  # a configuration the compiler refuses (shared memory)
                print(f"  block {block_n} warps {warps} stages {stages}: {type(e).__name__}")
                continue
            rows.append((ms, block_n, warps, stages, target, err))
        rows.sort()
        for ms, block_n, warps, stages, target, err in rows[:8]:
            print(
                f"  {ms * 1e3:7.1f} us {nbytes / ms / 1e6:7.0f} GB/s  block {block_n} warps "
                f"{warps} stages {stages} programs {target}  max diff {err:.1e}"
            )
        default = [r for r in rows if r[1:5] == (64, 4, 3, 256)] or [
            r for r in rows if r[1] == 64 and r[4] == 256
        ]
        if default:
            print(f"  default-like: {default[0][0] * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
