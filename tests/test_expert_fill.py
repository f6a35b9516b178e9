"""The expert fill (`freetoken.kernels.expert_fill`): any number of banks of any dtypes, each an
expert's row, copied pool row -> cache slot for every entry not to the sink, every other byte
left as it was.

- The CPU tier's indexing path.
- The bank table: the word each bank is copied in, the grid, kept per bank set.
- The Triton kernel under the CPU interpreter (TRITON_INTERPRET must be set before triton is
  imported: one subprocess), on a quantized pool's seven banks and on awkward layouts.
- The kernel on CUDA from mapped pinned memory, and inside a CUDA graph (skip without CUDA).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from compiled import run_compiled
from freetoken.kernels.expert_fill import HostRows, block_bytes, fill_experts
from interpreted import run_interpreted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (dev extras, Linux)"
)

# A quantized pool's banks (moe/store.py BANK_NAMES order): one expert's row of each, as nvfp4
# gpt-oss-like experts at a small size (H 96, I 48) with their biases, plus an fp8 scale bank
# of an odd row size.
QUANTIZED_ROWS = {
    "w_gate_up": ((96, 48), torch.uint8),
    "w_down": ((96, 24), torch.uint8),
    "b_gate_up": ((96,), torch.bfloat16),
    "s_gate_up": ((96, 6), torch.uint8),
    "s_down": ((96, 3), torch.uint8),
    "g_gate_up": ((96,), torch.float32),
    "g_down": ((96,), torch.float32),
    "s_fp8": ((3, 5), torch.float32),  # 60 bytes: 4-byte words
}


def random_bank(rows: int, shape, dtype, gen) -> torch.Tensor:
    """Random bytes of every value (NaN patterns too: the copy moves bytes, not values)."""
    nbytes = rows * dtype.itemsize
    for n in shape:
        nbytes *= n
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(rows, *shape)


def make_banks(specs, pool: int, slots: int, gen):
    """(dst, src) banks: sources random, destinations poisoned with other random bytes."""
    return [
        (random_bank(slots, shape, dtype, gen), random_bank(pool, shape, dtype, gen))
        for shape, dtype in specs
    ]


def routing(pool: int, slots: int, entries: int, real: int, gen):
    """R entries, `real` of them to distinct slots, the rest to the sink (= slots), shuffled."""
    slot_ids = torch.full((entries,), slots, dtype=torch.int64)
    slot_ids[:real] = torch.randperm(slots, generator=gen)[:real]
    pairs = torch.randint(0, pool, (entries,), generator=gen)
    order = torch.randperm(entries, generator=gen)
    return pairs[order], slot_ids[order]


def check_filled(banks, before, pairs, slots, sink) -> bool:
    """Every byte of every bank: filled slots hold their pair's row, the others are untouched."""
    for (dst, src), old in zip(banks, before, strict=True):
        want = old.clone()
        keep = slots != sink
        want[slots[keep]] = src[pairs[keep]]
        if not torch.equal(dst.view(torch.uint8), want.view(torch.uint8)):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# CPU tier and the table
# ---------------------------------------------------------------------------------------------


def test_cpu_tier_copies_every_bank_by_indexing():
    gen = torch.Generator().manual_seed(0)
    banks = make_banks(QUANTIZED_ROWS.values(), pool=12, slots=6, gen=gen)
    pairs, slots = routing(12, 6, entries=8, real=4, gen=gen)
    before = [dst.clone() for dst, _ in banks]
    fill_experts(banks, pairs, slots, 6)
    assert check_filled(banks, before, pairs, slots, 6)
    # nothing to copy: nothing changes
    fill_experts(banks, pairs, torch.full_like(slots, 6), 6)
    assert check_filled(banks, before, pairs, slots, 6)


