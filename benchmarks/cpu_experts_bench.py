"""CPU expert bandwidth of the native kernel by expert format (dense, and quantized experts in
the bytes each job reads) and thread count; and through the CPU executor, alone and while pinned
copies to the GPU run (the B_H and B_H' of the split, `ft bench bw`'s code), against torch.

    python benchmarks/cpu_experts_bench.py --threads 4 8 12 16 --out cpu.md
    python benchmarks/cpu_experts_bench.py --threads 1 2 --tables formats --pool-gib 1

The formats table runs jobs of `--batch` experts x 1 token (a decode layer step's routes)
straight on the native kernel (`NativeCPUExperts`, the handoff included), for each format and
model dtype (`--formats`, `--dtypes`), cycling through a pool of `--pool-gib` GiB per format so
weights come from DRAM; configurations take turns for `--rounds` rounds and each keeps its best
(what the kernel does where nothing else runs). GB/s counts the bytes a job reads of its
experts (codes and scales for quantized ones); "of bf16" sets it beside the dense bf16 kernel's
GB/s at the same thread count, in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from freetoken import settings
from freetoken.config import EXPERT_FORMATS
from freetoken.kernels import native
from freetoken.kernels.cpu_experts import NativeCPUExperts
from freetoken.moe.bandwidth import cpu_model, measure
from freetoken.moe.store import ExpertShape, HostExpertStore
from freetoken.weights.expert_format import expert_format, expert_weights

QWEN3_30B_EXPERT = ExpertShape(hidden=2048, intermediate=768, dtype=torch.bfloat16)


def gbs(v):
    return "n/a" if v is None else f"{v / 1e9:.1f}"


def random_pool(shape: ExpertShape, pool_bytes: int) -> tuple[int, dict]:
    """(experts, named banks) of random experts in the shape's format (the host pool's
    `fill_random_`, as `ft bench bw` draws them)."""
    pool = HostExpertStore(shape, 1, max(16, pool_bytes // shape.nbytes))
    pool.fill_random_()
    return pool.num_experts, pool.named_banks


# How the team waits between jobs: "asleep" (the library's default: idle threads sleep at once,
# so each job pays their futex wake-ups, tens of microseconds a thread on a VM) or "awake"
# (idle threads spin a few milliseconds, as the team decode wakes ahead of each layer's job
# waits: `cpu_prepare_us`). Jobs of 4 quantized experts take under a millisecond, so the
# wake-ups weigh 2-4x more on them than on the same experts in bf16.
HANDOFF_SPIN = {"asleep": 0.0, "awake": 0.005}


def measure_kernel(kernel, shape: ExpertShape, n: int, batch: int, seconds: float, start: int):
    """Jobs of `batch` experts x 1 token for about `seconds`, from expert `start` on; (bytes of
    experts read per second of the loop, per second of the jobs themselves, the next expert).
    The second leaves out what the loop costs in Python between jobs (the same for every
    format: a larger share of shorter jobs)."""
    x = torch.randn(1, shape.hidden).to(shape.dtype)
    rows, weights = np.zeros(batch, np.int64), np.ones(batch, np.float32)
    item_seconds(kernel)
    nxt, read, in_jobs, begin = start, 0, 0.0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        pairs = np.arange(nxt, nxt + batch) % n
        nxt = (nxt + batch) % n
        job = kernel.submit(x, rows, pairs, weights)
        job.result()
        in_jobs += job.seconds
        read += batch * shape.nbytes
    split = item_seconds(kernel)
    if split is not None:  # a profiling build: where the team's time went
        team = (kernel.threads + 1) * in_jobs  # the waiting caller works on each job too
        ITEM_SPLITS[shape.format, kernel.threads] = [t / team for t in split]
    return read / (time.perf_counter() - begin), read / in_jobs, nxt


# Per (format, threads): shares of the team's time in jobs spent in gate/up items, down items
# and between the two phases, from a build with -DITEM_TIMES (FREETOKEN_NATIVE_FLAGS).
ITEM_SPLITS: dict = {}


def item_seconds(kernel) -> list[float] | None:
    out = (ctypes.c_double * 3)()
    return list(out) if kernel.lib.ft_cpu_experts_item_seconds(out) else None


def formats_table(args) -> list[str]:
    pool_bytes = int(args.pool_gib * 2**30)
    h, i = args.hidden, args.intermediate
    # dense bf16 first: every row is set beside it. Quantized banks are the same bytes whatever
    # the model's dtype: one pool per format.
    runs = [("dense", "bfloat16")] + [
        (name, dtype)
        for name in args.formats
        for dtype in args.dtypes
        if (name, dtype) != ("dense", "bfloat16")
    ]
    pools, configs = {}, []
    for name, dtype_name in runs:
        fmt, dtype = expert_format(name, tuple(args.fp8_block)), getattr(torch, dtype_name)
        shape = ExpertShape(h, i, dtype, format=fmt)
        key = (name, dtype_name if name == "dense" else None)
        if key not in pools:
            pools[key] = random_pool(shape, pool_bytes)
        n, banks = pools[key]
        w = expert_weights(banks, fmt)
        for threads in args.threads:
            kernel = NativeCPUExperts.create(w.gate_up, w.down, "silu", threads, dtype=dtype)
            if kernel is None:
                print(f"no native kernel for {name} experts in {dtype_name}", flush=True)
                break
            for handoff in args.handoff:
                configs.append(((name, dtype_name, threads, handoff), kernel, shape, n))
    # Rounds of every configuration in turn, each its best round's rate: what the kernel does
    # where nothing else runs, on a machine whose other work comes and goes.
    best, nxt = {}, {}
    for _ in range(args.rounds):
        for key, kernel, shape, n in configs:
            kernel.set_spin(HANDOFF_SPIN[key[-1]])
            measure_kernel(kernel, shape, n, args.batch, 0.05, 0)  # wakes the team
            *rates, nxt[key] = measure_kernel(
                kernel, shape, n, args.batch, args.seconds / args.rounds, nxt.get(key, 0)
            )
            best[key] = [max(b, r) for b, r in zip(best.get(key, (0.0, 0.0)), rates, strict=True)]
    rows = []
    for (name, dtype_name, threads, handoff), _, shape, _ in configs:
        rate, in_jobs = best[name, dtype_name, threads, handoff]
        ref, ref_in_jobs = best["dense", "bfloat16", threads, handoff]
        row = (
            f"| {dtype_name} | {fmt_label(shape.format)} | {threads} | {handoff} | {gbs(rate)} | "
            f"{rate / ref:.0%} | {gbs(in_jobs)} | {in_jobs / ref_in_jobs:.0%} | "
            f"{shape.nbytes / 1e6:.2f} | {rate / shape.nbytes:,.0f} | "
            f"{rate / shape.nbytes / args.batch:,.0f} |"
        )
        print(row, flush=True)
        rows.append(row)
    for (fmt, threads), (gate, down, between) in ITEM_SPLITS.items():
        print(
            f"# team time, {fmt_label(fmt)} at {threads} threads (last round): gate/up items "
            f"{gate:.1%}, down items {down:.1%}, between phases {between:.1%}, elsewhere "
            f"{1 - gate - down - between:.1%}",
            flush=True,
        )
    return [
        f"## By expert format ({h} x {i} experts, jobs of {args.batch} experts x 1 token)",
        "",
        f"- each configuration's best of {args.rounds} rounds of {args.seconds / args.rounds:.2f}"
        f" s, taken in turns; pools of {args.pool_gib:g} GiB per format cycled through",
        "- GB/s: bytes of the experts read (codes and scales when quantized) per second of the "
        "measuring loop; in jobs: per second from each job's submission to its completion (the "
        "kernel's own rate, without the loop's Python between jobs); of bf16: against dense bf16 "
        "experts at the same thread count and handoff",
        "- team: asleep, each job wakes the threads (the library's default); awake, they spin "
        "between jobs, as decode's team woken ahead of each layer's job (`cpu_prepare_us`)",
        "",
        "| model dtype | stored | threads | team | GB/s read | of bf16 | GB/s in jobs | of bf16 | "
        "MB / expert | experts/s | jobs/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def fmt_label(fmt) -> str:
    if fmt.name == "fp8":
        return f"fp8 {fmt.row_block}x{fmt.col_block}"
    return fmt.name


def split_table(args) -> list[str]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for kernel in ("native", "torch"):
        os.environ[settings.NATIVE.name] = "1" if kernel == "native" else "0"
        native._loaded.clear()
        # (the torch fallback dequantizes expert by expert: dense experts only)
        for name in args.formats if kernel == "native" else ["dense"]:
            fmt = expert_format(name, tuple(args.fp8_block))
            shape = dataclasses.replace(QWEN3_30B_EXPERT, format=fmt)
            for threads in args.threads:
                p = measure(shape, device, seconds=args.seconds, threads=threads)
                row = (
                    f"| {kernel} | {fmt_label(fmt)} | {threads} | {gbs(p.cpu_experts)} | "
                    f"{gbs(p.cpu_concurrent)} | {gbs(p.pcie)} | {gbs(p.pcie_concurrent)} |"
                )
                print(row, flush=True)
                rows.append(row)
    os.environ[settings.NATIVE.name] = "1"
    native._loaded.clear()
    return [
        "## Through the CPU executor, alone and beside copies (bf16 model)",
        "",
        "- jobs of 8 experts x 1 token through the real CPU executor (handoff included), "
        "from a 2 GiB pool cycled so weights come from DRAM; 'with copies': while a thread "
        "copies experts to the GPU (pinned); bytes as stored (codes and scales)",
        "",
        "| kernel | stored | threads | B_H GB/s | B_H' with copies | B_P GB/s | B_P' with CPU |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument(
        "--tables", nargs="+", choices=["formats", "split"], default=["formats", "split"]
    )
    ap.add_argument("--formats", nargs="+", default=list(EXPERT_FORMATS), choices=EXPERT_FORMATS)
    ap.add_argument(
        "--handoff",
        nargs="+",
        choices=list(HANDOFF_SPIN),
        default=list(HANDOFF_SPIN),
        help="formats table: how the team waits between jobs",
    )
    ap.add_argument("--fp8-block", type=int, nargs=2, default=[128, 128])
    ap.add_argument(
        "--dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        choices=["bfloat16", "float32"],
        help="the model's dtype",
    )
    ap.add_argument("--batch", type=int, default=8, help="experts per job")
    ap.add_argument(
        "--hidden",
        type=int,
        default=QWEN3_30B_EXPERT.hidden,
        help="formats table: the experts' hidden size (default Qwen3-30B-A3B's; gpt-oss-20b: 2880)",
    )
    ap.add_argument(
        "--intermediate",
        type=int,
        default=QWEN3_30B_EXPERT.intermediate,
        help="formats table: the experts' width (gpt-oss-20b: 2880)",
    )
    ap.add_argument("--pool-gib", type=float, default=2.0, help="per format")
    ap.add_argument("--rounds", type=int, default=5, help="of each format, taken in turns")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sections = []
    if "formats" in args.tables:
        sections += [*formats_table(args), ""]
    if "split" in args.tables:
        sections += [*split_table(args), ""]
    text = "\n".join(
        [
            f"# CPU expert kernel: bandwidth by format and thread count (H {args.hidden}, "
            f"I {args.intermediate} experts)",
            "",
            f"- CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; torch {torch.__version__}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            *sections,
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
