"""Times the grouped expert decode kernels on CUDA per MoE layer, for each expert format (bf16,
fp8 with 128 x 128 block scales, mxfp4, nvfp4, q8_0) beside bf16 at the same shape, and reports the
bytes of expert weights they read, GB/s against an HBM ceiling measured in the same run with a
large device-to-device copy, and each format's time as a multiple of bf16's (the target for
quantized experts: at most 1.5x bf16's time per layer).

    PYTHONPATH=src:benchmarks python benchmarks/grouped_experts_bench.py       # every format,
                                                  # gpt-oss-20b and Qwen3-30B-A3B, batch 1 and 4
    ... --format mxfp4 --model gpt-oss-20b        # one format (bf16 is always timed beside it)
    ... --profile                                 # also the GPU time of each kernel
    ... --sweep [--format fp8]                    # also try other launch parameters per format
    ... --reference                               # also the eager call and the torch reference
    ... --tiny --device cpu                       # the script's logic on small shapes, on the
                                                  # CPU under Triton's interpreter (no timings)

Shapes: gpt-oss-20b (H = I = 2880, top-4) and Qwen3-30B-A3B (H 2048, I 768, top-8). Weights are
random bytes of each format (realistic scales, no NaN), so the times are those of real experts.
Before timing, each quantized format's kernels are checked against the dense kernels on the
dequantized banks (same launch parameters) and against the torch reference.

Each timed call uses the next of several slot sets drawn from a pool much larger than L2, so
the weights of consecutive calls are (mostly) different experts and come from HBM, as in
decode where every layer reads new experts. Bytes count the distinct experts a call reads (the
format's codes and scales). Kernel time is measured on calls replayed from a CUDA graph (GPU
time, as an engine capturing its decode step sees it).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from freetoken.config import EXPERT_FORMATS
from freetoken.kernels import grouped_launch as gl
from freetoken.kernels.grouped_gemm import dequantize_slots
from freetoken.kernels.grouped_reference import reference_grouped_experts
from freetoken.weights.expert_format import K_FAMILY, QuantizedBank, expert_format, fill_random_

MODELS = {"gpt-oss-20b": (2880, 2880, 4), "qwen3-30b-a3b": (2048, 768, 8)}  # H, I, top-k
TINY_MODELS = {"gpt-oss-20b": (96, 64, 2), "qwen3-30b-a3b": (64, 32, 4)}  # (--tiny)
DTYPE = torch.bfloat16
POOL_BYTES = 1 << 30  # pool of bf16 experts per shape, ~20x the H200's 50 MB L2
SLOT_SETS = 16  # calls rotate through these routings
TARGET = 1.5  # quantized time / bf16 time per layer, at most
DEVICE = "cuda"  # (--device cpu: the interpreter, for the script's logic only)


def median_time_s(fn: Callable[[int], object], iters: int, warmup: int) -> float:
    """Median over `iters` calls of fn(i), each timed alone with CUDA events."""
    if DEVICE == "cpu":  # (wall time of one call: the interpreter's, meaningless)
        start = time.perf_counter()
        fn(0)
        return time.perf_counter() - start
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
    if DEVICE == "cpu":
        return median_time_s(lambda _: calls(), 1, 0) / calls_per_graph
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
    if DEVICE == "cpu":
        nbytes = 64 << 20
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = median_time_s(lambda _: dst.copy_(src), iters=20, warmup=3)
    return nbytes / t / 1e9


# ---------------------------------------------------------------------------------------------
# Banks
# ---------------------------------------------------------------------------------------------


class Shape:
    def __init__(self, model: str, tiny: bool = False):
        self.model = model
        self.hidden, self.inter, self.top_k = (TINY_MODELS if tiny else MODELS)[model]
        if tiny:  # (whole K-quant super-blocks of 256 in every format)
            self.hidden, self.inter = 256, 256
        dense_expert = 3 * self.hidden * self.inter * DTYPE.itemsize
        self.slots = 8 if tiny else max(32, POOL_BYTES // dense_expert)

    def expert_bytes(self, fmt_name: str) -> int:
        fmt = expert_format(fmt_name)
        h, i = self.hidden, self.inter
        return fmt.nbytes(2 * i, h, DTYPE) + fmt.nbytes(h, i, DTYPE)


def random_bank(fmt_name: str, slots: int, n: int, k: int, gen: torch.Generator):
    """A bank of random experts of a format, values ~ N(0, 1/k) in size, on the GPU."""
    if fmt_name == "dense":
        return (torch.randn(slots, n, k, device=DEVICE, generator=gen) / k**0.5).to(DTYPE)
    fmt = expert_format(fmt_name)
    parts = fmt.parts(n, k, DTYPE)
    w = torch.randint(
        0, 256, (slots, *parts["w"][0]), dtype=torch.uint8, device=DEVICE, generator=gen
    )
    s_shape = (slots, *parts["s"][0])
    size = 1 / k**0.5
    if fmt_name == "fp8":
        w[(w & 0x7F) == 0x7F] = 0x3A  # (the NaN codes)
        s = (torch.rand(s_shape, device=DEVICE, generator=gen) + 0.5) * size / 60
        return QuantizedBank(fmt, w, s)
    if fmt_name == "mxfp4":
        e = round(torch.tensor(size / 2.6).log2().item()) + 127
        s = torch.randint(e - 2, e + 2, s_shape, dtype=torch.uint8, device=DEVICE, generator=gen)
        return QuantizedBank(fmt, w, s)
    if fmt_name == "q8_0":  # |int8| ~ 64 on average
        s = ((torch.rand(s_shape, device=DEVICE, generator=gen) + 0.5) * size / 64).half()
        return QuantizedBank(fmt, w, s)
    if fmt_name in K_FAMILY:  # (k_mixed: each expert of one of the three types)
        seed = int(torch.randint(2**31, (), generator=gen, device=gen.device))
        cpu = torch.Generator().manual_seed(seed)
        s = fill_random_(fmt, "s", torch.empty(s_shape, dtype=torch.uint8), cpu)
        return QuantizedBank(fmt, w, s.to(DEVICE))
    s = (torch.rand(s_shape, device=DEVICE, generator=gen) * 3 + 0.25).to(torch.float8_e4m3fn)
    g = (torch.rand(slots, n, device=DEVICE, generator=gen) + 0.5) * size / 4
    return QuantizedBank(fmt, w, s.view(torch.uint8), g)


def make_banks(shape: Shape, fmt_name: str, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h, i = shape.hidden, shape.inter
    return (
        random_bank(fmt_name, shape.slots, 2 * i, h, gen),
        random_bank(fmt_name, shape.slots, h, i, gen),
    )


def make_routings(shape: Shape, tokens: int, gen: torch.Generator) -> list[tuple]:
    """SLOT_SETS routings: each token picks top-k distinct slots (tokens may share slots, as in
    real routing), with renormalized random gate weights rounded to bf16."""
    sets = []
    for _ in range(SLOT_SETS):
        slots = torch.stack(
            [torch.randperm(shape.slots, generator=gen)[: shape.top_k] for _ in range(tokens)]
        )
        w = torch.rand(tokens, shape.top_k, generator=gen)
        sets.append((slots.to(DEVICE), (w / w.sum(1, keepdim=True)).to(DEVICE, DTYPE)))
    return sets


# ---------------------------------------------------------------------------------------------
# Checks and timings
# ---------------------------------------------------------------------------------------------


def check(shape: Shape, fmt_name: str, banks, x: torch.Tensor, gen) -> str:
    """The quantized kernels against the dense kernels on the dequantized banks (the same launch
    parameters) and against the torch reference, on one routing of batch 4."""
    if fmt_name == "dense":
        return "-"
    slots, w = make_routings(shape, 4, gen)[0]
    used = slots.unique()
    remap = torch.full((shape.slots,), -1, dtype=torch.long, device=DEVICE)
    remap[used] = torch.arange(len(used), device=DEVICE)
    small = tuple(b.select(used) for b in banks)  # (only the used slots dequantized)
    dense = tuple(dequantize_slots(b, torch.arange(len(used), device=DEVICE), DTYPE) for b in small)
    local = remap[slots]
    ours = gl.triton_grouped_expert_forward(x, local, w, *small)
    saved = {n: getattr(gl, n) for n in gl.LAUNCH_NAMES}
    try:
        for n, v in gl.launch_params(fmt_name).items():
            setattr(gl, n, v)
        theirs = gl.triton_grouped_expert_forward(x, local, w, *dense)
    finally:
        for n, v in saved.items():
            setattr(gl, n, v)
    ref = reference_grouped_experts(x, local, w, *dense)
    scale = ref.float().abs().max().item()
    vs_dense = (ours.float() - theirs.float()).abs().max().item() / scale
    vs_ref = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
    # (under the interpreter, bf16 casts truncate: a few % from the reference)
    ok = vs_dense <= 2**-6 and vs_ref < (1e-2 if DEVICE == "cuda" else 5e-2)
    return f"{'ok' if ok else 'WRONG'} (vs dense kernels {vs_dense:.1e}, vs reference {vs_ref:.1e})"


def bench(shape: Shape, fmt_name: str, banks, tokens: int, x, gen, *, reference=False) -> dict:
    routings = make_routings(shape, tokens, gen)
    distinct = statistics.mean(int(s.unique().numel()) for s, _ in routings)
    nbytes = distinct * shape.expert_bytes(fmt_name)
    xs = x[:tokens]

    def kernel(i: int):
        slots, w = routings[i % SLOT_SETS]
        return gl.triton_grouped_expert_forward(xs, slots, w, *banks)

    def all_routings():
        for i in range(SLOT_SETS):
            kernel(i)

    out = {
        "model": shape.model,
        "format": fmt_name,
        "tokens": tokens,
        "distinct_experts": distinct,
        "mb": nbytes / 1e6,
    }
    out["graph_us"] = graph_time_s(all_routings, SLOT_SETS) * 1e6
    out["graph_gbps"] = nbytes / out["graph_us"] / 1e3
    if reference:
        out["eager_us"] = median_time_s(kernel, iters=200, warmup=20) * 1e6

        def torch_reference(i: int):
            slots, w = routings[i % SLOT_SETS]
            return reference_grouped_experts(xs, slots, w, *banks)

        out["ref_us"] = median_time_s(torch_reference, iters=20, warmup=3) * 1e6
    return out


def profile(shape: Shape, banks, tokens: int, x, gen) -> None:
    """GPU time of each kernel, averaged over the routings."""
    routings = make_routings(shape, tokens, gen)
    for slots, w in routings:  # warm-up
        gl.triton_grouped_expert_forward(x[:tokens], slots, w, *banks)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True
    ) as prof:
        for slots, w in routings * 4:
            gl.triton_grouped_expert_forward(x[:tokens], slots, w, *banks)
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and ev.count:
            print(f"    {ev.key[:40]:40s} {ev.device_time_total / ev.count:7.1f} us")


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------


def sweep_grid(fmt_name: str) -> dict[str, dict[str, list[int]]]:
    # (fp8: BLOCK_K at most its 128-column scale blocks, else a scale gather per weight; q8_0:
    # 32, one scale a row and tile, against wider tiles of several)
    k_choices = {"dense": [64, 128, 256], "fp8": [32, 64, 128], "q8_0": [32, 64, 128, 256]}.get(
        fmt_name, [64, 128, 256]
    )
    return {
        "gate_up": {
            "GATE_UP_BLOCK_N": [8, 16, 32, 64],
            "GATE_UP_BLOCK_K": k_choices,
            "GATE_UP_WARPS": [4, 8],
            "GATE_UP_STAGES": [3],
        },
        "down": {
            "DOWN_BLOCK_N": [16, 32, 64],
            "DOWN_BLOCK_K": k_choices,
            "DOWN_WARPS": [4, 8],
            "DOWN_STAGES": [3],
        },
    }


def _set(fmt_name: str, name: str, value: int) -> None:
    if fmt_name == "dense":
        setattr(gl, name, value)
    else:
        gl.QUANTIZED_LAUNCH[fmt_name][name] = value


def sweep(shape: Shape, fmt_name: str, banks, x, gen, batches=(1, 4)) -> list[str]:
    """Vary one kernel's launch parameters at a time (the other keeps its defaults); returns
    the best setting's line per kernel."""
    best_lines = []
    for kernel, grid in sweep_grid(fmt_name).items():
        defaults = {name: gl.launch_params(fmt_name)[name] for name in grid}
        print(f"\n  sweep {shape.model} {fmt_name} {kernel} (defaults {defaults})")
        results = []
        for values in itertools.product(*grid.values()):
            params = dict(zip(grid, values, strict=True))
            try:
                for name, value in params.items():
                    _set(fmt_name, name, value)
                row = [bench(shape, fmt_name, banks, b, x, gen) for b in batches]
            except Exception as e:  # e.g. out of shared memory, or a BLOCK_K fp4 refuses
                print(f"    {params}: failed ({type(e).__name__})")
                continue
            finally:
                for name, value in defaults.items():
                    _set(fmt_name, name, value)
            results.append((sum(r["graph_us"] for r in row), params, row))
        results.sort(key=lambda r: r[0])
        for _, params, row in results[:8]:
            cells = "  ".join(f"b{r['tokens']} {r['graph_us']:6.1f} us" for r in row)
            print(f"    {cells}  {params}")
        if results:
            best_lines.append(f"{shape.model} {fmt_name} {kernel}: {results[0][1]}")
    return best_lines


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--format",
        default="all",
        choices=["all", *EXPERT_FORMATS],
        help="expert format (bf16 is always timed beside it)",
    )
    parser.add_argument("--model", default="all", choices=["all", *MODELS])
    parser.add_argument("--sweep", action="store_true", help="also sweep launch parameters")
    parser.add_argument("--profile", action="store_true", help="also time each kernel")
    parser.add_argument(
        "--reference", action="store_true", help="also the eager call and the torch reference"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="small shapes (with --device cpu)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a launch parameter of --format's: GATE_UP_BLOCK_K=128, ...",
    )
    args = parser.parse_args()
    for item in args.set:
        name, _, value = item.partition("=")
        if args.format in ("all", "dense"):
            raise SystemExit("--set needs a quantized --format")
        gl.QUANTIZED_LAUNCH[args.format][name] = int(value)
    global DEVICE, SLOT_SETS
    DEVICE = args.device
    if DEVICE == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":  # (read when triton is imported)
            os.execve(
                sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"}
            )
        SLOT_SETS = 2
    if not gl.triton_available() or (DEVICE == "cuda" and not torch.cuda.is_available()):
        raise SystemExit("needs CUDA and triton")
    formats = EXPERT_FORMATS if args.format == "all" else ("dense", args.format)
    formats = tuple(dict.fromkeys(formats))
    models = list(MODELS) if args.model == "all" else [args.model]

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}  torch {torch.__version__}")
    ceiling = hbm_ceiling_gbps()
    print(f"HBM ceiling (d2d copy, read + write): {ceiling:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    rows, best = [], []
    for model in models:
        shape = Shape(model, args.tiny)
        x = torch.randn(4, shape.hidden, device=DEVICE).to(DTYPE)
        print(
            f"\n{model}: H {shape.hidden}, I {shape.inter}, top-{shape.top_k}, "
            f"pool {shape.slots} slots, {SLOT_SETS} routings"
        )
        for fmt_name in formats:
            banks = make_banks(shape, fmt_name)
            print(
                f"  {fmt_name:6s} expert {shape.expert_bytes(fmt_name) / 1e6:6.2f} MB; "
                f"launch {gl.launch_params(fmt_name)}"
            )
            print(f"         check: {check(shape, fmt_name, banks, x, gen)}")
            for tokens in (1, 4):
                r = bench(shape, fmt_name, banks, tokens, x, gen, reference=args.reference)
                rows.append(r)
                extra = ""
                if args.reference:
                    extra = f" | eager {r['eager_us']:7.1f} us | torch {r['ref_us']:8.1f} us"
                print(
                    f"         batch {tokens}: {r['distinct_experts']:.1f} experts, "
                    f"{r['mb']:6.1f} MB, {r['graph_us']:6.1f} us, {r['graph_gbps']:5.0f} GB/s"
                    f"{extra}"
                )
            if args.profile:
                for tokens in (1, 4):
                    print(f"    {fmt_name} batch {tokens} kernels (GPU us per call):")
                    profile(shape, banks, tokens, x, gen)
            if args.sweep and (args.format in ("all", fmt_name)):  # (bf16 only if asked)
                best += sweep(shape, fmt_name, banks, x, gen)
            del banks
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    bf16 = {(r["model"], r["tokens"]): r["graph_us"] for r in rows if r["format"] == "dense"}
    print(
        "\nPer-layer decode kernel time (CUDA graph replay; x bf16: the format's time over "
        f"bf16's at the same shape; target <= {TARGET}x)"
    )
    print("| model | format | batch | experts | MB read | us/layer | GB/s | % of HBM | x bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["graph_us"] / bf16[(r["model"], r["tokens"])]
        mark = "" if r["format"] == "dense" or ratio <= TARGET else " (over)"
        name = "bf16" if r["format"] == "dense" else r["format"]
        print(
            f"| {r['model']} | {name} | {r['tokens']} | {r['distinct_experts']:.1f} | "
            f"{r['mb']:.1f} | {r['graph_us']:.1f} | {r['graph_gbps']:.0f} | "
            f"{100 * r['graph_gbps'] / ceiling:.0f} | {ratio:.2f}{mark} |"
        )
    if best:
        print(
            "\nBest launch parameters per kernel (sum of batch 1 and 4; for the module's "
            "constants, or QUANTIZED_LAUNCH[format]):"
        )
        for line in best:
            print(f"  {line}")


if __name__ == "__main__":
    main()
