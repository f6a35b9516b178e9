"""How many launches a decode step makes per layer on the GPU's code path, counted on the CPU.

    python benchmarks/launch_count.py --family deepseek_v4 --batch 1 --out launches.md
    python benchmarks/launch_count.py --family deepseek_v4 --stacked   # as with STACK_ON_GPU

At batch 1 a decode step's dense work (attention, norms, routers, shared experts) is bound by
launches, not bytes: a CUDA graph still runs its kernels one after another, each a few
microseconds however little it reads (DeepSeek-V4-Flash on an H100: ~0.4 ms a layer against
~0.1 ms of weight bytes, results/2026-12-06-v4-kernels-h100.md). This counts them
where no GPU is: a tiny random checkpoint of the family (tests/tiny_models.py) decodes one
step with every kernel switch of kernels/ that has a "runs here" test turned on, the Triton
kernels run by Triton's interpreter, and each torch op that computes (views and allocations
left out) and each Triton launch is charged to the layer module that made it, those of its side
branches (layers/concurrent.py: off the chain a step waits for, on a GPU with ON_GPU) to the
module's "(beside)" row.

What it cannot see: code that asks `is_cuda` itself (the paged attention of the other
families, the routed experts' grouped kernels, the expert cache's plan and fills) runs its CPU
path here, so those rows count CPU ops, and the routed experts are counted within `moe` as the
fused strategy's CPU path runs them. The V4 attention, hyper-connection, norm, RoPE and router
kernels are the GPU's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # (read when Triton is first imported)

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# Ops that launch nothing: views, allocations, metadata.
NO_LAUNCH = frozenset(
    {
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "unsqueeze",
        "squeeze",
        "expand",
        "slice",
        "select",
        "permute",
        "as_strided",
        "alias",
        "detach",
        "detach_",
        "split",
        "unbind",
        "split_with_sizes",
        "chunk",
        "narrow",
        "diagonal",
        "unfold",
        "lift_fresh",
        "_reshape_alias",
        "reshape",
        "flatten",
        "unflatten",
        "movedim",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "_local_scalar_dense",
        "item",
        "sym_size",
        "dim",
        "size",
        "stride",
        "storage_offset",
        "is_same_size",
    }
)


def switch_kernels_on() -> None:
    """Every kernel's "runs here" test true, so the GPU's code path runs (in the interpreter)."""
    from freetoken.kernels import (
        compressed_decode,
        gated_unit,
        hyper_mix,
        lightning_index,
        norm_rope,
    )

    def always(*args, **kwargs):
        return True

    compressed_decode.kernel_takes = lightning_index.kernel_takes = always
    hyper_mix.kernel_takes = hyper_mix.streams_kernel_takes = always
    norm_rope.available = gated_unit.kernel_takes = always


class Launches(TorchDispatchMode):
    """Counts the torch ops that compute and the Triton launches, by the module running."""

    def __init__(self):
        super().__init__()
        self.where = "other"  # the layer module running ("other": a layer's own code, the head)
        self.beside = False  # inside a side branch (layers/concurrent.py `beside`)
        self.counting = False
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.counting and name not in NO_LAUNCH and not _returns_its_input(name, args, out):
            self.ops[self.place()][name] += 1
        return out

    def triton(self, kernel_name: str) -> None:
        if self.counting:
            self.ops[self.place()]["triton:" + kernel_name] += 1

    def place(self) -> str:
        return self.where + BESIDE if self.beside else self.where


def _returns_its_input(name: str, args, out) -> bool:
    """An op that handed back its input's storage without writing (`to` to the same dtype)."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is None or not isinstance(out, torch.Tensor) or name.endswith("_"):
        return False
    if first.numel() == 0 or out.numel() == 0:
        return False
    return out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def count_triton(mode: Launches) -> None:
    """Charge each interpreted Triton launch to the mode (its own torch ops uncounted)."""
    import triton.runtime.interpreter as interpreter

    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        mode.triton(self.fn.__name__)
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted


BESIDE = " (beside)"  # a module's row of the launches its side branches make


