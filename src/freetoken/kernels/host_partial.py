"""The merge of a layer's GPU output with the CPU's fp32 partial, read where the CPU wrote it:
`out = gpu + partial.to(gpu.dtype)` (the eager path's sum, rounded the same way), with the
partial in mapped pinned host memory (moe/doorbell.py), so a decode graph needs no copy node
to bring it over.

It reads host memory and never writes it: a store from the SMs to a word the CPU writes too
(the doorbell's `done`) can sit in the GPU's L2, where the stream's wait on that word then
reads it instead of the CPU's answer; on the H200 machine that once doubled hybrid's step.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: only CUDA runs this (the CPU tier merges with torch).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

MERGE_BLOCK = 1024


def add_host_partial(gpu: torch.Tensor, partial) -> torch.Tensor:
    """gpu [T, H] (contiguous), partial: HostRows of an fp32 buffer of at least T * H values."""
    out = torch.empty_like(gpu)
    n = gpu.numel()
    _merge_kernel[(triton.cdiv(n, MERGE_BLOCK),)](out, gpu, partial, n, BLOCK=MERGE_BLOCK)
    return out


if triton is not None:

    @triton.jit
    def _merge_kernel(out, gpu, partial, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        # volatile: read from host memory now, never from a cache line of an earlier step
        p = tl.load(partial + offs, mask=mask, other=0.0, volatile=True)
        g = tl.load(gpu + offs, mask=mask, other=0.0)
        y = g.to(tl.float32) + p.to(g.dtype).to(tl.float32)
        tl.store(out + offs, y.to(g.dtype), mask=mask)
