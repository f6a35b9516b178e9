"""`ft checkpoint convert SRC DST`: a safetensors checkpoint written as freetoken's weight
directory (weights/weight_dir.py), which `ft serve --model DST` starts from faster."""

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
    print(f"wrote {dst}: {gib(weights.nbytes)} of {weights.meta['dtype']} weights in "
          f"{seconds:.1f} s; serve it with `ft serve --model {dst}`")  # fmt: skip
    return 0
