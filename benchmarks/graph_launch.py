"""The host's cost of launching a CUDA graph, by what the graph holds: `replay()` timed on the
host (the GPU idle before each launch, as after a sampler's wait) for graphs of N copies of
one kind of node, so a kind that makes launches dear shows (stream memory operations did:
~1.8 us of launch each, which is why the doorbell has none), then the whole decode step of
each strategy with the pool cached whole, and the plan.

    python benchmarks/graph_launch.py --nodes 16 --out launch.md
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from decode_offload import (
    contender_options,
    prepare,
    qwen3_30b_a3b,
    random_model,
    report,
    tiny,
    use_uniform_routing,
)

from freetoken.kernels import cache_control
from freetoken.kernels.expert_fill import HostRows, fill_experts
from freetoken.kernels.host_partial import add_host_partial_


def launch_us(body, nodes: int, launches: int = 200) -> tuple[float, float]:
    """(host us per replay() call, GPU us per replay) of a graph of `nodes` calls of body."""
    body()  # warm up (compilation)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            body()
    return replay_us(graph, launches)


def replay_us(graph, launches: int = 200) -> tuple[float, float]:
    host = 0.0
    for _ in range(launches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        host += time.perf_counter() - start
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return host * 1e6 / launches, begin.elapsed_time(end) * 1e3 / 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16, help="of the model's decode steps")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same structure")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda")
    a = torch.randn(1, 2048, device=device)
    pool = torch.zeros(64, 4096, dtype=torch.bfloat16).pin_memory()
    bank = torch.zeros(64, 4096, dtype=torch.bfloat16, device=device)
    slots = torch.full((8,), 64, dtype=torch.long, device=device)
    pairs = torch.zeros(8, dtype=torch.long, device=device)
    words = torch.zeros(256, dtype=torch.int32, pin_memory=True)
    seq = torch.ones(2, dtype=torch.long, device=device)
    words[128] = 1  # answered: the merge does not wait
    rang = torch.ones((), dtype=torch.bool, device=device)
    host_vec = torch.zeros(2048, dtype=torch.float32, pin_memory=True)

    def read_host():  # the merge, rung and answered: it reads the partial from host memory
        add_host_partial_(a, HostRows(host_vec), HostRows(words), 128, seq, rang)

    kinds = {
        "torch add": lambda: a.add_(1.0),
        "fill kernel (nothing to copy)": lambda: fill_experts(
            ((bank, HostRows(pool)), (bank, HostRows(pool))), pairs, slots, 64
        ),
        "merge kernel (reads host memory)": read_host,
    }
    lines = [
        f"# graph_launch: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
        f"{args.nodes} nodes a graph; plan kernel: {'yes' if cache_control.triton else 'no'}",
        "",
        "| graph of | host us per replay() | GPU us per replay |",
        "|---|---|---|",
    ]
    for name, body in kinds.items():
        host, gpu = launch_us(body, args.nodes)
        lines.append(f"| {args.nodes} x {name} | {host:.1f} | {gpu:.1f} |")
        print(lines[-1], flush=True)
    # Whole decode steps of a small model of the same structure, per strategy (the pool
    # cached whole), and the plan alone.
    raw = tiny(args.layers) if args.tiny else qwen3_30b_a3b(args.layers)
    loaded = random_model(raw, device)
    use_uniform_routing(loaded)
    for strategy in ("fused", "offload", "hybrid"):
        size = None if strategy == "fused" else str(loaded.experts.num_pairs)
        contender = prepare(
            loaded, contender_options(strategy, cache_size=size), 1, 8, 16, 16, device
        )
        capture = next(iter(contender.runner.graphs.captures.values()))
        for i, graph in enumerate(capture.graphs):
            host, gpu = replay_us(graph)
            lines.append(
                f"| {strategy}'s decode step ({args.layers} layers), graph {i} | "
                f"{host:.1f} | {gpu:.1f} |"
            )
            print(lines[-1], flush=True)
        control = contender.runner.moe.control
        if control is not None:
            k = loaded.config.moe.top_k
            ids = torch.arange(k, device=device).view(1, k)
            weights = torch.full((1, k), 1.0 / k, device=device)
            x = torch.randn(1, loaded.config.hidden_size, device=device, dtype=torch.bfloat16)

            def plan(control=control, ids=ids, weights=weights, x=x):
                control.plan(0, ids, weights, x)

            host, gpu = launch_us(plan, args.nodes)
            lines.append(f"| {args.nodes} x {strategy}'s plan | {host:.1f} | {gpu:.1f} |")
            print(lines[-1], flush=True)
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
