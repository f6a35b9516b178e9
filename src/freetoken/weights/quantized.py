"""Quantized checkpoints read as the formats define them, dequantized at load.

Three weight formats of the releases people run, each recognised by its companion tensors
(and checked against `quantization_config` in config.json):

    FP8, 128 x 128 blocks   `X.weight` float8_e4m3 [N, K] and `X.weight_scale_inv` fp32
                            [ceil(N / 128), ceil(K / 128)]: W = w * scale_inv of its block
                            (Qwen's and DeepSeek's FP8 releases: quant_method "fp8",
                            `weight_block_size`)
    MXFP4                   `X_blocks` uint8 [..., G, 16] (32 e2m1 values a block, two a byte,
                            the low nibble first) and `X_scales` uint8 [..., G] (e8m0: 2^(s -
                            127)): X [..., G * 32] (gpt-oss: quant_method "mxfp4")
    NVFP4                   `X.weight` uint8 [N, K / 2] (e2m1, two a byte, low nibble first),
                            `X.weight_scale` float8_e4m3 [N, K / 16] and `X.weight_scale_2` fp32
                            (one per tensor): W = fp4 * weight_scale * weight_scale_2 (ModelOpt
                            checkpoints: quant_method "modelopt", quant_algo "NVFP4";
                            `X.input_scale`, for activations, is not used)
    DeepSeek's own names    `X.weight` with `X.scale` (DeepSeek-V4's releases; transformers
                            renames it `weight_scale_inv`): FP8 in 128 x 128 blocks as above
                            (the scales e8m0 where `scale_fmt` is "ue8m0"), or, where the scale
                            has one entry per 32 values of a row, `X.weight` int8 [N, K / 2] of
                            e2m1 pairs (the low nibble first) and e8m0 scales [N, K / 32]:
                            MXFP4's values (V4's experts, `expert_dtype` "fp4"), read as MXFP4
    Q8_0                    `X_q8_0` int8 [..., K] and `X_q8_0_scales` fp16 [..., K / 32]: W =
                            code * scale of its 32-value block (GGUF's Q8_0, kept so by the
                            GGUF conversion, models/gguf.py: quant_method "gguf")
    Q4_K, Q5_K, Q6_K        `X_q4_k` uint8 [..., K / 2] and `X_q4_k_scales` uint8 [..., K / 256
                            * S]: GGUF's K-quant super-blocks of 256 values split in two, the
                            low 4 bits of each value (as the block stores them) and the rest of
                            the block (its fp16 scales, packed sub-block scales, and Q5_K's and
                            Q6_K's high bits: S = 16, 48, 82 bytes), as the GGUF conversion
                            keeps them (`k_quant_values` below is the definition)
    Q4_0, Q4_1, Q5_0, Q5_1  `X_q4_0` uint8 [..., K / 2] and `X_q4_0_scales` uint8 [..., K / 32 *
                            S]: GGUF's legacy blocks of 32 values split likewise, their 16 bytes
                            of low 4 bits and their other bytes (fp16 d, Q4_1's and Q5_1's fp16
                            m, Q5_0's and Q5_1's 4 bytes of fifth bits: S = 2, 4, 6, 8), as the
                            GGUF conversion keeps them (`legacy_values` is the definition)

Routed experts stored so are kept quantized (`keep`): their parts go into the host pool's banks
as they are (weights/expert_format.py lays them out; the kernels dequantize as they compute).
Every other such tensor (attention, shared experts, dense MLPs: a few percent of a MoE's bytes)
is dequantized to the model's dtype as it is read. These readers are the formats' definitions
the kernels are checked against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from freetoken.errors import CheckpointError

# e2m1 (1 sign, 2 exponent, 1 mantissa bit): the 16 codes' values
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
FP8_BLOCK = (128, 128)
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
Q8_0_BLOCK = 32
SUPPORTED = (
    "fp8 (128x128 block scales), mxfp4, modelopt NVFP4, GGUF Q8_0, Q4_K, Q5_K, Q6_K, "
    "Q4_0, Q4_1, Q5_0, Q5_1"
)
QK_K = 256  # values a K-quant super-block
# A K-quant super-block's bytes other than its 128 of low 4-bit codes (`k_quant_values`)
K_QUANT_REST = {"q4_k": 16, "q5_k": 48, "q6_k": 82}
LEGACY_BLOCK = 32  # values a block of GGUF's legacy 4- and 5-bit types
# Their blocks' bytes other than their 16 of low 4-bit codes (`legacy_values`)
LEGACY_REST = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}
GGUF_KEPT = ("q8_0", *K_QUANT_REST, *LEGACY_REST)  # GGUF types a conversion keeps as stored


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] of two e2m1 codes each (the low nibble first) -> fp32 [..., 2n]."""
    if packed.dtype != torch.uint8:
        raise CheckpointError(f"packed FP4 values must be uint8, not {packed.dtype}")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).to(torch.int32)
    return table[codes].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _by_rows(fn, *parts: torch.Tensor) -> torch.Tensor:
    """fn over slices of the parts' first dimension (an expert of a stacked bank, say), so
    the temporaries of unpacking stay a slice's size; one call where there is no such dim."""
    if parts[0].dim() < 3:
        return fn(*parts)
    return torch.stack([fn(*(p[i] for p in parts)) for i in range(parts[0].shape[0])])


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """float8 [..., N, K] and its per-block scales [..., ceil(N / bn), ceil(K / bk)] -> fp32
    [..., N, K] (the last blocks of a row or column may be partial)."""
    *lead, n, k = weight.shape
    bn, bk = block
    want = (*lead, -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"an FP8 weight of shape {tuple(weight.shape)} in {bn}x{bk} blocks needs scales of "
            f"shape {want}, not {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(bn, -2)[..., :n, :]
    return weight.float() * scale.repeat_interleave(bk, -1)[..., :k]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and e8m0 scales [..., G] -> fp32 [..., G * 32]."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            f"blocks must be [..., G, {MXFP4_BLOCK // 2}] and scales [..., G]"
        )
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):  # (stored as F8_E8M0)
        scales = scales.view(torch.uint8)  # its bits are the exponent byte
    if scales.dim() >= 3:
        return _by_rows(dequantize_mxfp4, blocks, scales)
    values = unpack_fp4(blocks)  # [..., G, 32]
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent.unsqueeze(-1).float())
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK)


