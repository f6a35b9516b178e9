"""Cache fills from the pinned host pool: the device-launched copy kernel (kernels/expert_fill.py,
what device control uses inside a decode graph) against the copy engines (the native copier
the host path queues, and torch's copy_), in GB/s over PCIe, for fills of 1 to 16 experts, for
each expert format's banks (bf16: two banks, or three with gpt-oss's biases; fp8, mxfp4 and
nvfp4: codes, block scales and nvfp4's per-row scales, four to seven banks of uint8, fp32 and
bf16 rows, all in the kernel's one launch).

    PYTHONPATH=src:benchmarks python benchmarks/expert_fill_bench.py [--format all]
        [--model qwen3-30b-a3b|gpt-oss-20b|all] [--experts 256] [--out fill.md]
    ... --tiny --device cpu     # the script's logic on small shapes, on the CPU under Triton's
                                # interpreter (no timings)

Each fill is checked against the pool byte for byte, every bank, before it is timed (the slots
poisoned first, the slots not filled checked untouched). Times are CUDA events around 20
repetitions, median of 5, rotating over pool rows so no fill reads what the last one did.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from freetoken.config import EXPERT_FORMATS
from freetoken.kernels.expert_fill import HostRows, fill_experts, fill_table, launch_fill
from freetoken.moe.cache import ExpertCache
from freetoken.moe.store import ExpertShape, HostExpertStore
from freetoken.weights.expert_format import expert_format

MODELS = {  # hidden, intermediate, biased experts
    "qwen3-30b-a3b": (2048, 768, False),
    "gpt-oss-20b": (2880, 2880, True),
}
TINY = {"qwen3-30b-a3b": (64, 32, False), "gpt-oss-20b": (96, 64, True)}
ENTRIES = 16  # R: the entries of a fill as a decode graph launches it
DISTINCT = 16  # experts of random bytes, repeated over the pool (drawing GBs takes minutes)


def store_of(model: str, fmt_name: str, experts: int, tiny: bool) -> HostExpertStore:
    hidden, inter, bias = (TINY if tiny else MODELS)[model]
    shape = ExpertShape(hidden, inter, torch.bfloat16, bias, expert_format(fmt_name))
    store = HostExpertStore(shape, 1, experts)
    gen = torch.Generator().manual_seed(0)
    for bank in store.banks:  # random bytes: the copy moves bytes, whatever they mean
        rows = bank.view(torch.uint8).view(bank.shape[0], -1)
        block = torch.randint(
            0, 256, (min(DISTINCT, rows.shape[0]), rows.shape[1]), dtype=torch.uint8, generator=gen
        )
        head = min(8, rows.shape[1])  # (each row's first bytes its own: rows differ)
        for start in range(0, rows.shape[0], block.shape[0]):
            part = rows[start : start + block.shape[0]]
            part.copy_(block[: part.shape[0]])
            part[:, :head] = torch.randint(
                0, 256, (part.shape[0], head), dtype=torch.uint8, generator=gen
            )
    if store.banks[0].device.type == "cpu" and torch.cuda.is_available():
        assert store.pin(), "could not page-lock the pool"
    return store


def timed(fn, device: str, reps: int = 20, rounds: int = 5) -> float:
    """Median seconds of one call."""
    if device == "cpu":  # (the interpreter's wall time: meaningless)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(out)


def check(cache, store, pairs: torch.Tensor, slots: torch.Tensor, sink: int) -> None:
    """Every byte of every bank: filled slots hold their pair's row, the others the poison."""
    for dev, host in zip(cache.banks, store.banks, strict=True):
        got = dev.cpu().view(torch.uint8).view(dev.shape[0], -1)
        want = torch.full_like(got, 0xA5)
        keep = slots != sink
        want[slots[keep]] = host.view(torch.uint8).view(host.shape[0], -1)[pairs[keep]]
        assert torch.equal(got, want), f"fill wrong in a bank of {tuple(dev.shape[1:])}"


