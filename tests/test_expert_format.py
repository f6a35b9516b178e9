"""Expert formats (weights/expert_format.py): what a bank row holds in each format, that a
checkpoint's quantized tensor laid out as bank parts has the values the checkpoint readers
define, and random experts of each format for benchmarks."""

from __future__ import annotations

import pytest
import torch

from freetoken.weights import quantized as q
from freetoken.weights.expert_format import (
    DENSE,
    LEGACY,
    MXFP4,
    NVFP4,
    Q8_0,
    QuantizedBank,
    bank_parts,
    expert_format,
    fill_random_,
    fp8_format,
)

GEN = torch.Generator().manual_seed(0)


def stored_tensor(name: str, rows: int, cols: int, experts: int | None = None):
    """A random quantized tensor as a checkpoint stores it (one expert, or `experts` stacked)
    and its value by the checkpoint reader (weights/quantized.py)."""
    lead = () if experts is None else (experts,)
    if name == "fp8":
        codes = torch.randint(0, 126, (*lead, rows, cols), dtype=torch.uint8, generator=GEN)
        codes |= torch.randint(0, 2, codes.shape, dtype=torch.uint8, generator=GEN) << 7
        scale = torch.rand(*lead, -(-rows // 16), -(-cols // 24), generator=GEN) + 0.5
        parts = q.QuantizedParts("fp8", codes.view(torch.float8_e4m3fn), scale)
        return parts, q.dequantize_fp8_blocks(parts.data, scale, (16, 24))
    if name == "mxfp4":
        blocks = torch.randint(
            0, 256, (*lead, rows, cols // 32, 16), dtype=torch.uint8, generator=GEN
        )
        scales = torch.randint(
            115, 135, (*lead, rows, cols // 32), dtype=torch.uint8, generator=GEN
        )
        parts = q.QuantizedParts("mxfp4", blocks, scales.view(torch.float8_e8m0fnu))
        return parts, q.dequantize_mxfp4(blocks, scales)
    if name == "q8_0":
        codes = torch.randint(-128, 128, (*lead, rows, cols), dtype=torch.int8, generator=GEN)
        scales = (torch.rand(*lead, rows, cols // 32, generator=GEN) * 1e-3).half()
        return q.QuantizedParts("q8_0", codes, scales), q.dequantize_q8_0(codes, scales)
    if name in q.LEGACY_REST:  # (any codes and fifth bits; d and m of ~1e-3)
        codes = torch.randint(0, 256, (*lead, rows, cols // 2), dtype=torch.uint8, generator=GEN)
        width = q.LEGACY_REST[name]
        rest = torch.randint(
            0, 256, (*lead, rows, cols // 32, width), dtype=torch.uint8, generator=GEN
        )
        halves = (torch.rand(*lead, rows, cols // 32, 2, generator=GEN) - 0.5) * 2e-3
        rest[..., : min(width, 4)] = halves.half().view(torch.uint8)[..., :width]  # (d, m)
        rest = rest.flatten(-2)
        return q.QuantizedParts(name, codes, rest), q.legacy_values(name, codes, rest)
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), dtype=torch.uint8, generator=GEN)
    block = (torch.rand(*lead, rows, cols // 16, generator=GEN) * 4 + 0.1).to(torch.float8_e4m3fn)
    g = torch.tensor(0.37)
    parts = q.QuantizedParts("nvfp4", packed, block, g)
    return parts, q.dequantize_nvfp4(packed, block, g)


FORMATS = {"fp8": fp8_format((16, 24)), "mxfp4": MXFP4, "nvfp4": NVFP4, "q8_0": Q8_0, **LEGACY}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("experts", [None, 3])
def test_bank_parts_hold_the_values_the_checkpoint_defines(name, experts):
    fmt = FORMATS[name]
    stored, want = stored_tensor(name, 32, 64, experts)
    parts = bank_parts(stored)
    assert set(parts) == set(fmt.parts(32, 64, torch.float32))
    for part, (shape, dtype) in fmt.parts(32, 64, torch.float32).items():
        lead = () if experts is None else (experts,)
        assert parts[part].shape == (*lead, *shape) and parts[part].dtype == dtype, part
    got = fmt.dequantize(parts["w"], parts["s"], parts.get("g"))
    assert torch.equal(got, want)  # bit for bit: the same fp32 operations in the same order


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_quantized_bank_dequantizes_slot_by_slot_as_a_whole(name):
    fmt = FORMATS[name]
    stored, want = stored_tensor(name, 32, 64, experts=4)
    bank = QuantizedBank(fmt, *bank_parts(stored).values())
    assert bank.shape == (4, 32, 64)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(bank.dequantize(slice(None), dtype), want.to(dtype))
        assert torch.equal(bank.dequantize(2, dtype), want[2].to(dtype))
        index = torch.tensor([3, 0])
        assert torch.equal(bank.dequantize(index, dtype), want[index].to(dtype))
        assert torch.equal(bank.select(index).dequantize(slice(None), dtype), want[index].to(dtype))


def test_bytes_per_expert_follow_the_format():
    rows, cols = 5760, 2880  # gpt-oss-20b's gate/up projection
    dense = DENSE.nbytes(rows, cols, torch.bfloat16)
    assert dense == rows * cols * 2
    assert MXFP4.nbytes(rows, cols, torch.bfloat16) == rows * cols // 2 + rows * cols // 32
    nvfp4 = rows * cols // 2 + rows * cols // 16 + rows * 4  # codes, block and row scales
    assert NVFP4.nbytes(rows, cols, torch.bfloat16) == nvfp4
    fp8 = fp8_format((128, 128))
    assert fp8.nbytes(1536, 2048, torch.bfloat16) == 1536 * 2048 + 12 * 16 * 4
    assert Q8_0.nbytes(rows, cols, torch.bfloat16) == rows * cols + rows * cols // 32 * 2
    assert dense / MXFP4.nbytes(rows, cols, torch.bfloat16) > 3.7  # 4.25 bits a weight
    # GGUF's legacy types: 16 code bytes and 2, 4, 6, 8 other bytes a block of 32
    for name, bits in (("q4_0", 4.5), ("q4_1", 5.0), ("q5_0", 5.5), ("q5_1", 6.0)):
        assert LEGACY[name].nbytes(rows, cols, torch.bfloat16) * 8 == rows * cols * bits


def test_shapes_the_blocks_cannot_lay_out_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        MXFP4.parts(64, 48, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4.check(64, 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8_0.check(64, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        LEGACY["q5_0"].check(64, 48)
    fp8 = fp8_format((128, 128))
    fp8.check(64, 200)  # (partial blocks are fine for FP8)
    assert fp8.stacks(768) and not fp8.stacks(1408 + 64)
    with pytest.raises(ValueError, match="unknown expert format"):
        expert_format("int4")


@pytest.mark.parametrize("name", ["dense", *sorted(FORMATS)])
def test_random_experts_of_each_format_are_finite_and_weight_sized(name):
    fmt = FORMATS.get(name, DENSE)
    parts = {}
    for part, (shape, dtype) in fmt.parts(64, 96, torch.bfloat16).items():
        parts[part] = fill_random_(fmt, part, torch.empty(6, *shape, dtype=dtype), GEN)
    values = fmt.dequantize(parts["w"], parts.get("s"), parts.get("g"))
    assert values.isfinite().all()
    assert 0.002 < values.abs().mean().item() < 0.2
