"""fla's chunked gated delta rule (kernels/gated_delta.chunked) against the torch rule, at several
head shapes, with the time of each of its first calls: the first call for a shape autotunes
fla's kernels (49 s for the first shape in a fresh process on the H200 machine, 19 s for the
next; Triton caches the choices on disk). Needs CUDA and fla-core.

    python benchmarks/gated_delta_first_calls.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from freetoken.kernels import gated_delta
from freetoken.layers.gated_deltanet import _prepare, chunk_gated_delta_rule

SHAPES = [(2, 4, 16, 8), (2, 4, 16, 16), (2, 4, 32, 32), (2, 4, 64, 64), (16, 32, 128, 128)]


def case(hk: int, hv: int, dk: int, dv: int, t: int, reps: int = 3) -> str:
    """Relative error of fla's outputs and final state against the torch rule (fp32, on the
    same bf16 inputs, from a nonzero state), and the milliseconds of `reps` calls in turn."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = randn(1, t, hk, dk).bfloat16(), randn(1, t, hk, dk).bfloat16()
    v = randn(1, t, hv, dv).bfloat16()
    a, b = randn(1, t, hv).bfloat16(), randn(1, t, hv).bfloat16()
    g, beta = -0.5 * F.softplus(a.float()), b.sigmoid()
    state = randn(1, hv, dk, dv) * 0.1
    ref, ref_state = chunk_gated_delta_rule(*_prepare(q, k, v, g, beta), state)
    ref = ref.transpose(1, 2)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out, final = gated_delta.chunked(q, k, v, g, beta, state)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    state_err = ((final - ref_state).abs().max() / ref_state.abs().max()).item()
    return (
        f"| {hk} | {hv} | {dk} | {dv} | {t} | {err:.1e} | {state_err:.1e} | "
        f"{', '.join(f'{x:.1f}' for x in times)} |"
    )


def main() -> int:
    probe = torch.zeros(
        1, 2, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu"
    )
    if not gated_delta.chunked_available(probe):
        print("needs CUDA and fla-core", file=sys.stderr)
        return 1
    print("| key heads | value heads | dk | dv | tokens | out rel err | state rel err | ms |")
    print("|---|---|---|---|---|---|---|---|")
    for dims in SHAPES:
        print(case(*dims, t=300), flush=True)
    for t in (1024, 4096, 8192, 16384, 8000):
        print(case(16, 32, 128, 128, t), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
