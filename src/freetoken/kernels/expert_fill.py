"""Copies of experts from the pinned host pool into cache slots, launched by the device.

`fill_experts(banks, pairs, slots, sink)` copies, for every bank `(dst, src)` (an expert is one
row of each), `src[pairs[j]]` into `dst[slots[j]]` for every j with `slots[j] != sink`. Banks may
be any number and any dtypes (a quantized pool has up to seven: codes, block scales, per-row
scales and biases, of uint8, fp32 and the model's dtype): the copy moves raw bytes. On CUDA it is
ONE Triton launch of a fixed grid for all banks: each block of a row (of one bank) is walked by
one program over the R entries, skipping those to the sink (a program takes every grid-th block
where FILL_PROGRAMS caps the grid), so the launch has the same shape
whatever the number of misses and a decode graph can hold it, and a step with nothing to copy
costs a few hundred programs that each read R indices (a grid of routes x blocks, one launch
per bank, cost ~6 us a layer on the H200 machine with nothing to copy).

The banks reach the kernel as a table (`FillTable`: int64 columns of each bank's first block,
source and destination addresses, row strides, row bytes and word width), built once per bank
set and cached by the banks' addresses and layouts, so the kernel's arguments do not depend on
how many banks there are. Each bank is copied in the widest word (16, 8, 4, 2 or 1 bytes) that
divides its row bytes, its row strides and both base addresses, with the alignment stated to the
compiler so that the loads and stores are 16-byte vectors where the layout allows (the reads
cross PCIe: wide, coalesced loads matter). The kernel reads the host pool where it lies: the
pool is page-locked and mapped (HostExpertStore.pin), and under unified addressing its host
address is valid on the device, so the reads cross PCIe from the SMs with no host call (the copy
engines' cudaMemcpy needs one per copy, or per batch). On the CPU the same copies are plain
indexing (the cache tier in the tests); `launch_fill` runs the kernel on CPU tensors under
Triton's interpreter (the tests).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

try:  # Triton is optional: CPU-only installs (and CI) take the indexing path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# Words per program: 4096 int32 words (16 KiB) of a row copied in 16- or 8-byte vectors (the
# 9 MiB of a Qwen3-30B-A3B bf16 expert is ~580 programs, all resident at once on an H200: far
# more bytes in flight than PCIe needs; with 8 warps a thread moves four 16-byte vectors); half
# as many of a row copied a word at a time (odd row sizes or alignments: 8 KiB of 4-byte words,
# 4 of 2-byte, 2 of bytes), whose every word takes its own pointer registers.
FILL_BLOCK_WORDS = 4096
FILL_WARPS = 8
# Programs of a launch at most (None: one a block), each walking every FILL_PROGRAMS-th block. A
# fill waits on PCIe, not on the SMs, and one program a block (~830 of a 13 MiB MXFP4 expert)
# holds most of every SM's warp slots for the whole copy, where the work running beside it (the
# shared expert during a layer's fills, layers/concurrent.py; the next layer's attention during
# a prefetch) needs them; 64 programs would keep 1 MiB of reads in flight, ~20 us of the link's
# 52 GB/s. Uncapped until a GPU has timed a cap: benchmarks/fill_beside.py.
FILL_PROGRAMS: int | None = None
WORD_WIDTHS = (16, 8, 4, 2, 1)  # bytes; 16 and 8 are int32 words known to be 4 or 2 in a row
TABLE_COLUMNS = ("first", "src", "dst", "src_stride", "dst_stride", "row_bytes", "width")
_TABLES: OrderedDict[tuple, FillTable] = OrderedDict()
_TABLES_KEPT = 64  # bank sets remembered (each a few hundred bytes of device memory)


class HostRows:
    """A host tensor handed to a Triton kernel by its address (mapped pinned memory: under
    unified addressing the device reads it through the same pointer)."""

    def __init__(self, host: torch.Tensor):
        self.host, self.dtype = host, host.dtype

    def data_ptr(self) -> int:
        return self.host.data_ptr()

    def numel(self) -> int:
        return self.host.numel()


def fill_experts(
    banks, pairs: torch.Tensor, slots: torch.Tensor, sink: int, table: FillTable | None = None
) -> None:
    """banks: ((dst [S, ...] the cache bank, src [P, ...] the host bank, or HostRows of it on
    CUDA), ...), any number of them, each a row per expert (of any dtype; a row of dst and of
    src hold the same bytes); pairs / slots [R] int64 with slots == sink where nothing is
    copied."""
    if banks[0][0].device.type != "cuda":
        keep = slots != sink
        for dst, src in banks:
            src = src.host if isinstance(src, HostRows) else src
            dst[slots[keep]] = src[pairs[keep]]
        return
    launch_fill(banks, pairs, slots, sink, table)


def launch_fill(
    banks, pairs: torch.Tensor, slots: torch.Tensor, sink: int, table: FillTable | None = None
) -> None:
    """The copy kernel itself (CUDA, or CPU tensors under TRITON_INTERPRET=1): one launch of a
    grid fixed by the banks' row sizes (`table`: `fill_table(banks)`, if the caller holds it)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    table = table or fill_table(banks)
    if table.grid == 0:
        return
    _fill_kernel[(min(table.grid, FILL_PROGRAMS or table.grid),)](
        table.columns,
        pairs,
        slots,
        slots.numel(),
        sink,
        table.grid,
        NB=table.padded,
        BLOCK=FILL_BLOCK_WORDS,
        num_warps=FILL_WARPS,
    )


