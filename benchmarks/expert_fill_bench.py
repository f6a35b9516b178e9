"""Cache fills from the pinned host pool: the device-launched copy kernel (kernels/expert_fill.py,
what device control uses inside a decode graph) against the copy engines (the native copier
the host path queues, and torch's copy_), in GB/s over PCIe, for fills of 1 to 16 experts.

    python benchmarks/expert_fill_bench.py [--experts 256] [--out fill.md]

Each fill is checked against the pool before it is timed (rows poisoned first). Times are CUDA
events around 20 repetitions, median of 5, rotating over pool rows so no fill reads what the
last one did.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from freetoken.kernels.expert_fill import HostRows, fill_experts
from freetoken.model_config import decoder_config, routed_experts
from freetoken.moe.cache import ExpertCache
from freetoken.moe.store import HostExpertStore


def store_of(experts: int) -> HostExpertStore:
    raw = {"architectures": ["Bench"], "hidden_size": 2048, "num_attention_heads": 32,
           "num_hidden_layers": 1, "vocab_size": 10, "num_experts": experts,
           "num_experts_per_tok": 8, "moe_intermediate_size": 768}  # fmt: skip
    store = HostExpertStore(decoder_config(raw, "bench", moe=routed_experts(raw)), torch.bfloat16)
    store.w_gate_up.normal_()
    store.w_down.normal_()
    assert store.pin(), "could not page-lock the pool"
    return store


def timed(fn, reps: int = 20, rounds: int = 5) -> float:
    """Median seconds of one call."""
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


def fill_figures(cache, store, banks, count: int, args, gen) -> list[float]:
    """GB/s of a fill of `count` experts: device kernel, native copier, torch copy_."""
    device, nbytes, sink = cache.device, store.shape.nbytes, args.slots
    # R = 16 entries, `count` of them real: the shape a decode graph launches.
    slots = torch.full((16,), sink, dtype=torch.long)
    slots[:count] = torch.randperm(args.slots, generator=gen)[:count]
    rotations = [torch.randperm(args.experts, generator=gen)[:16] for _ in range(8)]
    slots_d = slots.to(device)
    pairs_d = [r.to(device) for r in rotations]
    # correctness, on poisoned slots
    cache.w_gate_up.fill_(float("nan"))
    cache.w_down.fill_(float("nan"))
    fill_experts(banks, pairs_d[0], slots_d, sink)
    torch.cuda.synchronize()
    for j in range(count):
        s, p = int(slots[j]), int(rotations[0][j])
        assert torch.equal(cache.w_gate_up[s].cpu(), store.w_gate_up[p]), "gate/up fill wrong"
        assert torch.equal(cache.w_down[s].cpu(), store.w_down[p]), "down fill wrong"
    turn = iter(range(10**9))

    def kernel():
        pairs = pairs_d[next(turn) % len(pairs_d)]
        fill_experts(banks, pairs, slots_d, sink)

    def native():
        pairs = rotations[next(turn) % len(rotations)][:count].tolist()
        cache.place(pairs, slots[:count].tolist(), after_compute=False)
        torch.cuda.current_stream().wait_stream(cache.copy_stream)

    def torch_copy():
        pairs = rotations[next(turn) % len(rotations)][:count].tolist()
        for s, p in zip(slots[:count].tolist(), pairs, strict=True):
            cache.w_gate_up[s].copy_(store.w_gate_up[p], non_blocking=True)
            cache.w_down[s].copy_(store.w_down[p], non_blocking=True)

    figures = []
    for fn in (kernel, native, torch_copy):
        fn()
        torch.cuda.synchronize()
        figures.append(count * nbytes / timed(fn) / 1e9)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    store = store_of(args.experts)
    cache = ExpertCache(store, args.slots, device)
    banks = ((cache.w_gate_up, HostRows(store.w_gate_up)), (cache.w_down, HostRows(store.w_down)))
    nbytes = store.shape.nbytes
    lines = [
        f"Cache fills, {torch.cuda.get_device_name()}, expert {nbytes / 2**20:.1f} MiB (bf16, "
        f"H 2048, I 768), pool {args.experts} experts pinned and mapped.",
        "",
        "| experts per fill | device kernel GB/s | native copier GB/s | torch copy_ GB/s |",
        "|---:|---:|---:|---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    for count in (1, 2, 4, 8, 16):
        figures = fill_figures(cache, store, banks, count, args, gen)
        lines.append(f"| {count} | " + " | ".join(f"{g:.1f}" for g in figures) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
