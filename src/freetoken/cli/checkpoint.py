"""`ft checkpoint convert SRC DST`: a safetensors checkpoint written as freetoken's weight
directory (weights/weight_dir.py), which `ft serve --model DST` starts from faster.
`ft checkpoint moe-from-dense SRC.gguf DST.gguf`: a dense GGUF model made into an MoE with the
same output (models/moe_from_dense.py)."""

from __future__ import annotations

import argparse
import time

from freetoken.weights.memory import gib


def convert(args: argparse.Namespace) -> int:
    from freetoken.models.loading import convert_checkpoint
    from freetoken.weights.weight_dir import WeightDir

    start = time.perf_counter()
    dst = convert_checkpoint(
        args.src, args.dst, args.dtype, dequantize_experts=args.dequantize_experts
    )
    weights = WeightDir(dst)
    seconds = time.perf_counter() - start
    print(
        f"wrote {dst}: {gib(weights.nbytes)} of {weights.meta['dtype']} weights in "
        f"{seconds:.1f} s; serve it with `ft serve --model {dst}`"
    )
    return 0


def moe_from_dense(args: argparse.Namespace) -> int:
    from freetoken.errors import CheckpointError
    from freetoken.models import moe_from_dense

    start = time.perf_counter()
    try:
        text = args.text.read_text() if args.text is not None else None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read the fitting text {args.text}: {e}") from e
    dst = moe_from_dense.convert(args.src, args.dst, args.experts, args.top_k, text=text)
    seconds = time.perf_counter() - start
    print(
        f"wrote {dst}: {gib(dst.stat().st_size)}, qwen2moe with {args.experts} experts a "
        f"layer (copies of {args.src.name}'s MLPs), top-{args.top_k}, in {seconds:.1f} s; "
        f"serve it with `ft serve --model {dst}`"
    )
    return 0