class FillTable:
    """A bank set as the fill kernel reads it: `columns` int64 [len(TABLE_COLUMNS), padded]
    on the banks' device (padding banks start past the grid), and the grid."""

    def __init__(self, rows: list[dict[str, int]], device: torch.device):
        self.banks = len(rows)
        self.padded = max(2, triton.next_power_of_2(len(rows)) if triton else len(rows))
        first = 0
        for row in rows:
            row["first"] = first
            first += -(-row["row_bytes"] // block_bytes(row["width"]))
        self.grid = first
        self.widths = [row["width"] for row in rows]
        values = [[row[c] for row in rows] for c in TABLE_COLUMNS]
        values[0] += [2**62] * (self.padded - len(rows))  # never <= a program id
        for column in values[1:]:
            column += [0] * (self.padded - len(rows))
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fill_experts met a new set of banks while a CUDA graph is being captured: "
                "call it (or fill_table) once eagerly on these banks before capturing"
            )
        self.columns = torch.tensor(values, dtype=torch.int64).to(device)


def _geometry(bank) -> tuple[int, int, int]:
    """(address, row stride in bytes, row bytes) of a bank [rows, ...] whose rows are each
    contiguous."""
    t = bank.host if isinstance(bank, HostRows) else bank
    if t.dim() == 0:
        raise ValueError("a bank needs a row dimension")
    expected = t.element_size()
    row_bytes = expected
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride * t.element_size() != expected:
            raise ValueError(
                f"bank rows must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
            )
        expected *= size
        row_bytes *= size
    return t.data_ptr(), t.stride(0) * t.element_size(), row_bytes