@needs_triton
def test_each_bank_is_copied_in_the_widest_word_its_layout_allows():
    from freetoken.kernels.expert_fill import fill_table

    gen = torch.Generator().manual_seed(1)
    specs = [
        ((4096,), torch.bfloat16),
        ((7, 3), torch.float32),
        ((5,), torch.uint8),
        ((12,), torch.int16),
        ((3,), torch.float64),
    ]
    banks = make_banks(specs, pool=4, slots=3, gen=gen)
    table = fill_table(banks)
    # rows of 8192, 84, 5, 24 and 24 bytes (the allocator's bases are 16-byte aligned)
    assert table.widths == [16, 4, 1, 8, 8]
    assert table.grid == -(-8192 // block_bytes(16)) + 4
    assert fill_table(banks) is table  # kept for the same banks
    assert fill_table([tuple(pair) for pair in banks]) is table  # (by their layouts too)
    moved = banks[1][0]
    moved.set_(torch.empty_like(moved))  # the same tensor, another address: a table of its own
    assert fill_table(banks) is not table and fill_table(banks).widths == table.widths
    long = make_banks(
        [((3, 1001), torch.float32), ((2 * block_bytes(1) + 5,), torch.uint8)],
        pool=4,
        slots=3,
        gen=gen,
    )
    assert fill_table(long).widths == [4, 1] and fill_table(long).grid == 2 + 3
    # a bank that starts 2 bytes into its storage is copied in 2-byte words
    src = random_bank(5, (9,), torch.int16, gen)
    shifted = torch.empty(3 * 8 + 1, dtype=torch.int16)[1:].view(3, 8)
    assert fill_table([(shifted, src[:, 1:])]).widths == [2]
    # other banks, another table
    assert fill_table(make_banks(specs, pool=4, slots=3, gen=gen)) is not table
    with pytest.raises(ValueError, match="rows differ"):
        fill_table([(banks[0][0], banks[1][1])])


# ---------------------------------------------------------------------------------------------
# The kernel under the CPU interpreter
# ---------------------------------------------------------------------------------------------


def _interpreter_cases() -> dict[str, bool]:
    """Runs in a subprocess with TRITON_INTERPRET=1: case -> every byte as it should be."""
    from freetoken.kernels import expert_fill
    from freetoken.kernels.expert_fill import fill_table, launch_fill

    programs = expert_fill.FILL_PROGRAMS

    gen = torch.Generator().manual_seed(2)
    res = {}

    def run(key, banks, pool, slots, entries, real, host_rows=False):
        pairs, slot_ids = routing(pool, slots, entries, real, gen)
        before = [dst.clone() for dst, _ in banks]
        launch_fill(
            [(dst, HostRows(src) if host_rows else src) for dst, src in banks],
            pairs,
            slot_ids,
            slots,
        )
        res[key] = check_filled(banks, before, pairs, slot_ids, slots)

    quantized = list(QUANTIZED_ROWS.values())
    run("quantized_pool", make_banks(quantized, 9, 5, gen), 9, 5, entries=6, real=3)
    run("host_rows", make_banks(quantized, 9, 5, gen), 9, 5, entries=4, real=4, host_rows=True)
    run("all_to_the_sink", make_banks(quantized, 9, 5, gen), 9, 5, entries=4, real=0)
    # rows of several blocks with a partial last one, in 16-, 4- and 1-byte words
    long_rows = [
        ((block_bytes(16) // 2 + 40,), torch.bfloat16),
        ((3, 1001), torch.float32),
        ((2 * block_bytes(1) + 5,), torch.uint8),
    ]
    run("long_rows", make_banks(long_rows, 6, 4, gen), 6, 4, entries=5, real=2)
    # fewer programs than blocks (a launch's grid is capped): each walks every grid-th block
    expert_fill.FILL_PROGRAMS = 2
    banks = make_banks(long_rows, 6, 4, gen)
    assert fill_table(banks).grid > 2 * expert_fill.FILL_PROGRAMS
    run("fewer_programs_than_blocks", banks, 6, 4, entries=5, real=3)
    expert_fill.FILL_PROGRAMS = programs
    # every word width: banks whose rows and bases are 8, 4, 2 and 1-byte aligned only
    pool_rows = torch.empty(7 * 40 + 3, dtype=torch.uint8)
    slot_rows = torch.empty(4 * 40 + 3, dtype=torch.uint8)
    for offset, row in ((0, 24), (4, 36), (2, 10), (1, 7), (3, 40)):
        src = pool_rows[offset : offset + 7 * row].view(7, row)
        dst = slot_rows[offset : offset + 4 * row].view(4, row)
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, generator=gen))
        dst.copy_(torch.randint(0, 256, dst.shape, dtype=torch.uint8, generator=gen))
        run(f"aligned_{offset}_{row}", [(dst, src)], 7, 4, entries=3, real=2)
    # strided rows (a layer's view of a larger bank: rows of a [S, 2, ...] tensor)
    wide_dst = random_bank(4, (2, 32), torch.float32, gen)
    wide_src = random_bank(6, (2, 32), torch.float32, gen)
    run("strided_rows", [(wide_dst[:, 1], wide_src[:, 0])], 6, 4, entries=4, real=3)
    return res


INTERPRETER_CASES = [
    "quantized_pool",
    "host_rows",
    "all_to_the_sink",
    "long_rows",
    "fewer_programs_than_blocks",
    "aligned_0_24",
    "aligned_4_36",
    "aligned_2_10",
    "aligned_1_7",
    "aligned_3_40",
    "strided_rows",
]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, bool]:
    return run_interpreted("test_expert_fill", "_interpreter_cases", timeout=300)


