"""Triton helpers of the grouped expert kernels: each expert format's weights, tile by tile.

A kernel (grouped_kernels.py) takes the fp32 weights [BLOCK_N, BLOCK_K] of some rows and
columns of one slot from `_weight_tile`, or the word-read formats' and fp4's tiles in their
value order with x read to match (`_word_tile` and `_word_x`, `_fp4_tile` and `_fp4_x`), and
accumulates them as a dense weight's. The formats are weights/expert_format.py's, each value
computed as weights/quantized.py defines it.
"""

from __future__ import annotations

from freetoken.weights.expert_format import MIXED_K_TAG, MIXED_K_WIDTH

try:  # Triton is optional: CPU-only installs (and CI) run the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# Quantized banks (FORMAT 1 fp8, 2 mxfp4, 3 nvfp4, 4 q8_0, 5-8 the K-quants, 9-12 q4_0, q4_1,
# q5_0, q5_1: `ExpertFormat.code`) are dequantized
# inside the same kernels, tile by tile (`_weight_tile`): each weight is computed as its format
# defines it in fp32 (weights/expert_format.py), rounded to x.dtype (W_ROUND; skipped where that
# is exact: fp32, and mxfp4's e2m1 x 2^e values in bf16), and then goes through the SAME
# [BLOCK_N, BLOCK_K] tiles and accumulation as a dense weight: the result is the dense kernels'
# on the dequantized banks with the same launch parameters (bit for bit under the interpreter; on
# the GPU the final in-tile sum of a differently laid-out tile may be ordered differently, an
# fp32 rounding before the bf16 one). FP8 tiles take one scale per row where a scale block spans
# the tile's columns (COL_BLOCK % BLOCK_K == 0: the checkpoints' 128 x 128 blocks with BLOCK_K <=
# 128) and one per element otherwise; Q8_0 tiles are read as [BLOCK_N, BLOCK_K / 32, 32] int8
# codes times one fp16 scale a block, the tile reshaped back (row order kept). The decode
# kernels read the legacy types and the K-quants (but q6_k, whose 82-byte blocks are not
# word-aligned) as int32 words (`_word_tile`: 16-byte loads of codes, fp16 d read as halves,
# high bits as words), decoded with shifts into [BLOCK_N, BLOCK_K / 32, 4, 8] (legacy: value
# order permuted, x read to match and the sum taken in value order) or [BLOCK_N, BLOCK_K / 32,
# 8, 4] tiles; gathering them a byte a value (`_k_quant_tile`, `_legacy_tile`, still q6_k's and
# dequantize_slots') left the decode kernels 3-10x slower than their bytes. FP4 tiles are read
# as [BLOCK_N, BLOCK_K / 32, 4] int32 words: chunks of 32 values, 16 bytes each, each word's 8
# nibbles its 8 consecutive values (low nibble first, little-endian); each nibble is decoded with
# three integer operations and a multiply (`_e2m1`), scaled (an mxfp4 chunk has one e8m0 scale,
# an nvfp4 chunk two e4m3 scales, one a half), and the eight planes are joined into [BLOCK_N,
# BLOCK_K / 32, 4, 8] in value order (register moves), which x is read to match: the same tile as
# [BLOCK_N, BLOCK_K], reshaped once for the final sum.