def block_bytes(width: int) -> int:
    """Bytes a program copies of a row copied in words of `width` bytes (the kernel's block:
    int32 words from 4 bytes on, vectors of them from 8)."""
    return (FILL_BLOCK_WORDS if width >= 8 else FILL_BLOCK_WORDS // 2) * min(width, 4)


def _width(*values: int) -> int:
    """The widest word that divides every value (addresses, strides, sizes)."""
    for width in WORD_WIDTHS:
        if all(v % width == 0 for v in values):
            return width
    return 1


def fill_table(banks) -> FillTable:
    """The table of a bank set, built on first use and kept (keyed by the banks' addresses and
    layouts, so a re-allocated bank set gets its own). Reading the layouts takes ~20 us of host
    time: a caller filling the same banks every layer step builds the table once and passes it
    to `fill_experts`."""
    geometry = tuple((_geometry(dst), _geometry(src)) for dst, src in banks)
    device = banks[0][0].device
    key = (device, geometry)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    rows = []
    for (dst, dst_stride, dst_row), (src, src_stride, src_row) in geometry:
        if dst_row != src_row:
            raise ValueError(
                f"a bank's rows differ: {dst_row} bytes in the cache, {src_row} in the pool"
            )
        width = _width(dst, src, dst_stride, src_stride, dst_row)
        rows.append(
            {
                "src": src,
                "dst": dst,
                "src_stride": src_stride,
                "dst_stride": dst_stride,
                "row_bytes": dst_row,
                "width": width,
            }
        )
    table = FillTable(rows, device)
    _TABLES[key] = table
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return table


if triton is not None:

    @triton.jit
    def _copy_row(
        src,
        dst,
        src_stride,
        dst_stride,
        row_bytes,
        block,
        pair,
        slot,
        WORD: tl.constexpr,
        WORD_BYTES: tl.constexpr,
        VEC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Block `block` (BLOCK words) of row `pair` of the source to row `slot` of the
        destination; addresses and sizes are multiples of VEC words (what makes the accesses
        vectors)."""
        words = tl.multiple_of(row_bytes // WORD_BYTES, VEC)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words
        # (the alignment stated on the pointers: an integer's is not carried over)
        s_ptr = (src + pair * src_stride).to(tl.pointer_type(WORD))
        d_ptr = (dst + slot * dst_stride).to(tl.pointer_type(WORD))
        s_ptr = tl.multiple_of(s_ptr, VEC * WORD_BYTES)
        d_ptr = tl.multiple_of(d_ptr, VEC * WORD_BYTES)
        tl.store(d_ptr + offs, tl.load(s_ptr + offs, mask=mask), mask=mask)

    @triton.jit
    def _copy_block(table, b, pair, slot, firsts, NB: tl.constexpr, BLOCK: tl.constexpr):
        """Block b of the bank set (`FillTable`'s numbering) for one route: of the last bank
        whose first block is at or before b, in that bank's widest word."""
        bank = tl.sum((firsts <= b).to(tl.int32), axis=0) - 1
        block = b - tl.load(table + bank)
        src = tl.load(table + NB + bank)
        dst = tl.load(table + 2 * NB + bank)
        src_stride = tl.load(table + 3 * NB + bank)
        dst_stride = tl.load(table + 4 * NB + bank)
        row_bytes = tl.load(table + 5 * NB + bank)
        width = tl.load(table + 6 * NB + bank)
        row = src, dst, src_stride, dst_stride, row_bytes, block, pair, slot
        if width == 16:  # int32 words, 4 a vector
            _copy_row(*row, tl.int32, 4, 4, BLOCK)
        elif width == 8:
            _copy_row(*row, tl.int32, 4, 2, BLOCK)
        elif width == 4:  # one word a lane, half as many a program
            _copy_row(*row, tl.int32, 4, 1, BLOCK // 2)
        elif width == 2:
            _copy_row(*row, tl.int16, 2, 1, BLOCK // 2)
        else:
            _copy_row(*row, tl.uint8, 1, 1, BLOCK // 2)

    @triton.jit
    def _fill_kernel(table, pairs, slots, R, sink, blocks, NB: tl.constexpr, BLOCK: tl.constexpr):
        """Every route j not to the sink: the program's blocks of row pairs[j] (its id, then
        every grid-th after it, up to `blocks`) to row slots[j]."""
        firsts = tl.load(table + tl.arange(0, NB))
        j = 0
        while j < R:  # (`while`: the CPU interpreter cannot range over a runtime bound)
            slot = tl.load(slots + j)
            if slot != sink:
                pair = tl.load(pairs + j)
                b = tl.program_id(0)
                while b < blocks:
                    _copy_block(table, b, pair, slot, firsts, NB, BLOCK)
                    b += tl.num_programs(0)
            j += 1
