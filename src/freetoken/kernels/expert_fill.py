"""Copies of expert rows from the pinned host pool into cache slots, launched by the device.

`fill_rows(dst, src, pairs, slots, sink)` copies `src[pairs[j]]` into `dst[slots[j]]` for every
j with `slots[j] != sink`. On CUDA it is one Triton launch of a fixed grid (routes x row
blocks); entries to the sink return at once, so the launch has the same shape whatever the
number of misses and a decode graph can hold it. The kernel reads the host pool where it lies:
the pool is page-locked and mapped (HostExpertStore.pin), and under unified addressing its
host address is valid on the device, so the reads cross PCIe from the SMs with no host call
(the copy engines' cudaMemcpy needs one per copy, or per batch). On the CPU the same copies are
plain indexing (the cache tier in the tests).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs (and CI) take the indexing path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# Elements per program: 8192 bf16 = 16 KiB, so a 6 MiB gate/up row is ~400 programs per route,
# enough loads in flight to keep PCIe busy.
FILL_BLOCK = 8192
FILL_WARPS = 8


class HostRows:
    """A host tensor handed to a Triton kernel by its address (mapped pinned memory: under
    unified addressing the device reads it through the same pointer)."""

    def __init__(self, host: torch.Tensor):
        self.host, self.dtype = host, host.dtype

    def data_ptr(self) -> int:
        return self.host.data_ptr()


def fill_rows(dst: torch.Tensor, src, pairs: torch.Tensor, slots: torch.Tensor, sink: int) -> None:
    """dst [S, ...] (the cache bank), src [P, ...] (the host bank, or HostRows of it on CUDA),
    pairs / slots [R] int64 with slots == sink where nothing is copied."""
    if dst.device.type != "cuda":
        keep = slots != sink
        dst[slots[keep]] = src[pairs[keep]]
        return
    row = dst[0].numel()
    grid = (slots.numel(), triton.cdiv(row, FILL_BLOCK))
    _fill_kernel[grid](dst, src, pairs, slots, sink, row, BLOCK=FILL_BLOCK, num_warps=FILL_WARPS)


if triton is not None:

    @triton.jit
    def _fill_kernel(dst, src, pairs, slots, sink, row, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        slot = tl.load(slots + j)
        if slot != sink:
            pair = tl.load(pairs + j)
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < row
            values = tl.load(src + pair * row + offs, mask=mask)
            tl.store(dst + slot * row + offs, values, mask=mask)