if triton is not None:
    _TWO_POW_126 = tl.constexpr(2.0**126)
    _MIXED_K_WIDTH = tl.constexpr(MIXED_K_WIDTH)
    _MIXED_K_TAG = tl.constexpr(MIXED_K_TAG)

    # -- the formats' values -------------------------------------------------------------------

    @triton.jit
    def _round_weight(v, dt, W_ROUND: tl.constexpr):
        """A weight's fp32 value rounded to dt (round to nearest even), kept in fp32.
        W_ROUND: 0 exact already, 1 by conversion, 2 on the bits (bf16 under the CPU
        interpreter, whose fp32 -> bf16 conversion truncates)."""
        if W_ROUND == 1:
            v = v.to(dt).to(tl.float32)
        elif W_ROUND == 2:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
        return v

    @triton.jit
    def _e2m1(w):
        """fp32 values [A, B, C, 8] of the e2m1 codes in the 8 nibbles of int32 words w
        [A, B, C] (value n in nibble n, the lowest first): sign, 2 exponent bits, 1 mantissa
        bit; 0, 0.5, 1, 1.5, 2, 3, 4, 6. Each code's bits are placed in an fp32's sign, lowest
        exponent and top mantissa bits, which read as e2m1 x 2^-126 (0.5 as a subnormal, which
        fp32 multiplication keeps: no `.ftz`), and one exact product by 2^126 gives the value:
        three integer operations and a multiply a value."""
        # Code n shifted left so that its sign is bit 31, then arithmetically (w is int32)
        # right so that its 3 magnitude bits are bits 22-24, bit 31 staying the sign. The
        # eight are joined in value order (in registers: each join adds a faster index, so the
        # first joins pick nibble bit 2, the next bit 1, the last bit 0).
        n0, n1, n2, n3 = (w << 28) >> 6, (w << 24) >> 6, (w << 20) >> 6, (w << 16) >> 6
        n4, n5, n6, n7 = (w << 12) >> 6, (w << 8) >> 6, (w << 4) >> 6, w >> 6
        bits = tl.join(
            tl.join(tl.join(n0, n4), tl.join(n2, n6)),
            tl.join(tl.join(n1, n5), tl.join(n3, n7)),
        )
        bits = tl.reshape(bits, [w.shape[0], w.shape[1], w.shape[2], 8]) & -0x7E400000
        return bits.to(tl.float32, bitcast=True) * _TWO_POW_126  # (-0x7E400000: 0x81C00000)

    @triton.jit
    def _e4m3(byte, INTERPRETED: tl.constexpr):
        """fp32 values of float8_e4m3fn bytes (uint8)."""
        v = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if INTERPRETED:  # (the interpreter reads the NaNs, 0x7f and 0xff, as +-480)
            v = tl.where((byte & 0x7F) == 0x7F, float("nan"), v)
        return v

    @triton.jit
    def _e8m0(byte):
        """fp32 values of e8m0 bytes (uint8): 2^(byte - 127), built on the bits (0: the
        subnormal 2^-127; 255 read as infinity, so a product with it is inf or nan, as torch's
        ldexp gives)."""
        bits = byte.to(tl.int32) << 23
        return tl.where(byte == 0, 0x00400000, bits).to(tl.float32, bitcast=True)

    @triton.jit
    def _weight_tile(
        w_rows,
        s_rows,
        g_rows,
        k0,
        row_mask,
        dt,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The fp32 weights [BLOCK_N, BLOCK_K] of columns k0.. of BLOCK_N rows (0 out of
        bounds and where row_mask is False), as the format defines them, rounded to dt.
        w_rows [BLOCK_N]: each row's data; s_rows [BLOCK_N]: each row's scales (fp8: its scale
        row); g_rows [BLOCK_N]: nvfp4's per-row scales (values)."""
        cols = tl.arange(0, BLOCK_K)
        if FORMAT == 0:  # dense: the weights as stored
            mask = row_mask[:, None] & ((k0 + cols) < KDIM)[None, :]
            w = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0.0)
            return w.to(tl.float32)
        elif FORMAT == 1:  # fp8: fp8(w) * scale of the [ROW_BLOCK, COL_BLOCK] block
            w = _fp8_tile(w_rows, s_rows, cols, k0, row_mask, KDIM, COL_BLOCK, INTERPRETED, BLOCK_K)
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT == 4:  # q8_0: int8(w) * fp16 scale of its 32-value block
            w = _q8_0_tile(w_rows, s_rows, cols, k0, row_mask, KDIM, BLOCK_N, BLOCK_K)
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT >= 9:  # the legacy types: blocks of 32, their d (m, fifth bits) apart
            w = _legacy_tile(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, BLOCK_N, BLOCK_K)
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT == 8:  # mixed K-quants: the tile's rows are of one type (one expert's)
            w = _mixed_k_tile(w_rows, s_rows, k0, row_mask, KDIM, BLOCK_N, BLOCK_K)
            return _round_weight(w, dt, W_ROUND)
        elif FORMAT >= 5:  # the K-quants: each value gathered from its super-block's bytes
            REST: tl.constexpr = 16 if FORMAT == 5 else (48 if FORMAT == 6 else 82)
            w = _k_quant_tile(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, REST, BLOCK_N, BLOCK_K)
            return _round_weight(w, dt, W_ROUND)
        else:  # fp4: in value order, from the [BLOCK_N, BLOCK_K / 32, 4, 8] tile
            return tl.reshape(
                _fp4_tile(
                    w_rows,
                    s_rows,
                    g_rows,
                    k0,
                    row_mask,
                    dt,
                    KDIM,
                    FORMAT,
                    W_ROUND,
                    INTERPRETED,
                    BLOCK_N,
                    BLOCK_K,
                ),
                [BLOCK_N, BLOCK_K],
            )

    @triton.jit
    def _fp8_tile(
        w_rows,
        s_rows,
        cols,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        COL_BLOCK: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """fp8: fp8(w) * the scale of its [ROW_BLOCK, COL_BLOCK] block, in fp32 (`_weight_tile`'s
        tile before its rounding)."""
        mask = row_mask[:, None] & ((k0 + cols) < KDIM)[None, :]
        w = _e4m3(tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0), INTERPRETED)
        if COL_BLOCK % BLOCK_K == 0:  # the tile's columns share a scale column
            scale = tl.load(s_rows + k0 // COL_BLOCK, mask=row_mask, other=0.0)
            w = w * scale[:, None]
        else:
            s_ptrs = s_rows[:, None] + ((k0 + cols) // COL_BLOCK)[None, :]
            w = w * tl.load(s_ptrs, mask=mask, other=0.0)
        return w

    @triton.jit
    def _q8_0_tile(
        w_rows,
        s_rows,
        cols,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """q8_0: int8(w) * the fp16 scale of its 32-value block, in fp32 (`_weight_tile`'s tile
        before its rounding)."""
        G: tl.constexpr = BLOCK_K // 32
        mask = row_mask[:, None] & ((k0 + cols) < KDIM)[None, :]
        codes = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0)
        w = tl.reshape(codes.to(tl.int8, bitcast=True).to(tl.float32), [BLOCK_N, G, 32])
        blocks = k0 // 32 + tl.arange(0, G)
        s_mask = row_mask[:, None] & (blocks * 32 < KDIM)[None, :]
        scale = tl.load(s_rows[:, None] + blocks[None, :], mask=s_mask, other=0.0)
        return tl.reshape(w * scale.to(tl.float32)[:, :, None], [BLOCK_N, BLOCK_K])

    @triton.jit
    def _mixed_k_tile(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Mixed K-quants: the tile's rows are of one type (one expert's), which its tag byte
        says; in fp32 (`_weight_tile`'s tile before its rounding)."""
        kind = tl.max(tl.load(s_rows + _MIXED_K_TAG, mask=row_mask, other=0), axis=0)
        if kind == 7:
            w = _k_quant_tile(
                w_rows, s_rows, k0, row_mask, KDIM, 7, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
            )
        elif kind == 6:
            w = _k_quant_tile(
                w_rows, s_rows, k0, row_mask, KDIM, 6, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
            )
        else:
            w = _k_quant_tile(
                w_rows, s_rows, k0, row_mask, KDIM, 5, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
            )
        return w

    @triton.jit
    def _f16_at(ptrs, mask):
        """The fp16 values (as fp32) whose two bytes (little-endian) start at ptrs."""
        lo = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptrs + 1, mask=mask, other=0).to(tl.int32)
        return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _k_scale_min(s_at, sub, mask):
        """q4_k's and q5_k's chunk scales d * sc and offsets dmin * mn [BLOCK_N, G] (fp32) of
        chunks `sub` [G] of their super-blocks, whose other bytes start at s_at [BLOCK_N, G]:
        the 6-bit scale and min from the 12 bytes at 4 (ggml's get_scale_min_k4)."""
        low = sub < 4
        at = s_at + 4
        a = tl.load(at + tl.where(low, sub, sub + 4)[None, :], mask=mask, other=0).to(tl.int32)
        b = tl.load(at + tl.where(low, sub + 4, sub - 4)[None, :], mask=mask, other=0)
        c = tl.load(at + tl.where(low, sub + 4, sub)[None, :], mask=mask, other=0).to(tl.int32)
        sc = tl.where(low[None, :], a & 63, (a & 0xF) | ((b.to(tl.int32) >> 6) << 4))
        mn = tl.where(low[None, :], c & 63, (a >> 4) | ((c >> 6) << 4))
        return _f16_at(s_at, mask) * sc.to(tl.float32), _f16_at(s_at + 2, mask) * mn.to(tl.float32)

    @triton.jit
    def _k_quant_tile(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        REST: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """fp32 values [BLOCK_N, BLOCK_K] of columns k0.. of K-quant rows (5 q4_k, 6 q5_k, 7
        q6_k: weights/quantized.py's k_quant_values, in its order of operations), as [BLOCK_N,
        G, 32]: G chunks of 32 values (k0 and BLOCK_K multiples of 32), each within one
        super-block (a block's 128 code bytes in w, its other bytes in s), whose fp16 scales and
        sub-block scales are read once a chunk and whose codes and high bits a value. REST:
        the bytes from one block's other bytes to the next's (the type's, or k_mixed's)."""
        G: tl.constexpr = BLOCK_K // 32
        chunk = k0 // 32 + tl.arange(0, G)  # the chunks' places in the row
        sub = chunk % 8  # ... and in their super-block
        lane = tl.arange(0, 32)[None, None, :]
        mask = row_mask[:, None] & (chunk * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        mask3 = mask[:, :, None] & (lane < 32)
        w_at = (w_rows[:, None] + ((chunk // 8) * 128)[None, :])[:, :, None]
        s_at = s_rows[:, None] + ((chunk // 8) * REST)[None, :]  # [BLOCK_N, G]
        if FORMAT == 7:  # q6_k: chunk 4 h + j holds values 128 h + 32 j + l
            h, j = (sub // 4)[None, :, None], (sub % 4)[None, :, None]
            byte = tl.load(w_at + 64 * h + 32 * (j % 2) + lane, mask=mask3, other=0)
            code = (byte.to(tl.int32) >> (4 * (j // 2))) & 0xF
            bits = tl.load(s_at[:, :, None] + 32 * h + lane, mask=mask3, other=0).to(tl.int32)
            code = code | (((bits >> (2 * j)) & 3) << 4)
            sc = tl.load(
                s_at[:, :, None] + 64 + 2 * sub[None, :, None] + lane // 16, mask=mask3, other=0
            )
            d = _f16_at(s_at + 80, mask)[:, :, None]
            w = (d * sc.to(tl.int8, bitcast=True).to(tl.float32)) * (code - 32).to(tl.float32)
            return tl.reshape(w, [BLOCK_N, BLOCK_K])
        # q4_k, q5_k: chunk 2 g + half holds values 64 g + 32 half + l
        g, half = (sub // 2)[None, :, None], (sub % 2)[None, :, None]
        byte = tl.load(w_at + 32 * g + lane, mask=mask3, other=0).to(tl.int32)
        code = (byte >> (4 * half)) & 0xF
        if FORMAT == 6:
            qh = tl.load(s_at[:, :, None] + 16 + lane, mask=mask3, other=0).to(tl.int32)
            code = code | (((qh >> sub[None, :, None]) & 1) << 4)
        scale, offset = _k_scale_min(s_at, sub, mask)
        scale, offset = scale[:, :, None], offset[:, :, None]
        return tl.reshape(scale * code.to(tl.float32) - offset, [BLOCK_N, BLOCK_K])

    @triton.jit
    def _legacy_tile(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """fp32 values [BLOCK_N, BLOCK_K] of columns k0.. of legacy rows (9 q4_0, 10 q4_1, 11
        q5_0, 12 q5_1: weights/quantized.py's legacy_values, in its order of operations), as
        [BLOCK_N, G, 32]: G blocks of 32 values (k0 and BLOCK_K multiples of 32), each block's
        d (and m, fifth bits) read once, its codes a value (value l in byte l % 16's low nibble
        for l < 16, its high nibble else; its fifth bit bit l of qh)."""
        G: tl.constexpr = BLOCK_K // 32
        REST: tl.constexpr = 2 * (FORMAT - 8)  # (2, 4, 6, 8 bytes besides the codes)
        block = k0 // 32 + tl.arange(0, G)
        lane = tl.arange(0, 32)[None, None, :]
        mask = row_mask[:, None] & (block * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        mask3 = mask[:, :, None] & (lane < 32)
        w_at = (w_rows[:, None] + (block * 16)[None, :])[:, :, None]
        byte = tl.load(w_at + lane % 16, mask=mask3, other=0).to(tl.int32)
        code = (byte >> (4 * (lane // 16))) & 0xF
        s_at = s_rows[:, None] + (block * REST)[None, :]  # [BLOCK_N, G]
        if FORMAT == 11 or FORMAT == 12:  # qh: the last 4 of the block's other bytes
            qh = tl.load(s_at[:, :, None] + (REST - 4) + lane // 8, mask=mask3, other=0)
            code = code | (((qh.to(tl.int32) >> (lane % 8)) & 1) << 4)
        d = _f16_at(s_at, mask)[:, :, None]
        if FORMAT == 10 or FORMAT == 12:
            w = d * code.to(tl.float32) + _f16_at(s_at + 2, mask)[:, :, None]
        elif FORMAT == 9:
            w = d * (code - 8).to(tl.float32)
        else:
            w = d * (code - 16).to(tl.float32)
        return tl.reshape(w, [BLOCK_N, BLOCK_K])

    # -- word tiles: the legacy types and the K-quants read as int32 words (decode) ------------

    @triton.jit
    def _planes(
        w,
        S0: tl.constexpr,
        S1: tl.constexpr,
        S2: tl.constexpr,
        S3: tl.constexpr,
        S4: tl.constexpr,
        S5: tl.constexpr,
        S6: tl.constexpr,
        S7: tl.constexpr,
        MASK: tl.constexpr,
    ):
        """[A, B, C, 8]: plane n of int32 words w [A, B, C] is (w >> Sn) & MASK (joined in
        registers, as `_e2m1`'s nibbles: each join adds a faster index)."""
        p0, p1, p2, p3 = (w >> S0) & MASK, (w >> S1) & MASK, (w >> S2) & MASK, (w >> S3) & MASK
        p4, p5, p6, p7 = (w >> S4) & MASK, (w >> S5) & MASK, (w >> S6) & MASK, (w >> S7) & MASK
        bits = tl.join(
            tl.join(tl.join(p0, p4), tl.join(p2, p6)),
            tl.join(tl.join(p1, p5), tl.join(p3, p7)),
        )
        return tl.reshape(bits, [w.shape[0], w.shape[1], w.shape[2], 8])

    @triton.jit
    def _bytes4(w, MASK: tl.constexpr):
        """[A, B, C, 4]: byte j of int32 words w [A, B, C] (little-endian), & MASK."""
        bits = tl.join(
            tl.join(w & MASK, (w >> 16) & MASK), tl.join((w >> 8) & MASK, (w >> 24) & MASK)
        )
        return tl.reshape(bits, [w.shape[0], w.shape[1], w.shape[2], 4])

    @triton.jit
    def _legacy_words(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`_legacy_tile`'s values as [BLOCK_N, G, 4, 8]: a block's 16 code bytes read as 4
        int32 words (one 16-byte load a row and block), plane n = 4 h + j of word q holding
        value 16 h + 4 q + j of the block (byte 4 q + j's low nibble for h = 0, its high one
        for h = 1); `_word_x` reads x in this order and `_legacy_sum` puts it back. d (m,
        the fifth bits) are read as 16-bit halves (a block's other bytes are 2-aligned)."""
        G: tl.constexpr = BLOCK_K // 32
        REST: tl.constexpr = FORMAT - 8  # (halves besides the codes: 1, 2, 3, 4)
        block = k0 // 32 + tl.arange(0, G)
        quad = tl.arange(0, 4)
        mask = row_mask[:, None] & (block * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        w_words = w_rows.to(tl.pointer_type(tl.int32))  # (rows of whole words: checked)
        words = tl.load(
            w_words[:, None, None] + (block * 4)[None, :, None] + quad[None, None, :],
            mask=mask[:, :, None],
            other=0,
        )
        code = _planes(words, 0, 8, 16, 24, 4, 12, 20, 28, 0xF)
        halves = s_rows.to(tl.pointer_type(tl.int16))[:, None] + (block * REST)[None, :]
        d = tl.load(halves, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        if FORMAT == 11 or FORMAT == 12:  # qh: value l's fifth bit is bit l
            lo = tl.load(halves + (REST - 2), mask=mask, other=0).to(tl.int32) & 0xFFFF
            hi = tl.load(halves + (REST - 1), mask=mask, other=0).to(tl.int32)
            qh = (lo | (hi << 16))[:, :, None] >> (quad * 4)[None, None, :]
            code = code | (_planes(qh, 0, 1, 2, 3, 16, 17, 18, 19, 1) << 4)
        d = d[:, :, None, None]
        if FORMAT == 10 or FORMAT == 12:
            m = tl.load(halves + 1, mask=mask, other=0).to(tl.float16, bitcast=True)
            return d * code.to(tl.float32) + m.to(tl.float32)[:, :, None, None]
        elif FORMAT == 9:
            return d * (code - 8).to(tl.float32)
        else:
            return d * (code - 16).to(tl.float32)

    @triton.jit
    def _legacy_sum(acc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Row sums of a [BLOCK_N, G, 4, 8] accumulator of `_legacy_words`' order, summed in
        value order (as the dense kernels' [BLOCK_N, BLOCK_K] tile)."""
        G: tl.constexpr = BLOCK_K // 32
        acc = tl.permute(tl.reshape(acc, [BLOCK_N, G, 4, 2, 4]), (0, 1, 3, 2, 4))
        return tl.sum(tl.reshape(acc, [BLOCK_N, BLOCK_K]), axis=1)

    @triton.jit
    def _k_words(
        w_rows,
        s_rows,
        k0,
        row_mask,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        REST: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`_k_quant_tile`'s values as [BLOCK_N, G, 8, 4] (value order): a chunk's 32 values
        from 8 int32 words of codes (two 16-byte loads a row and chunk; a byte's other nibble
        is the neighbouring chunk's, read again from L1), q5_k's fifth and q6_k's high bits
        from 8 words of its other bytes (REST a multiple of 4: word-aligned blocks)."""
        G: tl.constexpr = BLOCK_K // 32
        chunk = k0 // 32 + tl.arange(0, G)
        sub = chunk % 8
        word = tl.arange(0, 8)[None, None, :]
        mask = row_mask[:, None] & (chunk * 32 < KDIM)[None, :]  # [BLOCK_N, G]
        mask3 = mask[:, :, None]
        w_words = w_rows.to(tl.pointer_type(tl.int32))  # (rows of whole words: checked)
        w_at = w_words[:, None] + ((chunk // 8) * 32)[None, :]  # [BLOCK_N, G]
        s_at = s_rows[:, None] + ((chunk // 8) * REST)[None, :]
        s_words = (
            s_rows.to(tl.pointer_type(tl.int32))[:, None] + ((chunk // 8) * (REST // 4))[None, :]
        )
        if FORMAT == 7:  # q6_k: chunk 4 h + j holds values 128 h + 32 j + l
            h, j = sub // 4, sub % 4
            lo = tl.load(
                w_at[:, :, None] + (16 * h + 8 * (j % 2))[None, :, None] + word, mask=mask3, other=0
            )
            lo = lo >> (4 * (j // 2))[None, :, None]
            hi = tl.load(s_words[:, :, None] + (8 * h)[None, :, None] + word, mask=mask3, other=0)
            hi = hi >> (2 * j)[None, :, None]
            code = _bytes4(lo, 0xF) | (_bytes4(hi, 3) << 4)
            # one int8 scale a 16 values: words 0-3 and 4-7 of the chunk
            sc = tl.load(
                s_at[:, :, None] + 64 + 2 * sub[None, :, None] + word // 4, mask=mask3, other=0
            )
            d = _f16_at(s_at + 80, mask)[:, :, None]
            scale = (d * sc.to(tl.int8, bitcast=True).to(tl.float32))[:, :, :, None]
            return scale * (code - 32).to(tl.float32)
        # q4_k, q5_k: chunk 2 g + half holds values 64 g + 32 half + l
        g, half = sub // 2, sub % 2
        byte = tl.load(w_at[:, :, None] + (8 * g)[None, :, None] + word, mask=mask3, other=0)
        code = _bytes4(byte >> (4 * half)[None, :, None], 0xF)
        if FORMAT == 6:
            qh = tl.load(s_words[:, :, None] + 4 + word, mask=mask3, other=0)
            code = code | (_bytes4(qh >> sub[None, :, None], 1) << 4)
        scale, offset = _k_scale_min(s_at, sub, mask)
        scale, offset = scale[:, :, None, None], offset[:, :, None, None]
        return scale * code.to(tl.float32) - offset

    @triton.jit
    def _word_tile(
        w_rows,
        s_rows,
        k0,
        row_mask,
        dt,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        W_ROUND: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The decode kernels' tiles of the word-read formats (`_reads_words`), rounded to
        dt: the legacy types' [BLOCK_N, G, 4, 8] (`_legacy_words`), the K-quants' [BLOCK_N,
        G, 8, 4] (`_k_words`; k_mixed: the tile's rows are of one type, one expert's)."""
        if FORMAT >= 9:
            w = _legacy_words(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, BLOCK_N, BLOCK_K)
        elif FORMAT == 8:
            kind = tl.max(tl.load(s_rows + _MIXED_K_TAG, mask=row_mask, other=0), axis=0)
            if kind == 7:
                w = _k_words(
                    w_rows, s_rows, k0, row_mask, KDIM, 7, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
            elif kind == 6:
                w = _k_words(
                    w_rows, s_rows, k0, row_mask, KDIM, 6, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
            else:
                w = _k_words(
                    w_rows, s_rows, k0, row_mask, KDIM, 5, _MIXED_K_WIDTH, BLOCK_N, BLOCK_K
                )
        else:
            REST: tl.constexpr = 16 if FORMAT == 5 else 48
            w = _k_words(w_rows, s_rows, k0, row_mask, KDIM, FORMAT, REST, BLOCK_N, BLOCK_K)
        return _round_weight(w, dt, W_ROUND)

    @triton.jit
    def _word_x(x_row, k0, valid, KDIM: tl.constexpr, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
        """x (fp32) in `_word_tile`'s order: [G, 4, 8] for the legacy types, [G, 8, 4]."""
        G: tl.constexpr = BLOCK_K // 32
        if FORMAT >= 9:  # (one return: the two shapes differ)
            n = tl.arange(0, 8)[None, None, :]
            offs = (
                tl.arange(0, G)[:, None, None] * 32
                + tl.arange(0, 4)[None, :, None] * 4
                + (n // 4) * 16
                + n % 4
            )
        else:
            offs = (
                tl.arange(0, G)[:, None, None] * 32
                + tl.arange(0, 8)[None, :, None] * 4
                + tl.arange(0, 4)[None, None, :]
            )
        return tl.load(x_row + k0 + offs, mask=((k0 + offs) < KDIM) & valid, other=0.0).to(
            tl.float32
        )

    @triton.jit
    def _word_sum(acc, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Row sums of a `_word_tile` accumulator, in value order."""
        if FORMAT >= 9:
            return _legacy_sum(acc, BLOCK_N, BLOCK_K)
        return tl.sum(tl.reshape(acc, [BLOCK_N, BLOCK_K]), axis=1)

    @triton.jit
    def _fp4_tile(
        w_rows,
        s_rows,
        g_rows,
        k0,
        row_mask,
        dt,
        KDIM: tl.constexpr,
        FORMAT: tl.constexpr,
        W_ROUND: tl.constexpr,
        INTERPRETED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`_weight_tile`'s fp4 weights as [BLOCK_N, G, 4, 8]: G chunks of 32 values (value
        32 g + 8 w + n of the tile at [:, g, w, n]), read as [BLOCK_N, G, 4] int32 words (one
        16-byte vector a row and chunk), each word's 8 nibbles its 8 values (little-endian:
        byte j's low nibble is value 2 j)."""
        G: tl.constexpr = BLOCK_K // 32
        chunks = tl.arange(0, G)
        words = tl.arange(0, 4)
        word = k0 // 8 + chunks[:, None] * 4 + words[None, :]  # [G, 4]
        mask = row_mask[:, None, None] & (word < KDIM // 8)[None, :, :]
        w_words = w_rows.to(tl.pointer_type(tl.int32))  # (rows of whole words: checked)
        w = tl.load(w_words[:, None, None] + word[None, :, :], mask=mask, other=0)
        chunk_mask = row_mask[:, None] & ((k0 + chunks * 32) < KDIM)[None, :]
        if FORMAT == 2:  # mxfp4: e2m1 * 2^(s - 127), one scale a chunk
            s = tl.load(s_rows[:, None] + (k0 // 32 + chunks)[None, :], mask=chunk_mask, other=0)
            scale = _e8m0(s)[:, :, None, None]
        else:  # nvfp4: (e2m1 * e4m3) * g, one scale per 16 values: two a chunk
            half_mask = row_mask[:, None] & ((k0 + chunks * 32 + 16) < KDIM)[None, :]
            first = s_rows[:, None] + (k0 // 16 + 2 * chunks)[None, :]
            s0 = _e4m3(tl.load(first, mask=chunk_mask, other=0), INTERPRETED)
            s1 = _e4m3(tl.load(first + 1, mask=half_mask, other=0), INTERPRETED)
            scale = tl.where((words < 2)[None, None, :], s0[:, :, None], s1[:, :, None])
            scale = scale[:, :, :, None]
        v = _e2m1(w) * scale
        if FORMAT == 3:
            v = v * g_rows[:, None, None, None]
        return _round_weight(v, dt, W_ROUND)

    @triton.jit
    def _fp4_x(x_row, k0, valid, KDIM: tl.constexpr, BLOCK_K: tl.constexpr):
        """x [G, 4, 8] (fp32) for `_fp4_tile`'s tile of columns k0.."""
        G: tl.constexpr = BLOCK_K // 32
        offs = (
            tl.arange(0, G)[:, None, None] * 32
            + tl.arange(0, 4)[None, :, None] * 8
            + tl.arange(0, 8)[None, None, :]
        )
        return tl.load(x_row + k0 + offs, mask=((k0 + offs) < KDIM) & valid, other=0.0).to(
            tl.float32
        )