def count_beside(mode: Launches) -> None:
    """Charge the launches of side branches (layers/concurrent.py `beside`: run in order here,
    on a side stream on a GPU with ON_GPU) to their module's "(beside)" row: those leave the
    chain a decode step waits for."""
    from freetoken.layers import concurrent

    original = concurrent.beside

    def counted(fn, *tensors):
        def marked(*args):
            mode.beside = True
            try:
                return fn(*args)
            finally:
                mode.beside = False

        return original(marked, *tensors)

    for module in list(sys.modules.values()):  # (the layers import it by name)
        if module.__name__.startswith("freetoken") and getattr(module, "beside", None) is original:
            module.beside = counted


def attribute(model, mode: Launches) -> None:
    """Each layer's direct children (attn, moe, norms, hyper-connections) name what they run."""
    for layer in model.layers:
        for name, child in layer.named_children():

            def enter(module, args, name=name):
                mode.where = name

            def leave(module, args, out):
                mode.where = "other"

            child.register_forward_pre_hook(enter)
            child.register_forward_hook(leave)


def count_step(
    family: str, batch: int, prompt: int, stacked: bool = False
) -> tuple[dict, list[bool]]:
    """(ops by module, which layers are MoE layers) of one decode step of `batch` sequences
    after `prompt` tokens; `stacked`: with each layer's projections of one input stacked into
    one GEMM (DecoderModel.stack_projections with dense weights)."""
    from freetoken.engine.runner import ModelRunner
    from freetoken.models.loading import load_model
    from tiny_models import build

    switch_kernels_on()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(build(family, Path(tmp) / "m")[0], dtype="bfloat16")
    if stacked:  # (as on a GPU with decoder.STACK_ON_GPU; the CPU stacks only quantized ones)
        loaded.model.stack_projections(dense=True)
    mode = Launches()
    count_triton(mode)
    count_beside(mode)
    attribute(loaded.model, mode)
    runner = ModelRunner(loaded, kv_cache_tokens=64 * (prompt + 8), page_size=8)
    seqs = [runner.new_sequence() for _ in range(batch)]
    vocab = loaded.config.vocab_size
    with torch.inference_mode():
        runner.forward(seqs, [[(7 * b + i) % vocab for i in range(prompt)] for b in range(batch)])
        runner.forward(seqs, [[1] for _ in seqs])  # (first decode step: buffers made)
        with mode:
            mode.counting = True
            runner.forward(seqs, [[2] for _ in seqs])
            mode.counting = False
    return mode.ops, list(loaded.config.moe_layers[: loaded.config.num_layers])


def table(ops: dict, layers: int, family: str, batch: int, stacked: bool) -> list[str]:
    total = sum(sum(c.values()) for c in ops.values())
    beside = sum(sum(c.values()) for where, c in ops.items() if where.endswith(BESIDE))
    how = "projections stacked" if stacked else "projections not stacked"
    lines = [
        f"# launch_count: {family}, tiny random checkpoint, {layers} layers, batch {batch}, {how}",
        "",
        f"- one decode step: {total} launches, {total / layers:.1f} a layer "
        "(the GPU's code path where a kernel switch decides it; see the script's docstring)",
        f"- in side branches (layers/concurrent.py, the rows marked{BESIDE}): {beside}, "
        f"{beside / layers:.1f} a layer; the chain a step waits for: "
        f"{(total - beside) / layers:.1f} a layer",
        "",
        "| module | launches | a layer | Triton | most frequent ops |",
        "|---|---|---|---|---|",
    ]
    for where, counter in sorted(ops.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(counter.values())
        triton = sum(v for k, v in counter.items() if k.startswith("triton:"))
        common = ", ".join(f"{k} {v}" for k, v in counter.most_common(8))
        lines.append(f"| {where} | {n} | {n / layers:.1f} | {triton} | {common} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="deepseek_v4", help="a tests/tiny_models.py family")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=40, help="tokens before the step")
    ap.add_argument("--out", type=Path, help="the table, as markdown")
    ap.add_argument(
        "--json", type=Path, help="the counts: {ops: {module: {op: launches}}, layers, moe_layers}"
    )
    ap.add_argument(
        "--stacked",
        action="store_true",
        help="each layer's projections of one input as one GEMM (a model on a GPU with "
        "decoder.STACK_ON_GPU)",
    )
    args = ap.parse_args()
    stacked = args.stacked
    ops, moe_layers = count_step(args.family, args.batch, args.prompt, stacked)
    layers = len(moe_layers)
    text = "\n".join(table(ops, layers, args.family, args.batch, stacked)) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        counts = {"layers": layers, "moe_layers": sum(moe_layers), "ops": ops}
        args.json.write_text(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
