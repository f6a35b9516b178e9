"""Dense layers kept quantized on the CPU (a GGUF file's blocks, layers/linear.py).

Two measurements:

    --kernel        the native layer alone, per format, on the 0.5B Qwen's shapes (its output
                    head, an MLP down projection and an up projection): ms a call of one row of
                    x, and GB/s of the weight's bytes, kept quantized (`native_qlinear`) and
                    dequantized (`native_linear` on the same values); `--tiny`: small shapes
    --model FILE    decode of a GGUF file through the engine, as /tmp/speed.py measured it: a
                    128-token prompt, then 8 and 72 new tokens (greedy, no stop): decode tok/s =
                    64 / (t72 - t8), the best of `--repeats`; with the dense layers kept
                    quantized and, for comparison, dequantized at load (as before: the
                    conversion's values in the model's dtype, the same kernels)

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from freetoken.kernels.cpu_linear import native_linear, native_qlinear
from freetoken.models import loading
from freetoken.weights.expert_format import QuantizedWeight, expert_format, fill_random_

SHAPES = {"head": (151936, 896), "down": (896, 4864), "up": (4864, 896)}  # [N, K]
TINY = {"head": (4096, 256), "down": (256, 512), "up": (512, 256)}


def random_weight(name: str, rows: int, cols: int) -> QuantizedWeight:
    fmt = expert_format(name)
    parts = {}
    for part, (shape, dtype) in fmt.parts(rows, cols, torch.float32).items():
        bank = torch.empty(1, *shape, dtype=dtype)
        if part == "g":
            bank.fill_(2.0**-7)
        else:
            fill_random_(fmt, part, bank)
        parts[part] = bank[0]
    return QuantizedWeight(fmt, parts["w"], parts["s"], parts.get("g"))


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def kernel_table(formats: list[str], shapes: dict, repeats: int) -> list[str]:
    rows = [
        "| format | layer | N x K | dtype | kept ms | kept GB/s | dense ms | dense GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    torch.set_grad_enabled(False)
    for name in formats:
        for layer, (n, k) in shapes.items():
            if k % expert_format(name).col_block:
                continue
            weight = random_weight(name, n, k)
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(1, k).to(dtype)
                dense = weight.dequantize(dtype)
                kept = best(lambda: native_qlinear(x, weight, None), repeats)  # noqa: B023
                plain = best(lambda: native_linear(x, dense, None), repeats)  # noqa: B023
                dense_bytes = dense.numel() * dense.element_size()
                rows.append(
                    f"| {name} | {layer} | {n} x {k} | {str(dtype)[6:]} | {kept * 1e3:.2f} | "
                    f"{weight.nbytes / kept / 1e9:.1f} | {plain * 1e3:.2f} | "
                    f"{dense_bytes / plain / 1e9:.1f} |"
                )
    return rows


def decode_table(model: str, dtypes: list[str], repeats: int) -> list[str]:
    from freetoken.config import EngineConfig
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams
    from freetoken.models.gguf import resolve

    path = resolve(model)
    rows = [
        "| dense layers | dtype | 8 new tokens s | 72 new tokens s | decode tok/s |",
        "|---|---|---|---|---|",
    ]
    keep = loading.dense_storage
    for dtype in dtypes:
        for mode in ("kept quantized", "dequantized"):
            loading.dense_storage = keep if mode == "kept quantized" else (lambda *a: frozenset())
            engine = LLMEngine.from_config(
                EngineConfig(model=path, dtype=dtype, kv_cache_tokens=2048, max_model_len=2048)
            )
            ids = list(range(1000, 1128))
            times = {8: [], 72: []}
            for _ in range(repeats):
                for n in (8, 72):
                    start = time.perf_counter()
                    engine.generate(
                        [ids], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                    )
                    times[n].append(time.perf_counter() - start)
            t8, t72 = min(times[8]), min(times[72])
            rows.append(f"| {mode} | {dtype} | {t8:.2f} | {t72:.2f} | {64 / (t72 - t8):.1f} |")
            del engine
    loading.dense_storage = keep
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a quick check)")
    parser.add_argument("--formats", nargs="+", default=["q8_0", "q4_k", "q5_k", "q6_k", "mxfp4"])
    parser.add_argument("--model", help="a GGUF file (or its converted directory)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="(the CPU only)")
    args = parser.parse_args()
    if args.kernel:
        print("\n".join(kernel_table(args.formats, TINY if args.tiny else SHAPES, args.repeats)))
    if args.model:
        print("\n".join(decode_table(args.model, args.dtype, args.repeats)))


if __name__ == "__main__":
    main()
