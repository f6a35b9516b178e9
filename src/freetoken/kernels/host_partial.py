"""The merge of a layer's GPU output with the CPU's fp32 partial, read where the CPU wrote it:
`gpu += partial.to(gpu.dtype)` in place (the eager path's sum, rounded the same way), with the
partial in mapped pinned host memory (moe/doorbell.py), so a decode graph needs no copy node
to bring it over, and no wait node either: the kernel itself spins until the listener's
`done` word holds the number the plan rang with, and does nothing when the plan did not ring.

It reads host memory and never writes it: a store from the SMs to a word the CPU writes too
can sit in the GPU's L2, where the device's later reads of that word find it instead of the
CPU's answer; on the H200 machine that once doubled hybrid's step.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: only CUDA runs this (the CPU tier merges with torch).
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer as device_clock
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

MERGE_BLOCK = 1024


def add_host_partial_(
    gpu: torch.Tensor, partial, words, done: int, seq: torch.Tensor, rang: torch.Tensor, stamp=None
) -> torch.Tensor:
    """gpu [T, H] (contiguous) += partial (HostRows of an fp32 buffer of at least T * H values)
    once words[done] == seq[1], where `rang` (a bool on the device) is set; returns gpu.
    `stamp`: an int64 the device's clock is written to once the first block is done
    (moe/split.py `StepClock`), or None."""
    n = gpu.numel()
    _merge_kernel[(triton.cdiv(n, MERGE_BLOCK),)](
        gpu,
        partial,
        words,
        done,
        seq,
        rang,
        n,
        seq if stamp is None else stamp,
        BLOCK=MERGE_BLOCK,
        STAMP=stamp is not None,
    )
    return gpu


if triton is not None:

    @triton.jit
    def _merge_kernel(
        gpu, partial, words, done, seq, rang, n, stamp, BLOCK: tl.constexpr, STAMP: tl.constexpr
    ):
        pid = tl.program_id(0)
        if tl.load(rang):
            want = tl.load(seq + 1).to(tl.int32)
            # volatile: from host memory at every read, never from a cache line
            seen = tl.load(words + done, volatile=True)
            while seen != want:
                seen = tl.load(words + done, volatile=True)
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            p = tl.load(partial + offs, mask=mask, other=0.0, volatile=True)
            g = tl.load(gpu + offs, mask=mask, other=0.0)
            y = g.to(tl.float32) + p.to(g.dtype).to(tl.float32)
            tl.store(gpu + offs, y.to(g.dtype), mask=mask)
        if STAMP:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if pid == 0:
                tl.store(stamp, device_clock())
