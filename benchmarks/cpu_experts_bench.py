"""CPU expert bandwidth of the native kernel against torch, over thread counts, alone and while
pinned copies to the GPU run (the B_H and B_H' of the split), with `ft bench bw`'s code.

    python benchmarks/cpu_experts_bench.py --threads 4 8 12 16 --out cpu.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from freetoken.kernels import native
from freetoken.moe.bandwidth import cpu_model, measure
from freetoken.moe.store import ExpertShape

QWEN3_30B_EXPERT = ExpertShape(hidden=2048, intermediate=768, dtype=torch.bfloat16)


def gbs(v):
    return "n/a" if v is None else f"{v / 1e9:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for kernel in ("native", "torch"):
        os.environ[native.DISABLE_ENV] = "1" if kernel == "native" else "0"
        native._loaded.clear()
        for threads in args.threads:
            p = measure(QWEN3_30B_EXPERT, device, seconds=args.seconds, threads=threads)
            row = (
                f"| {kernel} | {threads} | {gbs(p.cpu_experts)} | {gbs(p.cpu_concurrent)} | "
                f"{gbs(p.pcie)} | {gbs(p.pcie_concurrent)} |"
            )
            print(row, flush=True)
            rows.append(row)
    text = "\n".join(
        [
            "# CPU expert kernel: bandwidth by thread count (Qwen3-30B-A3B experts, bf16)",
            "",
            f"- CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; torch {torch.__version__}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "- jobs of 8 experts x 1 token through the real CPU executor (handoff included), "
            "from a 2 GiB pool cycled so weights come from DRAM; 'with copies': while a thread "
            "copies experts to the GPU (pinned)",
            "",
            "| kernel | threads | B_H GB/s | B_H' with copies | B_P GB/s | B_P' with CPU |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