@needs_triton
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_the_kernel_under_the_interpreter_copies_every_byte(interpreter_results, case):
    assert interpreter_results[case]


def _compiled() -> list[str]:
    """The fill kernel compiled for sm_90 over a bank set of every word width."""
    import compiled
    from freetoken.kernels.expert_fill import launch_fill

    gen = torch.Generator().manual_seed(3)
    banks = make_banks(list(QUANTIZED_ROWS.values()), 6, 4, gen)
    pairs, slots = routing(6, 4, 5, 3, gen)
    launch_fill(banks, pairs, slots, 4)
    return [c["name"] for c in compiled.COMPILED]


@needs_triton
def test_the_kernel_compiles_for_the_gpu():
    """The fill kernel compiled for sm_90 (tests/compiled.py: nothing launched)."""
    assert run_compiled("test_expert_fill", "_compiled", timeout=300) == ["_fill_kernel"]


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


def pinned_pool(specs, pool: int, gen):
    """Host banks page-locked and mapped, as HostExpertStore.pin leaves them."""
    return [random_bank(pool, shape, dtype, gen).pin_memory() for shape, dtype in specs]


@needs_cuda
@needs_triton
@pytest.mark.parametrize("shapes", ["quantized", "qwen3_mxfp4", "gpt_oss_fp8"])
def test_cuda_fill_from_mapped_pinned_memory(shapes):
    specs = {
        "quantized": list(QUANTIZED_ROWS.values()),
        # Qwen3-30B-A3B mxfp4 experts; gpt-oss-20b fp8 experts with its 128 x 128 block scales
        # (45 x 23 fp32 = 4140-byte rows: 4-byte words) and biases
        "qwen3_mxfp4": [
            ((1536, 1024), torch.uint8),
            ((2048, 384), torch.uint8),
            ((1536, 64), torch.uint8),
            ((2048, 24), torch.uint8),
        ],
        "gpt_oss_fp8": [
            ((5760, 2880), torch.uint8),
            ((2880, 2880), torch.uint8),
            ((5760,), torch.bfloat16),
            ((45, 23), torch.float32),
            ((23, 23), torch.float32),
        ],
    }[shapes]
    gen = torch.Generator().manual_seed(4)
    pool, slots = 6, 5
    host = pinned_pool(specs, pool, gen)
    cache = [random_bank(slots, shape, dtype, gen).cuda() for shape, dtype in specs]
    banks = [(dst, HostRows(src)) for dst, src in zip(cache, host, strict=True)]
    for real in (3, 0, 5):
        pairs, slot_ids = routing(pool, slots, 8, real, gen)
        before = [dst.cpu() for dst in cache]
        fill_experts(banks, pairs.cuda(), slot_ids.cuda(), slots)
        torch.cuda.synchronize()
        after = [(dst.cpu(), src) for dst, src in zip(cache, host, strict=True)]
        assert check_filled(after, before, pairs, slot_ids, slots)


@needs_cuda
@needs_triton
def test_cuda_fill_replays_in_a_graph():
    """Captured once (the table built before capture), replayed with new entries."""
    gen = torch.Generator().manual_seed(5)
    specs = list(QUANTIZED_ROWS.values())
    pool, slots = 9, 5
    host = pinned_pool(specs, pool, gen)
    cache = [random_bank(slots, shape, dtype, gen).cuda() for shape, dtype in specs]
    banks = [(dst, HostRows(src)) for dst, src in zip(cache, host, strict=True)]
    pairs_d = torch.zeros(8, dtype=torch.int64, device="cuda")
    slots_d = torch.full((8,), slots, dtype=torch.int64, device="cuda")
    fill_experts(banks, pairs_d, slots_d, slots)  # eager first: compiles, builds the table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill_experts(banks, pairs_d, slots_d, slots)
    for real in (4, 2):
        pairs, slot_ids = routing(pool, slots, 8, real, gen)
        pairs_d.copy_(pairs)
        slots_d.copy_(slot_ids)
        before = [dst.cpu() for dst in cache]
        graph.replay()
        torch.cuda.synchronize()
        after = [(dst.cpu(), src) for dst, src in zip(cache, host, strict=True)]
        assert check_filled(after, before, pairs, slot_ids, slots)