def dequantize_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """uint8 [..., N, K / 2], float8 block scales [..., N, K / 16] and an fp32 per-tensor scale
    -> fp32 [..., N, K]."""
    if packed.dim() >= 3:
        return _by_rows(lambda w, s: dequantize_nvfp4(w, s, global_scale), packed, scale)
    values = unpack_fp4(packed)
    *lead, n, k = values.shape
    if tuple(scale.shape) != (*lead, n, k // NVFP4_BLOCK) or k % NVFP4_BLOCK:
        raise CheckpointError(
            f"an NVFP4 weight of shape {tuple(values.shape)} needs block scales of shape "
            f"{(*lead, n, k // NVFP4_BLOCK)}, not {tuple(scale.shape)}"
        )
    blocks = values.view(*lead, n, k // NVFP4_BLOCK, NVFP4_BLOCK) * scale.float().unsqueeze(-1)
    return blocks.reshape(values.shape) * global_scale.float()


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., K] (or their bytes, uint8) and fp16 scales [..., K / 32] -> fp32 [...,
    K]: code * scale, exact in fp32 (8 by 11 significant bits)."""
    k = codes.shape[-1]
    if k % Q8_0_BLOCK or tuple(scales.shape) != (*codes.shape[:-1], k // Q8_0_BLOCK):
        raise CheckpointError(
            f"Q8_0 codes of shape {tuple(codes.shape)} need scales of shape "
            f"{(*codes.shape[:-1], k // Q8_0_BLOCK)}, not {tuple(scales.shape)}"
        )
    values = codes.view(torch.int8).float().unflatten(-1, (k // Q8_0_BLOCK, Q8_0_BLOCK))
    return (values * scales.float().unsqueeze(-1)).flatten(-2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins [..., 12] -> [..., 8] each (ggml's
    get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 in bytes
    8-11's nibbles, their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    q = packed.to(torch.int32)
    low, mid, high = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    scales = torch.cat([low & 63, (high & 0xF) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales, mins


def _split_blocks(
    fmt: str, codes: torch.Tensor, rest: torch.Tensor, size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks of `size` values kept as their low-4-bit code bytes [..., K / 2] and their
    `width` other bytes each [..., K / size * width] -> [..., blocks, size / 2] and [...,
    blocks, width], or a clear error where the two do not match."""
    lead, k = codes.shape[:-1], codes.shape[-1] * 2
    blocks = k // size
    if k % size or tuple(rest.shape) != (*lead, blocks * width):
        raise CheckpointError(
            f"{fmt.upper()} codes of shape {tuple(codes.shape)} need the rest of their blocks "
            f"of shape {(*lead, blocks * width)}, not {tuple(rest.shape)}"
        )
    return codes.reshape(*lead, blocks, size // 2), rest.reshape(*lead, blocks, width)


def k_quant_values(fmt: str, codes: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """GGUF K-quant super-blocks as kept (`codes` uint8 [..., K / 2]: each block's 128 bytes of
    low 4 bits, `rest` uint8 [..., K / 256 * S]: its other bytes in the block's order) -> fp32
    [..., K], as ggml defines them, in fp32 in this order:

        q4_k   (d * scale) * q - (dmin * min)        (q 4 bits; a scale, min a 32 values)
        q5_k   (d * scale) * q - (dmin * min)        (q 5 bits: the high bit from qh)
        q6_k   (d * scale) * (q - 32)                (q 6 bits; an int8 scale a 16 values)

    (q4_k, q5_k: the product is exact in fp32, so the one rounding is the subtraction's.)
    Codes: a block's bytes 32 g + l hold values 64 g + l (low nibble) and 64 g + 32 + l (high
    nibble) in q4_k and q5_k; in q6_k, bytes 64 h + l and 64 h + 32 + l hold values 128 h + l,
    + 32 (low nibbles) and + 64, + 96 (high)."""
    width = K_QUANT_REST[fmt]
    c, r = _split_blocks(fmt, codes, rest, QK_K, width)
    c = c.to(torch.int32)
    lead, k = codes.shape[:-1], codes.shape[-1] * 2

    def f16(at: int) -> torch.Tensor:
        return r[..., at : at + 2].contiguous().view(torch.float16).float()  # [..., blocks, 1]

    if fmt == "q6_k":
        high = r[..., 0:64].to(torch.int32)
        scales = r[..., 64:80].view(torch.int8).float()
        q = []
        for h in range(2):  # values 128 h + 32 j + l
            low = c[..., 64 * h : 64 * h + 64]
            bits = high[..., 32 * h : 32 * h + 32]
            nibbles = (
                low[..., :32] & 0xF,
                low[..., 32:] & 0xF,
                low[..., :32] >> 4,
                low[..., 32:] >> 4,
            )
            for j, nibble in enumerate(nibbles):
                q.append(nibble | (((bits >> (2 * j)) & 3) << 4))
        q = torch.cat(q, dim=-1).float() - 32  # [..., blocks, 256]
        scale = (f16(80) * scales).repeat_interleave(16, dim=-1)
        return (scale * q).reshape(*lead, k)
    sc, mn = _k_scales_mins(r[..., 4:16])
    high = r[..., 16:48].to(torch.int32) if fmt == "q5_k" else None
    q = []
    for g in range(4):  # values 64 g + 32 half + l
        byte = c[..., 32 * g : 32 * g + 32]
        for half, nibble in enumerate((byte & 0xF, byte >> 4)):
            if high is not None:
                nibble = nibble | (((high >> (2 * g + half)) & 1) << 4)
            q.append(nibble)
    q = torch.cat(q, dim=-1).float()
    scale = (f16(0) * sc.float()).repeat_interleave(32, dim=-1)
    offset = (f16(2) * mn.float()).repeat_interleave(32, dim=-1)
    return (scale * q - offset).reshape(*lead, k)


def legacy_values(fmt: str, codes: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """GGUF's legacy blocks of 32 values as kept (`codes` uint8 [..., K / 2]: each block's 16
    bytes of low 4 bits, value j in byte j's low nibble and value j + 16 in its high one;
    `rest` uint8 [..., K / 32 * S]: its other bytes in the block's order, an fp16 d, then an
    fp16 m (q4_1, q5_1), then 4 bytes qh whose bit j (little-endian) is value j's fifth bit
    (q5_0, q5_1)) -> fp32 [..., K], as ggml defines them, in fp32:

        q4_0   d * (q - 8)        q4_1   d * q + m        (q 4 bits)
        q5_0   d * (q - 16)       q5_1   d * q + m        (q 5 bits)

    (the products are exact in fp32, so q4_1's and q5_1's one rounding is the addition's)."""
    width = LEGACY_REST[fmt]
    c, r = _split_blocks(fmt, codes, rest, LEGACY_BLOCK, width)
    lead, k = codes.shape[:-1], codes.shape[-1] * 2
    q = torch.cat([c & 0xF, c >> 4], dim=-1)  # uint8 [..., blocks, 32] in order
    d = r[..., 0:2].contiguous().view(torch.float16).float()  # [..., blocks, 1]
    if fmt in ("q5_0", "q5_1"):  # qh's bytes' bits, the lowest first: values 0-31's fifth
        shifts = torch.arange(8, dtype=torch.uint8, device=codes.device)
        q = q | (((r[..., width - 4 :].unsqueeze(-1) >> shifts) & 1).flatten(-2) << 4)
    if fmt in ("q4_1", "q5_1"):
        m = r[..., 2:4].contiguous().view(torch.float16).float()
        return (d * q.float() + m).reshape(*lead, k)
    return (d * (q.float() - (8 if fmt == "q4_0" else 16))).reshape(*lead, k)


@dataclass(frozen=True)
class QuantizedParts:
    """A quantized tensor as stored, for a bank that keeps it so: the data and its scales in
    the checkpoint's shapes and dtypes (`Dequantizer.parts_of` names them)."""

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None = None  # NVFP4's per-tensor scale


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor the checkpoint stores quantized: its name once dequantized, the format, the
    checkpoint tensors it is made of (data first), and the shape it dequantizes to."""

    name: str
    format: str  # "fp8", "mxfp4", "nvfp4", "q8_0", "q4_k", "q5_k", "q6_k", "q4_0", ...
    parts: tuple[str, ...]
    shape: tuple[int, ...]
    # MXFP4's values stored as rows of pairs with per-row scales (DeepSeek-V4's experts): read
    # as MXFP4's blocks and scales by views
    packed_rows: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Dequantizer:
    """What a checkpoint stores quantized (from its tensors' names and shapes, checked against
    its `quantization_config`), and those tensors dequantized as they are read."""

    def __init__(self, config: dict, shapes: dict[str, tuple[int, ...]]):
        self.method = _method(config)
        block = tuple(
            (config.get("quantization_config") or {}).get("weight_block_size") or FP8_BLOCK
        )
        self.fp8_block = (int(block[0]), int(block[1]))
        self.tensors: dict[str, QuantizedTensor] = {}
        for name in shapes:
            q = self._recognise(name, shapes)
            if q is not None:
                self.tensors[q.name] = q
        self.parts = {part: q for q in self.tensors.values() for part in q.parts}
        # companions that only activations use: read by nobody here
        self.unused = set()
        if self.method == "modelopt":
            self.unused = {n for n in shapes if n.endswith(".input_scale")}
        if self.method and not self.tensors:
            raise CheckpointError(
                f"config.json says the weights are quantized ({self.method}), but no tensor "
                f"has the companion scales that format stores (supported: {SUPPORTED})"
            )

    def _recognise(self, name: str, shapes) -> QuantizedTensor | None:
        if name.endswith(".weight_scale_inv"):
            base = name.removesuffix("_scale_inv")
            if base in shapes:
                return QuantizedTensor(base, "fp8", (base, name), tuple(shapes[base]))
        if name.endswith(".scale"):  # DeepSeek's own name for either
            base = name.removesuffix(".scale") + ".weight"
            if base in shapes:
                data, scale = tuple(shapes[base]), tuple(shapes[name])
                if scale[:-1] == data[:-1] and scale[-1] * (MXFP4_BLOCK // 2) == data[-1]:
                    shape = (*data[:-1], 2 * data[-1])
                    return QuantizedTensor(base, "mxfp4", (base, name), shape, packed_rows=True)
                return QuantizedTensor(base, "fp8", (base, name), data)
        if name.endswith("_scales"):
            base = name.removesuffix("_scales")
            blocks = base + "_blocks"
            if blocks in shapes:
                out = (*shapes[blocks][:-2], shapes[blocks][-2] * MXFP4_BLOCK)
                return QuantizedTensor(base, "mxfp4", (blocks, name), tuple(out))
        if name.endswith(".weight_scale_2"):
            base = name.removesuffix("_scale_2")
            scale = base + "_scale"
            if base in shapes and scale in shapes:
                *lead, half = shapes[base]
                out = (*lead, 2 * half)
                return QuantizedTensor(base, "nvfp4", (base, scale, name), tuple(out))
        for fmt in GGUF_KEPT:  # (the GGUF conversion's: X_q8_0 and X_q8_0_scales, ...)
            if name.endswith(f"_{fmt}_scales"):
                base = name.removesuffix(f"_{fmt}_scales")
                if base + f"_{fmt}" in shapes:
                    *lead, k = shapes[base + f"_{fmt}"]
                    shape = (*lead, k if fmt == "q8_0" else 2 * k)
                    return QuantizedTensor(base, fmt, (base + f"_{fmt}", name), tuple(shape))
        return None

    def tensors_of(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        get: Callable[[str], torch.Tensor],
        wanted: Callable[[str], bool] | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedParts]]:
        """(name, tensor) of every tensor the model reads: as stored, or dequantized (fp32)
        when the data part of a quantized one comes by (its other parts fetched by `get`), or
        as its `QuantizedParts` where `keep` takes its name; a quantized tensor `wanted`
        refuses (a layer the model does not have) is passed on as stored, not dequantized."""
        for name, tensor in stream:
            q = self.parts.get(name)
            if q is None:
                if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise CheckpointError(
                        f"{name} is stored in {tensor.dtype} without the block scales "
                        f"({name}_scale_inv) freetoken reads FP8 weights with (supported: "
                        f"{SUPPORTED})"
                    )
                if name not in self.unused:
                    yield name, tensor
                continue
            if name != q.parts[0]:
                continue  # a scale: read with its data
            if wanted is not None and not wanted(q.name):
                yield q.name, tensor
                continue
            parts = [tensor] + [get(p) for p in q.parts[1:]]
            if q.packed_rows:  # as MXFP4's blocks [..., G, 16] and scales [..., G]
                data, scale = parts
                blocks = data.view(torch.uint8).reshape(*scale.shape, MXFP4_BLOCK // 2)
                parts = [blocks, scale.view(torch.uint8)]
            if keep is not None and keep(q.name):
                yield q.name, QuantizedParts(q.format, *parts)
            else:
                yield q.name, _DEQUANTIZE[q.format](self, *parts)


def _method(config: dict) -> str | None:
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        fmt, block = qc.get("fmt", "e4m3"), qc.get("weight_block_size")
        # (DeepSeek's releases spell the format "e4m3", MiniMax-M2's "float8_e4m3fn")
        if fmt not in ("e4m3", "float8_e4m3fn") or not block:
            raise CheckpointError(
                f"only FP8 e4m3 with block scales (`weight_block_size`) is supported, not {qc!r}"
            )
        return method
    if method in ("mxfp4", "gguf"):  # (gguf: what freetoken's GGUF conversion kept quantized)
        return method
    if method == "modelopt":
        algo = str(qc.get("quant_algo", (qc.get("quantization") or {}).get("quant_algo", "")))
        if algo.upper() != "NVFP4":
            raise CheckpointError(f"only ModelOpt's NVFP4 is supported, not quant_algo {algo!r}")
        return method
    raise CheckpointError(
        f"checkpoint quantized with {method or qc!r}, which freetoken cannot read "
        f"(supported: {SUPPORTED}); use a bf16 release or one of those"
    )


_DEQUANTIZE = {
    "fp8": lambda d, w, s: dequantize_fp8_blocks(w, s, d.fp8_block),
    "mxfp4": lambda d, b, s: dequantize_mxfp4(b, s),
    "nvfp4": lambda d, w, s, g: dequantize_nvfp4(w, s, g),
    "q8_0": lambda d, w, s: dequantize_q8_0(w, s),
    **{fmt: (lambda d, w, s, fmt=fmt: k_quant_values(fmt, w, s)) for fmt in K_QUANT_REST},
    **{fmt: (lambda d, w, s, fmt=fmt: legacy_values(fmt, w, s)) for fmt in LEGACY_REST},
}
