"""Times the grouped expert kernels on CUDA at Qwen3-30B-A3B shapes (H=2048, I=768, bf16, 8
routes per token) against the torch reference, and reports the bandwidth of the expert weights
they read next to an HBM ceiling measured in the same run with a large device-to-device copy.

    python benchmarks/grouped_experts_bench.py            # batch 1 and 4
    python benchmarks/grouped_experts_bench.py --profile  # also the GPU time of each kernel
    python benchmarks/grouped_experts_bench.py --sweep    # also try other launch parameters

Each timed call uses the next of several slot sets drawn from a pool much larger than L2, so
the weights of consecutive calls are (mostly) different experts and come from HBM, as in
decode where every layer reads new experts. GB/s counts the distinct experts a call reads.
Kernel time is measured on calls replayed from a CUDA graph (GPU time, as an engine capturing
its decode step sees it); the eager time adds the host cost of launching from Python.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch

from freetoken.kernels import grouped_experts as ge

HIDDEN, INTER, TOP_K = 2048, 768, 8
DTYPE = torch.bfloat16
POOL_SLOTS = 96  # 96 x 9.4 MB = 906 MB of weights, ~18x the H200's 50 MB L2
SLOT_SETS = 16  # calls rotate through these routings
EXPERT_BYTES = 3 * HIDDEN * INTER * torch.finfo(DTYPE).bits // 8


def median_time_s(fn: Callable[[int], object], iters: int, warmup: int) -> float:
    """Median over `iters` calls of fn(i), each timed alone with CUDA events."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def graph_time_s(calls: Callable[[], object], calls_per_graph: int) -> float:
    """Per-call GPU time of `calls` (which issues `calls_per_graph` calls) replayed as one CUDA
    graph: no host launch overhead, as in an engine that captures its decode step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return median_time_s(lambda _: graph.replay(), iters=50, warmup=3) / calls_per_graph


def hbm_ceiling_gbps(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy of a large buffer: reads + writes per second."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = median_time_s(lambda _: dst.copy_(src), iters=20, warmup=3)
    return nbytes / t / 1e9


def make_routings(tokens: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """SLOT_SETS routings: each token picks TOP_K distinct slots (tokens may share slots, as in
    real routing), with renormalized random gate weights rounded to bf16 as Qwen3 does."""
    sets = []
    for _ in range(SLOT_SETS):
        slots = torch.stack(
            [torch.randperm(POOL_SLOTS, generator=gen)[:TOP_K] for _ in range(tokens)]
        )
        w = torch.rand(tokens, TOP_K, generator=gen)
        sets.append((slots.cuda(), (w / w.sum(1, keepdim=True)).to("cuda", DTYPE)))
    return sets


def bench(tokens: int, x: torch.Tensor, w_gate_up, w_down, gen, *, with_reference: bool) -> dict:
    routings = make_routings(tokens, gen)
    distinct = statistics.mean(int(s.unique().numel()) for s, _ in routings)
    nbytes = distinct * EXPERT_BYTES
    xs = x[:tokens]

    def kernel(i: int):
        slots, w = routings[i % SLOT_SETS]
        return ge.triton_grouped_expert_forward(xs, slots, w, w_gate_up, w_down)

    def reference(i: int):
        slots, w = routings[i % SLOT_SETS]
        return ge.reference_grouped_experts(xs, slots, w, w_gate_up, w_down)

    def all_routings():
        for i in range(SLOT_SETS):
            kernel(i)

    out = {"tokens": tokens, "distinct_experts": distinct, "mb": nbytes / 1e6}
    out["graph_us"] = graph_time_s(all_routings, SLOT_SETS) * 1e6
    out["graph_gbps"] = nbytes / out["graph_us"] / 1e3
    if with_reference:
        out["eager_us"] = median_time_s(kernel, iters=400, warmup=20) * 1e6
        out["ref_us"] = median_time_s(reference, iters=50, warmup=5) * 1e6
        out["ref_gbps"] = nbytes / out["ref_us"] / 1e3
    return out


def profile(tokens: int, x, w_gate_up, w_down, gen) -> None:
    """GPU time of each kernel, averaged over the routings."""
    routings = make_routings(tokens, gen)
    for slots, w in routings:  # warm-up
        ge.triton_grouped_expert_forward(x[:tokens], slots, w, w_gate_up, w_down)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True
    ) as prof:
        for slots, w in routings * 4:
            ge.triton_grouped_expert_forward(x[:tokens], slots, w, w_gate_up, w_down)
        torch.cuda.synchronize()
    print(f"batch {tokens} kernels (GPU us per call):")
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and ev.count:
            print(f"  {ev.key[:40]:40s} {ev.device_time_total / ev.count:7.1f}")


SWEEP = {
    "gate_up": {
        "GATE_UP_BLOCK_N": [4, 8, 16],
        "GATE_UP_BLOCK_K": [64, 128, 256],
        "GATE_UP_WARPS": [4, 8],
        "GATE_UP_STAGES": [2, 3],
    },
    "down": {
        "DOWN_BLOCK_N": [16, 32, 64],
        "DOWN_BLOCK_K": [64, 128, 256],
        "DOWN_WARPS": [4, 8],
        "DOWN_STAGES": [2, 3],
    },
}


def sweep(x, w_gate_up, w_down, gen, batches: list[int]) -> None:
    """Vary one kernel's launch parameters at a time (the other keeps the module defaults)."""
    for kernel, grid in SWEEP.items():
        defaults = {name: getattr(ge, name) for name in grid}
        print(f"\nsweep {kernel} (defaults {defaults})")
        results = []
        for values in itertools.product(*grid.values()):
            params = dict(zip(grid, values, strict=True))
            for name, value in params.items():
                setattr(ge, name, value)
            try:
                row = [bench(b, x, w_gate_up, w_down, gen, with_reference=False) for b in batches]
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  {params}: failed ({type(e).__name__})")
                continue
            finally:
                for name, value in defaults.items():
                    setattr(ge, name, value)
            results.append((row[0]["graph_us"], params, row))
        for _, params, row in sorted(results, key=lambda r: r[0])[:8]:
            cells = "  ".join(f"b{r['tokens']} {r['graph_us']:6.1f} us" for r in row)
            print(f"  {cells}  {params}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep launch parameters")
    parser.add_argument("--profile", action="store_true", help="also time each kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not ge.triton_available():
        raise SystemExit("needs CUDA and triton")

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    w_gate_up = torch.randn(POOL_SLOTS, 2 * INTER, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5
    w_down = torch.randn(POOL_SLOTS, HIDDEN, INTER, device="cuda", dtype=DTYPE) / INTER**0.5
    x = torch.randn(4, HIDDEN, device="cuda", dtype=DTYPE)

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    ceiling = hbm_ceiling_gbps()
    print(f"HBM ceiling (d2d copy, read + write): {ceiling:.0f} GB/s")
    print(f"expert: {EXPERT_BYTES / 1e6:.2f} MB; pool {POOL_SLOTS} slots; {SLOT_SETS} routings")
    for tokens in (1, 4):
        r = bench(tokens, x, w_gate_up, w_down, gen, with_reference=True)
        print(
            f"batch {tokens}: {r['distinct_experts']:.1f} experts, {r['mb']:.1f} MB | "
            f"kernel (CUDA graph) {r['graph_us']:6.1f} us {r['graph_gbps']:5.0f} GB/s "
            f"({100 * r['graph_gbps'] / ceiling:3.0f}% of ceiling) | "
            f"eager call {r['eager_us']:6.1f} us | "
            f"torch reference {r['ref_us']:7.1f} us {r['ref_gbps']:5.0f} GB/s"
        )
    if args.profile:
        for tokens in (1, 4):
            profile(tokens, x, w_gate_up, w_down, gen)
    if args.sweep:
        sweep(x, w_gate_up, w_down, gen, batches=[1, 4])


if __name__ == "__main__":
    main()