def fill_figures(cache, store, banks, count: int, args, gen) -> list[float | None]:
    """GB/s of a fill of `count` experts: device kernel, native copier, torch copy_."""
    device, nbytes, sink = cache.device, store.shape.nbytes, args.slots
    # R = ENTRIES entries, `count` of them real: the shape a decode graph launches.
    slots = torch.full((ENTRIES,), sink, dtype=torch.long)
    slots[:count] = torch.randperm(args.slots, generator=gen)[:count]
    rotations = [torch.randperm(store.num_pairs, generator=gen)[:ENTRIES] for _ in range(8)]
    slots_d = slots.to(device)
    pairs_d = [r.to(device) for r in rotations]
    # correctness, on poisoned slots
    for bank in cache.banks:
        bank.view(torch.uint8).fill_(0xA5)
    fill = fill_experts if device.type == "cuda" else launch_fill  # (the kernel either way)
    fill(banks, pairs_d[0], slots_d, sink)
    if device.type == "cuda":
        torch.cuda.synchronize()
    check(cache, store, rotations[0], slots, sink)
    turn = iter(range(10**9))

    def kernel():
        fill(banks, pairs_d[next(turn) % len(pairs_d)], slots_d, sink)

    def native():
        pairs = rotations[next(turn) % len(rotations)][:count].tolist()
        cache.place(pairs, slots[:count].tolist(), after_compute=False)
        torch.cuda.current_stream().wait_stream(cache.copy_stream)

    def torch_copy():
        pairs = rotations[next(turn) % len(rotations)][:count].tolist()
        for s, p in zip(slots[:count].tolist(), pairs, strict=True):
            for dev, host in zip(cache.banks, store.banks, strict=True):
                dev[s].copy_(host[p], non_blocking=True)

    figures = []
    for fn in (kernel, native, torch_copy) if device.type == "cuda" else (kernel,):
        try:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            figures.append(count * nbytes / timed(fn, device.type) / 1e9)
        except Exception as e:  # (a path that cannot take these banks: reported, not fatal)
            print(f"  {fn.__name__}: {type(e).__name__}: {e}")
            figures.append(None)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="all", choices=["all", *EXPERT_FORMATS])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=["all", *MODELS])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small shapes (with --device cpu)")
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"}
        )
    if args.tiny:
        args.experts, args.slots = min(args.experts, 24), min(args.slots, 8)
    device = torch.device(args.device)
    formats = EXPERT_FORMATS if args.format == "all" else (args.format,)
    models = list(MODELS) if args.model == "all" else [args.model]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    lines = [
        f"Cache fills, {name}, pool {args.experts} experts pinned and mapped, fills of R = "
        f"{ENTRIES} entries (the rest to the sink).",
        "",
        "| model | format | banks | expert MiB | experts per fill | device kernel GB/s | "
        "native copier GB/s | torch copy_ GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    layouts = ["", "Banks (row bytes: the kernel's word bytes):"]
    gen = torch.Generator().manual_seed(0)
    for model in models:
        for fmt_name in formats:
            store = store_of(model, fmt_name, args.experts, args.tiny)
            cache = ExpertCache(store, args.slots, device)
            banks = tuple(
                (dev, HostRows(host) if device.type == "cuda" else host)
                for dev, host in zip(cache.banks, store.banks, strict=True)
            )
            table = fill_table(banks)
            layout = ", ".join(
                f"{n} {dev[0].numel() * dev.element_size()}: {w}"
                for n, dev, w in zip(store.named_banks, cache.banks, table.widths, strict=True)
            )
            layouts.append(f"- {model} {fmt_name}: {layout}; grid {table.grid} programs")
            print(layouts[-1])
            for count in [c for c in (1, 2, 4, 8, 16) if c <= min(args.slots, ENTRIES)]:
                figures = fill_figures(cache, store, banks, count, args, gen)
                cells = " | ".join("-" if g is None else f"{g:.1f}" for g in figures)
                cells += " | -" * (3 - len(figures))
                lines.append(
                    f"| {model} | {fmt_name} | {len(banks)} | "
                    f"{store.shape.nbytes / 2**20:.2f} | {count} | {cells} |"
                )
            del cache, store
    text = "\n".join(lines + layouts) + "\n"
    print()
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
