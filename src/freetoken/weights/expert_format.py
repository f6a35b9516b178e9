"""How routed experts are stored: as the model's dtype, or kept quantized.

An expert's projection of N output rows and K inputs is one row of a bank (`moe/store.py`), and
the formats differ in what that row is made of:

    format   data [N, K / pack]          scale                        row_scale
    dense    model dtype, pack 1         -                            -
    fp8      e4m3 bytes (uint8), pack 1  fp32 [ceil(N / bn), ceil(K / bk)]   -
    mxfp4    e2m1 pairs (uint8), pack 2  e8m0 bytes [N, K / 32]       -
    nvfp4    e2m1 pairs (uint8), pack 2  e4m3 bytes [N, K / 16]       fp32 [N]
    q8_0     int8 bytes (uint8), pack 1  fp16 [N, K / 32]             -
    q4_k     low 4 bits (uint8), pack 2  bytes [N, K / 256 * 16]      -
    q5_k     low 4 bits (uint8), pack 2  bytes [N, K / 256 * 48]      -
    q6_k     low 4 bits (uint8), pack 2  bytes [N, K / 256 * 82]      -
    k_mixed  low 4 bits (uint8), pack 2  bytes [N, K / 256 * 84]      -
    q4_0     low 4 bits (uint8), pack 2  bytes [N, K / 32 * 2]        -
    q4_1     low 4 bits (uint8), pack 2  bytes [N, K / 32 * 4]        -
    q5_0     low 4 bits (uint8), pack 2  bytes [N, K / 32 * 6]        -
    q5_1     low 4 bits (uint8), pack 2  bytes [N, K / 32 * 8]        -

(e2m1 pairs: two 4-bit codes a byte, the low nibble first, element 2j in the low nibble of byte
j. NVFP4's per-tensor `weight_scale_2` is kept per row, since one bank row holds the gate's and
the up projection's rows, each with its own.) Every part is a plain integer or fp32 tensor, so
the host pool, the cache slots, the fills, re-sizes and the weight directory move them as bytes.

The value of element (n, k) is the format's definition (weights/quantized.py) computed in fp32,
in this order:

    fp8      fp8(data[n, k]) * scale[n // bn, k // bk]
    mxfp4    e2m1(code) * 2^(scale[n, k // 32] - 127)
    nvfp4    (e2m1(code) * fp8(scale[n, k // 16])) * row_scale[n]
    q8_0     int8(code) * fp16(scale[n, k // 32])     (GGUF's Q8_0: exact in fp32)
    q*_k     GGUF's K-quants: the super-block's values (weights/quantized.py's
             `k_quant_values`: its 128 code bytes in data, the rest of its bytes in scale)
    k_mixed  K-quant super-blocks of any of those types, each block's other bytes padded to
             84 with its type's kernel code in byte 82: a projection whose layers differ in
             type, as the down projections of Q4_K_M and Q5_K_M files (Q6_K in some layers).
             A bank row (an expert's projection) is of one type, so kernels read the type
             once a row or a tile
    q4_0 ..  GGUF's legacy blocks of 32 (weights/quantized.py's `legacy_values`: a block's
    q5_1     16 code bytes in data, value j in byte j's low nibble and j + 16 in its high one;
             its other bytes in scale: fp16 d, fp16 m, 4 bytes of fifth bits, as it has them):
             d * (q - 8), d * q + m, d * (q - 16), d * q + m

then rounded to the model's dtype: exactly the weight a checkpoint dequantized at load holds.
Every expert kernel (the Triton decode kernels, the C kernel, the torch reference) computes with
these values, so a quantized expert gives the same result as its dequantized copy on the same
kernel, and a fill or a CPU job moves the quantized bytes only (MXFP4 and NVFP4 4.25-4.5 bits a
weight, FP8 8.0, Q8_0 8.5, Q4_K 4.5, Q5_K 5.5, Q6_K 6.56, mixed K-quants 6.63, Q4_0 4.5,
Q4_1 5.0, Q5_0 5.5, Q5_1 6.0). Two exceptions in the C kernel, for speed: its bf16 jobs on
GGUF's scaled formats dot x with the integer codes and scale each block's sums once, computing
with the file's values rather than their bf16 roundings ("scaled codes" in cpu_dots.c; built
where the CPU has AVX512-BF16, `ft_cpu_bf16_scaled_codes`), and
NVFP4 rows of bf16 models read by one route sum in another order (within fp32 rounding).

A store's two projections may differ in format (a Q4_K_M file: gate and up Q4_K or Q5_0, down
mixed K-quants): `formats` maps each projection to its own. Not where one is mxfp4 or nvfp4,
whose CPU routes read x split for the gate/up projection's format (`SPLIT_FORMATS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken.config import EXPERT_FORMATS
from freetoken.weights.quantized import (
    FP8_BLOCK,
    K_QUANT_REST,
    LEGACY_BLOCK,
    LEGACY_REST,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Q8_0_BLOCK,
    QK_K,
    QuantizedParts,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    dequantize_nvfp4,
    dequantize_q8_0,
    k_quant_values,
    legacy_values,
)

# the kernels' codes (the C source's FMT_* macros, passed as -D defines by kernels/native.py)
KERNEL_CODES = {
    "FMT_DENSE": 0,
    "FMT_FP8": 1,
    "FMT_MXFP4": 2,
    "FMT_NVFP4": 3,
    "FMT_Q8_0": 4,
    "FMT_Q4_K": 5,
    "FMT_Q5_K": 6,
    "FMT_Q6_K": 7,
    "FMT_K_MIXED": 8,
    "FMT_Q4_0": 9,
    "FMT_Q4_1": 10,
    "FMT_Q5_0": 11,
    "FMT_Q5_1": 12,
}
# k_mixed: each block's other bytes padded to this width, its type's kernel code at MIXED_K_TAG
MIXED_K_WIDTH, MIXED_K_TAG = 84, 82


@dataclass(frozen=True)
class ExpertFormat:
    """A way of storing an expert projection's weights (see the module's docstring)."""

    name: str  # "dense", "fp8", "mxfp4", "nvfp4", "q8_0", "q4_k", ..., "k_mixed", "q4_0", ...
    pack: int = 1  # values per stored element along K
    col_block: int = 0  # K values per scale (0: no scales)
    row_block: int = 1  # N rows per scale
    scale_dtype: torch.dtype | None = None
    row_scale: bool = False
    scale_width: int = 1  # scale elements a block (the K-quants: their blocks' other bytes)

    @property
    def quantized(self) -> bool:
        return self.name != "dense"

    @property
    def code(self) -> int:
        return KERNEL_CODES[f"FMT_{self.name.upper()}"]

    def parts(self, rows: int, cols: int, dtype: torch.dtype) -> dict[str, tuple]:
        """A projection's parts, {"w": shape, dtype, "s": ..., "g": ...} (those it has): the
        shapes of one expert's, [rows, cols] in logical values, as the banks' rows hold them."""
        if not self.quantized:
            return {"w": ((rows, cols), dtype)}
        self.check(rows, cols)
        parts = {"w": ((rows, cols // self.pack), torch.uint8)}
        scale_rows = -(-rows // self.row_block)
        parts["s"] = ((scale_rows, -(-cols // self.col_block) * self.scale_width), self.scale_dtype)
        if self.row_scale:
            parts["g"] = ((rows,), torch.float32)
        return parts

    def check(self, rows: int, cols: int) -> None:
        """Refuse a projection shape the format's blocks cannot lay out (fp8's last blocks
        may be partial; the others' blocks are whole)."""
        if self.quantized and self.name != "fp8" and cols % self.col_block:
            raise ValueError(
                f"{self.name} needs the input width ({cols}) to be a multiple of {self.col_block}"
            )

    def stacks(self, rows: int) -> bool:
        """Whether projections of `rows` rows can be stacked in one bank row (the gate's and
        the up projection's): their scale blocks must not straddle the seam."""
        return rows % self.row_block == 0

    def nbytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        """Bytes of one projection in this format."""
        total = 0
        for shape, part_dtype in self.parts(rows, cols, dtype).values():
            n = 1
            for d in shape:
                n *= d
            total += n * part_dtype.itemsize
        return total

    def dequantize(self, w: Tensor, s: Tensor | None = None, g: Tensor | None = None) -> Tensor:
        """fp32 values of parts [..., rows, cols / pack] (and their scales): the definition."""
        if self.name == "dense":
            return w.float()
        if self.name == "fp8":
            return dequantize_fp8_blocks(
                w.view(torch.float8_e4m3fn), s, (self.row_block, self.col_block)
            )
        if self.name == "q8_0":
            return dequantize_q8_0(w, s)
        if self.name in K_QUANT_REST:
            return k_quant_values(self.name, w, s)
        if self.name in LEGACY_REST:
            return legacy_values(self.name, w, s)
        if self.name == "k_mixed":
            return k_mixed_values(w, s)
        if self.name == "mxfp4":
            lead = w.shape[:-1]
            blocks = w.reshape(*lead, -1, MXFP4_BLOCK // 2)
            return dequantize_mxfp4(blocks, s)
        # nvfp4: the per-row scale applied after the block scale, as the definition orders them
        per_tensor = torch.ones((), dtype=torch.float32)
        values = dequantize_nvfp4(w, s.view(torch.float8_e4m3fn), per_tensor)
        return values * g.unsqueeze(-1)


DENSE = ExpertFormat("dense")
MXFP4 = ExpertFormat("mxfp4", pack=2, col_block=MXFP4_BLOCK, scale_dtype=torch.uint8)
NVFP4 = ExpertFormat(
    "nvfp4", pack=2, col_block=NVFP4_BLOCK, scale_dtype=torch.uint8, row_scale=True
)
Q8_0 = ExpertFormat("q8_0", col_block=Q8_0_BLOCK, scale_dtype=torch.float16)
K_QUANTS = {
    name: ExpertFormat(name, pack=2, col_block=QK_K, scale_dtype=torch.uint8, scale_width=width)
    for name, width in K_QUANT_REST.items()
}
K_MIXED = ExpertFormat(
    "k_mixed", pack=2, col_block=QK_K, scale_dtype=torch.uint8, scale_width=MIXED_K_WIDTH
)
K_FAMILY = frozenset((*K_QUANTS, K_MIXED.name))  # formats a row of which the K decoders read
LEGACY = {
    name: ExpertFormat(
        name, pack=2, col_block=LEGACY_BLOCK, scale_dtype=torch.uint8, scale_width=width
    )
    for name, width in LEGACY_REST.items()
}
# Formats whose CPU routes read x split for them (kernels/cpu_dots.c's split_x): a store's
# two projections are of one format where either is one of these
SPLIT_FORMATS = frozenset(("mxfp4", "nvfp4"))


def k_mixed_rest(kind: str, rest: Tensor) -> Tensor:
    """A `kind` K-quant's other bytes [..., K / 256 * width] as a k_mixed bank holds them:
    each block's padded to MIXED_K_WIDTH, its type's kernel code at MIXED_K_TAG."""
    width = K_QUANT_REST[kind]
    blocks = rest.reshape(*rest.shape[:-1], -1, width)
    out = blocks.new_zeros(*blocks.shape[:-1], MIXED_K_WIDTH)
    out[..., :width] = blocks
    out[..., MIXED_K_TAG] = K_QUANTS[kind].code
    return out.flatten(-2)


def k_mixed_values(codes: Tensor, rest: Tensor) -> Tensor:
    """fp32 values [..., K] of k_mixed parts (codes [..., K / 2], rest [..., K / 256 * 84]):
    each block by its own type's definition (`k_quant_values`)."""
    blocks = rest.reshape(*rest.shape[:-1], -1, MIXED_K_WIDTH)
    lead, count = blocks.shape[:-2], blocks.shape[-2]
    if tuple(codes.shape) != (*lead, count * QK_K // 2):
        raise ValueError(
            f"k_mixed codes of shape {tuple(codes.shape)} do not match their "
            f"{count} blocks' other bytes {tuple(rest.shape)}"
        )
    blocks = blocks.reshape(-1, MIXED_K_WIDTH)
    tags = blocks[:, MIXED_K_TAG]
    code_blocks = codes.reshape(-1, QK_K // 2)
    out = torch.empty(blocks.shape[0], QK_K, device=codes.device)
    seen = torch.zeros_like(tags, dtype=torch.bool)
    for kind, fmt in K_QUANTS.items():
        sel = tags == fmt.code
        if sel.any():
            width = K_QUANT_REST[kind]
            out[sel] = k_quant_values(kind, code_blocks[sel], blocks[sel, :width])
            seen |= sel
    if not bool(seen.all()):
        bad = int(tags[~seen][0])
        raise ValueError(f"a k_mixed block has type code {bad}, none of the K-quants'")
    return out.reshape(*lead, count * QK_K)


def fp8_format(block: tuple[int, int] = FP8_BLOCK) -> ExpertFormat:
    """FP8 e4m3 with [rows, cols] block scales (fp32, the checkpoints' `weight_scale_inv`)."""
    return ExpertFormat(
        "fp8", col_block=int(block[1]), row_block=int(block[0]), scale_dtype=torch.float32
    )


def expert_format(name: str, fp8_block: tuple[int, int] = FP8_BLOCK) -> ExpertFormat:
    if name == "fp8":
        return fp8_format(fp8_block)
    try:
        return {
            "dense": DENSE,
            "mxfp4": MXFP4,
            "nvfp4": NVFP4,
            "q8_0": Q8_0,
            **K_QUANTS,
            "k_mixed": K_MIXED,
            **LEGACY,
        }[name]
    except KeyError:
        raise ValueError(
            f"unknown expert format {name!r}; one of {', '.join(EXPERT_FORMATS)}"
        ) from None


def bank_parts(stored: QuantizedParts, bank: ExpertFormat | None = None) -> dict[str, Tensor]:
    """A checkpoint's quantized tensor (one expert's projection [N, K], or a layer's [E, N, K])
    as its banks' parts hold it: {"w": codes, "s": scales, "g": per-row scales}; `bank`: the
    banks' format where it is not the tensor's (k_mixed banks of a K-quant tensor)."""
    if bank is not None and bank.name == "k_mixed" and stored.format in K_QUANTS:
        return {"w": stored.data, "s": k_mixed_rest(stored.format, stored.scale)}
    if stored.format == "fp8":
        return {"w": stored.data.view(torch.uint8), "s": stored.scale.float()}
    if stored.format == "q8_0":
        return {"w": stored.data.view(torch.uint8), "s": stored.scale.to(torch.float16)}
    if stored.format in K_QUANTS or stored.format in LEGACY:
        return {"w": stored.data, "s": stored.scale}
    scale = stored.scale
    if scale.dtype != torch.uint8:  # (e8m0 or e4m3 scales stored as such: their bits)
        scale = scale.view(torch.uint8)
    if stored.format == "mxfp4":  # blocks [..., N, G, 16] -> codes [..., N, G * 16]
        return {"w": stored.data.flatten(-2), "s": scale}
    rows = stored.data.shape[:-1]
    row_scale = stored.tensor_scale.float().reshape(()).expand(rows).contiguous()
    return {"w": stored.data, "s": scale, "g": row_scale}


class _Parts:
    """What a quantized bank and a quantized weight share: a format and its parts w, s, g."""

    format: ExpertFormat
    w: Tensor
    s: Tensor
    g: Tensor | None

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape: w's, its last dimension in values."""
        return (*self.w.shape[:-1], self.w.shape[-1] * self.format.pack)

    @property
    def device(self) -> torch.device:
        return self.w.device

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return (self.w, self.s) if self.g is None else (self.w, self.s, self.g)


@dataclass(frozen=True)
class QuantizedBank(_Parts):
    """One projection of many experts, kept quantized: parts indexed by slot (or flat id) in
    their first dimension. Passed to the expert kernels where a dense bank [S, N, K] would go;
    `shape` is the dense bank's."""

    format: ExpertFormat
    w: Tensor  # [S, N, K / pack]
    s: Tensor  # [S, ...] the scales
    g: Tensor | None = None  # [S, N] per-row scales (nvfp4)

    def mismatch(self, dtype: torch.dtype) -> str | None:
        """What keeps the parts from being this format's for a model of `dtype` (a shape or
        dtype the format does not lay out so, a part too many or missing), or None."""
        count, rows, cols = self.shape
        try:
            want = self.format.parts(rows, cols, dtype)
        except ValueError as e:
            return str(e)
        for name, part in {"w": self.w, "s": self.s, "g": self.g}.items():
            if name not in want:
                if part is not None:
                    return f"a {self.format.name} bank has no {name} part"
                continue
            shape, part_dtype = (count, *want[name][0]), want[name][1]
            if part is None or tuple(part.shape) != shape or part.dtype != part_dtype:
                got = "none" if part is None else f"{tuple(part.shape)} of {part.dtype}"
                return (
                    f"the {name} part of a {self.format.name} bank of shape {self.shape} "
                    f"must be {shape} of {part_dtype}, not {got}"
                )
        return None

    def dequantize(self, index, dtype: torch.dtype) -> Tensor:
        """The dense weights of experts `index` (an int, a slice or an index tensor) in `dtype`:
        what a checkpoint dequantized at load would hold for them."""
        g = None if self.g is None else self.g[index]
        return self.format.dequantize(self.w[index], self.s[index], g).to(dtype)

    def select(self, index) -> QuantizedBank:
        """The bank of experts `index` only (a slice or an index tensor)."""
        return QuantizedBank(self.format, *(t[index] for t in self.tensors))


@dataclass(frozen=True)
class QuantizedWeight(_Parts):
    """A dense layer's weight [N, K] kept as its checkpoint stores it (a GGUF file's attention,
    dense MLP and output head: models/gguf.py), in one of these formats: the parts of one bank
    row (w [N, K / pack], s, g), which the CPU kernel reads as it reads an expert's projection
    (layers/linear.py). Its values are the format's definition, as an expert's are."""

    format: ExpertFormat
    w: Tensor  # [N, K / pack]
    s: Tensor
    g: Tensor | None = None

    def __post_init__(self) -> None:
        # (contiguous once here, so the decode step's native call needs no check of its own)
        for name in ("w", "s", "g"):
            part = getattr(self, name)
            if part is not None and not part.is_contiguous():
                object.__setattr__(self, name, part.contiguous())

    @classmethod
    def of(cls, stored: QuantizedParts, fp8_block: tuple[int, int] = FP8_BLOCK) -> QuantizedWeight:
        """A checkpoint's quantized 2-D tensor as kept (ValueError where its format is not one
        of these or its parts do not lay out as the format's)."""
        fmt = expert_format(stored.format, fp8_block)
        weight = cls(fmt, *bank_parts(stored).values())
        as_bank = QuantizedBank(fmt, *(t.unsqueeze(0) for t in weight.tensors))  # (one row)
        why = as_bank.mismatch(torch.float32)
        if why is not None:
            raise ValueError(why)
        return weight

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.format, *(t.to(device) for t in self.tensors))

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """The dense weight [N, K] in `dtype`: what a checkpoint dequantized at load holds."""
        return self.format.dequantize(self.w, self.s, self.g).to(dtype)

    @classmethod
    def stacked(cls, weights: list[QuantizedWeight]) -> QuantizedWeight | None:
        """The rows of `weights` one after another as one weight (q, k and v; gate and up: one
        kernel call where there were several), or None where they cannot be: formats that
        differ, or row-blocked scales (fp8's) that a weight's rows would split."""
        fmt, first = weights[0].format, weights[0]
        if any(
            w.format != fmt
            or w.device != first.device
            or w.shape[1:] != first.shape[1:]
            or w.shape[0] % fmt.row_block
            for w in weights
        ):
            return None
        parts = [
            None if getattr(first, name) is None else torch.cat([getattr(w, name) for w in weights])
            for name in ("w", "s", "g")
        ]
        return cls(fmt, *parts)

    def split_rows(self, rows: list[int]) -> list[QuantizedWeight]:
        """Views of consecutive row ranges of `rows` rows each (a `stacked` weight's parts)."""
        block = self.format.row_block
        pieces = [
            [None] * len(rows)
            if t is None
            else t.split([n // block if name == "s" else n for n in rows])
            for name, t in (("w", self.w), ("s", self.s), ("g", self.g))
        ]
        return [QuantizedWeight(self.format, *p) for p in zip(*pieces, strict=True)]


@dataclass(frozen=True)
class ExpertWeights:
    """What the expert kernels take: each projection a dense bank or a `QuantizedBank`, and the
    gate/up biases (None without)."""

    gate_up: Tensor | QuantizedBank
    down: Tensor | QuantizedBank
    bias: Tensor | None = None


def expert_weights(
    banks: dict[str, Tensor], fmt: ExpertFormat, down: ExpertFormat | None = None
) -> ExpertWeights:
    """The projections of named banks (a store's, a cache's, a streamed layer's): in `fmt`, the
    down projection in `down` where given."""

    def projection(proj: str) -> Tensor | QuantizedBank:
        f = down if proj == "down" and down is not None else fmt
        if not f.quantized:
            return banks[f"w_{proj}"]
        return QuantizedBank(f, banks[f"w_{proj}"], banks[f"s_{proj}"], banks.get(f"g_{proj}"))

    return ExpertWeights(projection("gate_up"), projection("down"), banks.get("b_gate_up"))


def fill_random_(fmt: ExpertFormat, part: str, bank: Tensor, generator=None) -> Tensor:
    """Fill a bank's part ("w", "s", "g" or a bias "b") with random values of the format at a
    weight's usual scale (~0.02, no NaN or infinity): for benchmarks and tests, whose speed
    depends on the bytes, not on the values."""
    if part == "b" or (part == "w" and not fmt.quantized):
        return bank.normal_(0, 0.02, generator=generator)
    if part == "g":  # one value per expert and half of its rows (gate's, up's), as NVFP4
        # checkpoints hold one per tensor
        halves = torch.empty(bank.shape[0], 2, 1).uniform_(2.0**-8, 2.0**-6, generator=generator)
        rows = bank.view(bank.shape[0], 2, -1) if bank.shape[1] % 2 == 0 else None
        if rows is None:
            return bank.copy_(halves[:, :1, 0].expand_as(bank))
        rows.copy_(halves.expand_as(rows))
        return bank
    if fmt.name in K_FAMILY:  # any codes and sub-block scales, the fp16 scales of ~0.0005
        bank.random_(0, 256, generator=generator)
        if part == "s":
            blocks = bank.view(*bank.shape[:-1], -1, fmt.scale_width)
            scale = torch.tensor([2.0**-11], dtype=torch.float16).view(torch.uint8)
            kinds = [fmt.name] * bank.shape[0]
            if fmt.name == "k_mixed":  # a type per expert (a bank row is of one type)
                names = list(K_QUANTS)
                picks = torch.randint(len(names), (bank.shape[0],), generator=generator)
                kinds = [names[int(i)] for i in picks]
                blocks[..., MIXED_K_WIDTH - 2 :] = 0
            for expert, kind in enumerate(kinds):
                for at in (80,) if kind == "q6_k" else (0, 2):  # d (and dmin)
                    blocks[expert, ..., at : at + 2] = scale
                if fmt.name == "k_mixed":
                    blocks[expert, ..., MIXED_K_TAG] = K_QUANTS[kind].code
        return bank
    if fmt.name in LEGACY:  # any codes and fifth bits; fp16 d of 2^-11 .. 2^-9, m of -16 d .. 0
        bank.random_(0, 256, generator=generator)
        if part == "s":
            blocks = bank.view(*bank.shape[:-1], -1, fmt.scale_width)
            d = torch.empty(blocks.shape[:-1]).uniform_(2.0**-11, 2.0**-9, generator=generator)
            blocks[..., 0:2] = d.half().unsqueeze(-1).view(torch.uint8)
            if fmt.name in ("q4_1", "q5_1"):
                m = -d * torch.empty_like(d).uniform_(0, 16, generator=generator)
                blocks[..., 2:4] = m.half().unsqueeze(-1).view(torch.uint8)
        return bank
    if part == "w":
        if fmt.name == "fp8":  # any e4m3 but the NaNs (0x7f, 0xff)
            bank.random_(0, 255, generator=generator)
            return bank.masked_fill_(bank == 0x7F, 0x7E)
        return bank.random_(0, 256, generator=generator)  # every e2m1 pair, every int8
    if fmt.name == "fp8":  # fp32 block scales: e4m3 values (up to 448) to ~0.1
        return bank.uniform_(2.0**-13, 2.0**-12, generator=generator)
    if fmt.name == "mxfp4":  # e8m0 2^-8 .. 2^-5
        return bank.random_(119, 123, generator=generator)
    if fmt.name == "q8_0":  # fp16 scales: codes up to 127 to ~0.03
        return bank.uniform_(2.0**-13, 2.0**-12, generator=generator)
    return bank.random_(0x38, 0x40, generator=generator)  # nvfp4: e4m3 1.0 .. 1.875
