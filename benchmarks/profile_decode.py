"""Where a decode step's time goes: torch profiler tables for chosen strategies, plus the step
time with the routed experts skipped (what the rest of the model costs).

    python benchmarks/profile_decode.py --layers 16 --strategy fused --strategy offload --out DIR

Uses a random model of decode_offload.py's shapes (Qwen3-30B-A3B's by default) and its
uniform routing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from decode_offload import SHAPES, random_model, tiny, use_uniform_routing
from torch.profiler import ProfilerActivity, profile

from freetoken.config import EXPERT_FORMATS, MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.layers import concurrent
from freetoken.weights.expert_format import expert_format


def steps(runner, seqs, n, vocab, gen):
    for _ in range(n):
        runner.forward(seqs, [[int(torch.randint(0, vocab, (1,), generator=gen))] for _ in seqs])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_then_time(runner, batch, steps_timed, vocab, device):
    """Prefill a few tokens per sequence, decode 8 warm-up steps, then time `steps_timed`;
    returns (ms per step, the sequences, the token generator)."""
    gen = torch.Generator().manual_seed(0)
    seqs = [runner.new_sequence() for _ in range(batch)]
    runner.forward(seqs, [[1, 2, 3, 4] for _ in seqs])
    steps(runner, seqs, 8, vocab, gen)
    sync(device)
    start = time.perf_counter()
    steps(runner, seqs, steps_timed, vocab, gen)
    sync(device)
    return (time.perf_counter() - start) * 1e3 / steps_timed, seqs, gen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--strategy", action="append")
    ap.add_argument("--cache", default="8GiB")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--expert-format", choices=EXPERT_FORMATS, default="dense")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--stacked",
        action="store_true",
        help="also time the rest of the model with each layer's projections of one input "
        "stacked into one GEMM (DecoderModel.stack_projections; on a GPU not the default yet)",
    )
    ap.add_argument(
        "--side-branches",
        action="store_true",
        help="also time the rest of the model with a layer's independent work on a side "
        "stream (layers/concurrent.py ON_GPU)",
    )
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    device = torch.device(args.device)
    raw = tiny(args.layers) if args.tiny else SHAPES[args.shape](args.layers)
    loaded = random_model(raw, device, expert_format(args.expert_format))
    use_uniform_routing(loaded)
    vocab = loaded.config.vocab_size
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for strategy in args.strategy or ["fused", "offload", "hybrid"]:
        cache = None if strategy == "fused" else args.cache
        runner = ModelRunner(
            loaded, 4096, moe=MoEOptions(strategy, cache), cuda_graphs=not args.no_cuda_graphs
        )
        step_ms, seqs, gen = warm_then_time(runner, args.batch, args.steps, vocab, device)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            steps(runner, seqs, 5, vocab, gen)
            sync(device)
        text = [f"# {strategy}: {step_ms:.2f} ms per step (batch {args.batch}), profile of 5 steps"]
        text.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        if device.type == "cuda":
            text.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        # Where the host's time goes in Python terms (the tables above show only torch ops).
        python_profile = cProfile.Profile()
        python_profile.enable()
        steps(runner, seqs, 10, vocab, gen)
        sync(device)
        python_profile.disable()
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(python_profile, stream=buf).sort_stats(order).print_stats(35)
            text += [f"## Python profile of 10 steps, by {order}", buf.getvalue()]
        (args.out / f"profile-{strategy}.txt").write_text("\n".join(text))
        summary.append(f"{strategy}: {step_ms:.2f} ms/step")
        if runner.moe.cpu is not None:
            runner.moe.cpu.shutdown()
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # The rest of the model: routed experts replaced by zeros (router and shared parts still run).
    runner = ModelRunner(loaded, 4096, moe=MoEOptions("fused"), cuda_graphs=not args.no_cuda_graphs)
    runner.moe = None  # a runner without a runtime leaves the blocks' executors as they are
    for layer in loaded.model.layers:
        if hasattr(layer, "moe"):
            layer.moe.executor = lambda moe_layer, x, ids, weights: torch.zeros_like(x)
    rest_ms, _, _ = warm_then_time(runner, args.batch, args.steps, vocab, device)
    summary.append(f"no routed experts: {rest_ms:.2f} ms/step")
    if args.side_branches:
        concurrent.ON_GPU = True
        runner = ModelRunner(
            loaded, 4096, moe=MoEOptions("fused"), cuda_graphs=not args.no_cuda_graphs
        )
        runner.moe = None
        side_ms, _, _ = warm_then_time(runner, args.batch, args.steps, vocab, device)
        concurrent.ON_GPU = False
        summary.append(f"no routed experts, side branches: {side_ms:.2f} ms/step")
    if args.stacked:
        loaded.model.stack_projections(dense=True)
        runner = ModelRunner(
            loaded, 4096, moe=MoEOptions("fused"), cuda_graphs=not args.no_cuda_graphs
        )
        runner.moe = None
        stacked_ms, _, _ = warm_then_time(runner, args.batch, args.steps, vocab, device)
        summary.append(f"no routed experts, projections stacked: {stacked_ms:.2f} ms/step")
    print("\n".join(summary))
    (args.out / "profile-summary.txt").write_text("\n".join(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
