"""Copies of experts from the pinned host pool into cache slots, launched by the device.

`fill_experts(banks, pairs, slots, sink)` copies, for every bank `(dst, src)` (an expert is one
row of each), `src[pairs[j]]` into `dst[slots[j]]` for every j with `slots[j] != sink`. On CUDA
it is ONE Triton launch of a fixed grid for all banks: each program owns one block of a row
(of one bank) and walks the R entries, skipping those to the sink, so the launch has the same
shape whatever the number of misses and a decode graph can hold it, and a step with nothing
to copy costs a few hundred programs that each read R indices (a grid of routes x blocks, one
launch per bank, cost ~6 us a layer on the H200 machine with nothing to copy). The kernel reads
the host pool where it lies: the pool is page-locked and mapped (HostExpertStore.pin), and
under unified addressing its host address is valid on the device, so the reads cross PCIe from
the SMs with no host call (the copy engines' cudaMemcpy needs one per copy, or per batch). On
the CPU the same copies are plain indexing (the cache tier in the tests).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs (and CI) take the indexing path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# Elements per program: 8192 bf16 = 16 KiB, so the 9 MiB of a Qwen3-30B-A3B expert is ~580
# programs, all resident at once on an H200: far more bytes in flight than PCIe needs.
FILL_BLOCK = 8192
FILL_WARPS = 8


class HostRows:
    """A host tensor handed to a Triton kernel by its address (mapped pinned memory: under
    unified addressing the device reads it through the same pointer)."""

    def __init__(self, host: torch.Tensor):
        self.host, self.dtype = host, host.dtype

    def data_ptr(self) -> int:
        return self.host.data_ptr()

    def numel(self) -> int:
        return self.host.numel()


def fill_experts(banks, pairs: torch.Tensor, slots: torch.Tensor, sink: int) -> None:
    """banks: ((dst [S, ...] the cache bank, src [P, ...] the host bank, or HostRows of it on
    CUDA), ...), two or three of them (gate/up, down, and the gate/up biases where experts
    have them); pairs / slots [R] int64 with slots == sink where nothing is copied."""
    if banks[0][0].device.type != "cuda":
        keep = slots != sink
        for dst, src in banks:
            dst[slots[keep]] = src[pairs[keep]]
        return
    if len(banks) not in (2, 3):
        raise ValueError(f"fill_experts takes two or three banks, got {len(banks)}")
    (dst0, src0), (dst1, src1) = banks[:2]
    dst2, src2 = banks[2] if len(banks) == 3 else (dst1, src1)  # (row2 0: never read)
    row0, row1 = dst0[0].numel(), dst1[0].numel()
    row2 = dst2[0].numel() if len(banks) == 3 else 0
    blocks0 = triton.cdiv(row0, FILL_BLOCK)
    blocks01 = blocks0 + triton.cdiv(row1, FILL_BLOCK)
    grid = (blocks01 + triton.cdiv(row2, FILL_BLOCK),)
    _fill_kernel[grid](
        dst0, src0, row0, dst1, src1, row1, dst2, src2, row2, blocks0, blocks01,
        pairs, slots, slots.numel(), sink, BLOCK=FILL_BLOCK, num_warps=FILL_WARPS,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _copy_block(dst, src, row, block, pairs, slots, R, sink, BLOCK: tl.constexpr):
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row
        j = 0
        while j < R:  # (`while`: the CPU interpreter cannot range over a runtime bound)
            slot = tl.load(slots + j)
            if slot != sink:
                pair = tl.load(pairs + j)
                values = tl.load(src + pair * row + offs, mask=mask)
                tl.store(dst + slot * row + offs, values, mask=mask)
            j += 1

    @triton.jit
    def _fill_kernel(
        dst0, src0, row0, dst1, src1, row1, dst2, src2, row2, blocks0, blocks01,
        pairs, slots, R, sink, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        if pid < blocks0:
            _copy_block(dst0, src0, row0, pid, pairs, slots, R, sink, BLOCK)
        elif pid < blocks01:
            _copy_block(dst1, src1, row1, pid - blocks0, pairs, slots, R, sink, BLOCK)
        else:
            _copy_block(dst2, src2, row2, pid - blocks01, pairs, slots, R, sink, BLOCK)
