"""Where a real GGUF model's decode step goes on the GPU: the torch profiler's kernel table over
greedy decode steps of a chat prompt (the model's own routing), for one strategy and cache size.

    python benchmarks/profile_gguf.py FILE.gguf [--strategy hybrid --cache 96] [--steps 32]
"""

from __future__ import annotations

import argparse

from real_models import CHAT, engine_for, timed_generate
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--strategy", default="fused")
    ap.add_argument("--cache")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    engine = engine_for(args.file, args.device, "bfloat16", args.strategy, args.cache)
    tok = engine.tokenizer
    ids = tok.encode(tok.render_chat(CHAT))
    timed_generate(engine, ids, 16)  # warm: graphs captured, caches filled
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = timed_generate(engine, ids, args.steps)
    print(f"{args.steps} tokens in {seconds * 1e3:.1f} ms (prefill included)")
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60
        )
    )


if __name__ == "__main__":
    main()
