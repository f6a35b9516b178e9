"""Where a synced decode step's time goes, strategy by strategy: the host's work before the
graph launch, the launch, the GPU's busy time and its idle gaps inside the step, and the
device time of each kernel kind.

    python benchmarks/step_timeline.py --layers 16 --contender fused@all \
        --contender offload@100% --contender hybrid@100% --batch 1 --out DIR

Each step is timed as serving runs it (the sampler waits for its logits before the next step
starts) and, for comparison, with steps queued back to back (`queued ms`: the GPU's own time
when the host is ahead). A torch profile of a few synced steps gives the rest. The random
model and uniform routing are decode_offload.py's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from decode_offload import (
    SHAPES,
    close,
    contender_options,
    prepare,
    random_model,
    report,
    sync,
    tiny,
    use_uniform_routing,
)
from torch.profiler import ProfilerActivity, profile, record_function

from freetoken.config import EXPERT_FORMATS
from freetoken.weights.expert_format import expert_format

STEP = "decode_step"


def cache_size(spec: str, num_pairs: int) -> str | None:
    if spec == "all":
        return None
    if spec.endswith("%"):
        return str(int(num_pairs * float(spec[:-1]) / 100))
    return spec


def queued_ms(contender, steps: int, device) -> float:
    """ms per step with `steps` steps queued without waiting between them."""
    runner, seqs = contender.runner, contender.seqs
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        runner.forward(seqs, [[t] for t in contender.tokens.pop(0)])
    sync(device)
    return (time.perf_counter() - start) * 1e3 / steps


def synced_ms(contender, steps: int, device) -> tuple[float, float]:
    """(ms per step, of which ms in the forward call: the host's work before the wait)."""
    contender.host_seconds = 0.0
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        contender.step()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / steps, contender.host_seconds * 1e3 / steps


def kernel_name(name: str) -> str:
    """A kernel's kind: Triton's names without their specialisation suffixes."""
    for cut in ("(", "<"):
        name = name.split(cut)[0]
    return name[:60]


def timeline(prof) -> dict:
    """From the profile's events: per step (a `decode_step` range, the sampler's wait in it)
    its span, the kernels' summed time and count, the largest gaps between kernels, and the
    device time by kernel kind (averaged over the profiled steps). The host and device clocks
    of the profile are not compared (they are not one clock)."""
    events = prof.events()
    steps = sorted((e for e in events if e.name == STEP), key=lambda e: e.time_range.start)
    kernels = [
        e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != STEP
    ]
    kernels.sort(key=lambda k: k.time_range.start)
    by_kind: dict[str, float] = defaultdict(float)
    rows = []
    for i, step in enumerate(steps):
        start = step.time_range.start
        end = steps[i + 1].time_range.start if i + 1 < len(steps) else float("inf")
        mine = [k for k in kernels if start <= k.time_range.start < end]
        busy, gaps = 0.0, []
        last_end = mine[0].time_range.start if mine else 0.0
        for k in mine:
            s, e = k.time_range.start, k.time_range.end
            gaps.append(max(0.0, s - last_end))
            busy += e - s
            last_end = max(last_end, e)
            by_kind[kernel_name(k.name)] += e - s
        rows.append(
            dict(
                step_us=step.time_range.end - start,
                busy_us=busy,
                kernels=len(mine),
                biggest_gaps_us=sorted(gaps, reverse=True)[:3],
            )
        )
    n = max(1, len(rows))
    mean = {k: sum(r[k] for r in rows) / n for k in ("step_us", "busy_us", "kernels")}
    ranked = sorted(by_kind.items(), key=lambda kv: -kv[1])
    mean["kinds_us_per_step"] = {k: v / n for k, v in ranked}
    mean["biggest_gaps_us"] = [round(g, 1) for g in rows[-1]["biggest_gaps_us"]] if rows else []
    return mean


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--contender", action="append", help="STRATEGY@CACHE, e.g. offload@100%%")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--profiled", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--expert-format", choices=EXPERT_FORMATS, default="dense")
    ap.add_argument("--python-profile", action="store_true", help="add each one's cProfile")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    raw = tiny(args.layers) if args.tiny else SHAPES[args.shape](args.layers)
    loaded = random_model(raw, device, expert_format(args.expert_format))
    use_uniform_routing(loaded)
    pool = loaded.experts.num_pairs
    lines = [
        f"# step_timeline: {'tiny' if args.tiny else args.shape}, {args.layers} layers, "
        f"experts {args.expert_format}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| contender | synced ms | queued ms | host ms in forward | profiled step us | "
        "kernels' busy us | kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    details = []
    specs = args.contender or ["fused@all", "offload@100%", "hybrid@100%"]
    for spec, batch in itertools.product(specs, args.batch or [1]):
        strategy, _, cache = spec.partition("@")
        options = contender_options(strategy, cache_size=cache_size(cache or "all", pool))
        total = 2 * args.steps + args.profiled + 2
        contender = prepare(loaded, options, batch, total, 16, 16, device)
        python_profile = cProfile.Profile()
        python_profile.enable()
        synced, host = synced_ms(contender, args.steps, device)
        python_profile.disable()
        buf = io.StringIO()
        pstats.Stats(python_profile, stream=buf).sort_stats("tottime").print_stats(14)
        queued = queued_ms(contender, args.steps, device)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            for _ in range(args.profiled):
                with record_function(STEP):
                    contender.step()
            sync(device)
        t = timeline(prof)
        close(contender, device)
        lines.append(
            f"| {spec} b{batch} | {synced:.3f} | {queued:.3f} | {host:.3f} | {t['step_us']:.0f} | "
            f"{t['busy_us']:.0f} | "
            f"{t['kernels']:.0f} |"
        )
        details.append((f"{spec} b{batch}", t, buf.getvalue()))
        row = dict(contender=spec, batch=batch, synced_ms=synced, queued_ms=queued, host_ms=host)
        print(json.dumps(row | t), flush=True)
    for spec, t, python in details:
        lines += ["", f"## {spec}: device time by kernel kind, us per step", ""]
        lines += [f"- {k}: {v:.1f}" for k, v in list(t["kinds_us_per_step"].items())[:14]]
        lines.append(f"- largest idle gaps in the last step: {t['biggest_gaps_us']}")
        if args.python_profile:
            lines += [
                "",
                f"Python profile of the {args.steps} synced steps (by own time):",
                "",
                "```",
                python.strip(),
                "```",
            ]
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
