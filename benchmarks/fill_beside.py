"""Cache fills beside other GPU work: what the fill kernel's grid costs the work running at the
same time, and what the cap on its programs (kernels/expert_fill.py FILL_PROGRAMS) costs the
fill.

    PYTHONPATH=src python benchmarks/fill_beside.py [--programs 0 256 64 32] [--out fill.md]

A fill waits on PCIe, but one program a 16 KiB block puts ~830 programs of 8 warps on the SMs for
a 13 MiB expert (DeepSeek-V4-Flash's MXFP4), for the whole copy. Work beside it (hybrid's shared
expert during a layer's fills, the next layer's attention during a prefetch, moe/prefetch.py)
then waits for warp slots. For each cap (0: uncapped, one program a block) this times, with
CUDA events, the median of 7 rounds of:
- a fill of `--experts` experts from mapped pinned memory alone (GB/s);
- a chain of small GEMMs and elementwise kernels alone (a decode layer's dense work at batch 1:
  `--chain` rounds of a 4096 x 1024 and a 1024 x 4096 bf16 GEMV, an RMS norm and a product);
- both at once on two streams: the fill's GB/s and the chain's time beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from expert_fill_bench import timed

from freetoken.kernels import expert_fill
from freetoken.kernels.expert_fill import HostRows, fill_experts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, nargs="+", default=[0, 256, 128, 64, 32, 16])
    ap.add_argument("--expert-mib", type=float, default=13.3, help="an expert's bytes")
    ap.add_argument("--experts", type=int, default=4, help="experts a fill copies")
    ap.add_argument("--chain", type=int, default=40, help="rounds of the dense chain")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    row = int(args.expert_mib * 2**20) // 16 * 16
    pool = torch.randint(0, 256, (16, row), dtype=torch.uint8).pin_memory()
    cache = torch.zeros(8, row, dtype=torch.uint8, device=device)
    banks = [(cache, HostRows(pool))]
    sink = cache.shape[0]
    slots = torch.full((16,), sink, dtype=torch.long, device=device)
    slots[: args.experts] = torch.arange(args.experts, device=device)
    pairs = [torch.randperm(16, device=device) for _ in range(4)]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)
    w_down = torch.randn(1024, 4096, dtype=torch.bfloat16, device=device) * 0.01
    w_up = torch.randn(4096, 1024, dtype=torch.bfloat16, device=device) * 0.01
    scale = torch.ones(4096, dtype=torch.bfloat16, device=device)

    def chain():
        h = x
        for _ in range(args.chain):
            h = torch.nn.functional.linear(torch.nn.functional.linear(h, w_down), w_up)
            h = h * torch.rsqrt(h.float().square().mean(-1, keepdim=True) + 1e-6).to(h.dtype)
            h = h * scale

    turn = iter(range(10**9))

    def fill():
        fill_experts(banks, pairs[next(turn) % len(pairs)], slots, sink)

    side = torch.cuda.Stream(device)
    fill_bytes = args.experts * row
    lines = [
        "# fill_beside: a fill's programs against the work beside it",
        "",
        f"- GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}",
        f"- a fill of {args.experts} experts of {row / 2**20:.1f} MiB from mapped pinned memory; "
        f"the chain: {args.chain} rounds of two bf16 GEMVs (4096 x 1024, 1024 x 4096), an RMS "
        "norm and a product; medians of 7 rounds, CUDA events",
        "",
        "| programs | grid | fill alone GB/s | chain alone ms | fill beside GB/s "
        "| chain beside ms | chain slowed |",
        "|---|---|---|---|---|---|---|",
    ]
    for programs in args.programs:
        expert_fill.FILL_PROGRAMS = programs or None
        table_grid = expert_fill.fill_table(banks).grid
        grid = min(table_grid, programs or table_grid)
        fill()
        chain()
        torch.cuda.synchronize()
        assert torch.equal(cache[0].cpu(), pool[int(pairs[0][0])]), "fill wrong"
        # (ms: expert_fill_bench's median of CUDA-event rounds, one call a round)
        fill_alone = timed(fill, "cuda", reps=1, rounds=7) * 1e3
        chain_alone = timed(chain, "cuda", reps=1, rounds=7) * 1e3
        beside_fill, beside_chain = [], []
        for _ in range(7):
            torch.cuda.synchronize()
            f_start, f_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            c_start, c_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            with torch.cuda.stream(side):
                f_start.record()
                fill()
                f_end.record()
            c_start.record()
            chain()
            c_end.record()
            torch.cuda.synchronize()
            beside_fill.append(f_start.elapsed_time(f_end))
            beside_chain.append(c_start.elapsed_time(c_end))
        fb, cb = statistics.median(beside_fill), statistics.median(beside_chain)
        lines.append(
            f"| {programs or 'one a block'} | {grid} | {fill_bytes / fill_alone / 1e6:.1f} | "
            f"{chain_alone:.3f} | {fill_bytes / fb / 1e6:.1f} | {cb:.3f} | "
            f"{cb / chain_alone:.2f}x |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
