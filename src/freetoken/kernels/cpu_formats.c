/* The quantized formats (part of cpu_native.c's translation unit, after cpu_native.h): how each
 * stores a projection and where a row of one starts (quantized_row), the tables of values the
 * decoders look codes up in, and the scalar decoders: the definition, which the vector decoders
 * (cpu_decoders.c) and the dot products that decode in registers (cpu_dots.c) are held to. The
 * banks come from kernels/cpu_banks.py (`projection`), the codes from weights/expert_format.py. */

/* ---- quantized experts ----------------------------------------------------------------------
 *
 * A projection kept quantized (weights/expert_format.py holds the definition): codes and their
 * scales, each value computed in fp32 in the definition's order, then rounded to the model's
 * dtype (bf16 to nearest even, as torch rounds): exactly the weight a checkpoint dequantized at
 * load holds.
 *
 *   fp8    w [P, N, K] e4m3 bytes, s fp32 [P, ceil(N / bn), ceil(K / bk)]: fp8(w) * s
 *   mxfp4  w [P, N, K / 2] e2m1 pairs (low nibble first), s [P, N, K / 32] e8m0:
 *          e2m1 * 2^(s - 127)
 *   nvfp4  w as mxfp4, s [P, N, K / 16] e4m3 bytes, g fp32 [P, N]: (e2m1 * fp8(s)) * g
 *   q8_0   w [P, N, K] int8, s [P, N, K / 32] fp16: int8 * f16(s) (exact in fp32)
 *   q4_k, q5_k, q6_k, k_mixed: GGUF's K-quants (below)
 *   q4_0, q4_1, q5_0, q5_1: GGUF's legacy blocks of 32 (below)
 *
 * The kernel computes with those values through the dense path's dot products (dot_bf16_bf16,
 * dot_f32), so a quantized job equals the dense job on the dequantized banks bit for bit, while
 * reading only the quantized bytes (but for nvfp4's rows of bf16 models read by one route: their
 * block route sums the same products in another order, within fp32 rounding; see nv_block). A
 * row read by one route (decode's usual case) is decoded
 * in registers, 32 or 64 values at a time, straight into that dot product's accumulators, in
 * its order (`qdot_*`); a row read by several routes is decoded once into the thread's buffer
 * and dotted from there with each (as are rows a decoder cannot take in registers: fp8 blocks
 * of other widths, the last columns past a whole step). The decoders look values up in a
 * table per block: an e2m1 block's 16 possible values (times its scale) are one vector, indexed
 * by the codes with one permute; e4m3 goes through f16 (its bits placed as an f16's are the
 * value times 2^-8). AVX-512 or AVX2, as -march=native finds; the scalar decoders are their
 * reference. */

/* GGUF's K-quants: super-blocks of 256 values kept as their 128 bytes of low 4 bits (w) and
 * their other bytes (s: k_quant_rest a block), as weights/quantized.py's k_quant_values; or, as
 * FMT_K_MIXED, blocks of any of the three with their other bytes padded to MIXED_K_WIDTH and
 * their type at byte MIXED_K_TAG (a row is of one type: quantized_row reads it once). */
static inline int is_k_quant(int fmt) {
    return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K;
}
static inline int64_t k_quant_rest(int fmt) {
    return fmt == FMT_Q4_K ? 16 : fmt == FMT_Q5_K ? 48 : 82;
}

/* GGUF's legacy 4- and 5-bit types: blocks of 32 values kept as their 16 bytes of low 4 bits
 * (w: value j in byte j's low nibble, j + 16 in its high one) and their other bytes (s:
 * legacy_rest a block: an fp16 d, q4_1's and q5_1's fp16 m, q5_0's and q5_1's 4 bytes qh whose
 * bit j is value j's fifth bit), as weights/quantized.py's legacy_values. */
static inline int is_legacy(int fmt) {
    return fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_Q5_0 || fmt == FMT_Q5_1;
}
static inline int64_t legacy_rest(int fmt) {
    return fmt == FMT_Q4_0 ? 2 : fmt == FMT_Q4_1 ? 4 : fmt == FMT_Q5_0 ? 6 : 8;
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j from their 12 packed bytes (ggml's
 * get_scale_min_k4). */
static inline void k_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline qrow_t quantized_row(const proj_t *p, int64_t pair, int64_t N, int64_t K,
                                   int64_t row) {
    const int fmt = p->fmt;
    const int64_t r = pair * N + row;
    qrow_t q = {.fmt = fmt};
    if (fmt == FMT_K_MIXED) {
        q.rest = MIXED_K_WIDTH;
        q.w = (const uint8_t *)p->w + r * (K / 2);
        q.s8 = (const uint8_t *)p->s + r * (K / 256) * q.rest;
        const int type = q.s8[MIXED_K_TAG];
        q.fmt = is_k_quant(type) ? type : FMT_Q4_K; /* (a bad tag: read in bounds anyway) */
        return q;
    }
    if (fmt == FMT_FP8) {
        const int64_t scale_rows = (N + p->bn - 1) / p->bn, scale_cols = (K + p->bk - 1) / p->bk;
        q.w = (const uint8_t *)p->w + r * K;
        q.s32 = (const float *)p->s + (pair * scale_rows + row / p->bn) * scale_cols;
        q.bk = p->bk;
    } else if (fmt == FMT_Q8_0) {
        q.w = (const uint8_t *)p->w + r * K;
        q.s16 = (const uint16_t *)p->s + r * (K / 32);
    } else if (is_k_quant(fmt)) {
        q.rest = k_quant_rest(fmt);
        q.w = (const uint8_t *)p->w + r * (K / 2);
        q.s8 = (const uint8_t *)p->s + r * (K / 256) * q.rest;
    } else if (is_legacy(fmt)) {
        q.rest = legacy_rest(fmt);
        q.w = (const uint8_t *)p->w + r * (K / 2);
        q.s8 = (const uint8_t *)p->s + r * (K / 32) * q.rest;
    } else {
        q.w = (const uint8_t *)p->w + r * (K / 2);
        q.s8 = (const uint8_t *)p->s + r * (K / (fmt == FMT_MXFP4 ? 32 : 16));
        if (fmt == FMT_NVFP4) q.g = p->g[r];
    }
    return q;
}

static float E4M3[256];                             /* e4m3fn byte -> value (0x7f, 0xff: NaN) */
static float E2M1[16] __attribute__((aligned(64))); /* e2m1 code -> value */
/* mxfp4: the 16 codes' values times 2^(s - 127), for each e8m0 byte s; in bf16 twice over (the
 * AVX-512 decoder looks them up by 5 bits of an index whose fifth bit is another code's). A
 * checkpoint's scales span a few dozen values: the tables' hot part stays in L1. */
static float MX_F32[256][16] __attribute__((aligned(64)));
static uint16_t MX_BF16[256][32] __attribute__((aligned(64)));
static float MX_BF16_F32[256][16] __attribute__((aligned(64))); /* MX_BF16's values in fp32 */
/* The scaled-codes route's codes as exact bf16 integers (see scaled_dot): CODES[i] = i - 32 for
 * i < 64 (Q6_K's six bits), the others' tables are slices of it (unsigned codes from 32, q5_0's
 * from 16, q4_0's from 24), and a bf16 1.0 for a block's sum of x. */
static uint16_t CODES[96] __attribute__((aligned(64)));
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

/* fp32 -> bf16 bits, to nearest even (torch's conversion; subnormals kept, NaN quiet). */
static inline uint16_t bf16_round_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
        if ((b & 0x7f) == 0x7f) v = NAN;
        E4M3[b] = b & 0x80 ? -v : v;
    }
    for (int i = 0; i < 96; i++) CODES[i] = bf16_round_bits((float)(i - 32)); /* (exact) */
    static const float fp4[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int c = 0; c < 16; c++) E2M1[c] = c & 8 ? -fp4[c & 7] : fp4[c];
    for (int s = 0; s < 256; s++) {
        const float scale = ldexpf(1.0f, s - 127); /* 2^-127 subnormal; s = 255: inf (torch's) */
        for (int c = 0; c < 16; c++) {
            MX_F32[s][c] = E2M1[c] * scale;
            MX_BF16[s][c] = MX_BF16[s][c + 16] = bf16_round_bits(MX_F32[s][c]);
            MX_BF16_F32[s][c] = bf16_to_f32(MX_BF16[s][c]);
        }
    }
}

/* Value k of a decoded row, in the model's dtype. */
static inline void put(void *out, int64_t k, float v, int bf16) {
    if (bf16)
        ((uint16_t *)out)[k] = bf16_round_bits(v);
    else
        ((float *)out)[k] = v;
}

static inline void *at(void *out, int64_t k, int bf16) {
    return (char *)out + k * (bf16 ? sizeof(uint16_t) : sizeof(float));
}

/* fp16 bits -> fp32 (exact; subnormals, infinities and NaNs kept). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    float v;
    if (e == 31) {
        uint32_t u = sign | 0x7f800000u | (m << 13);
        memcpy(&v, &u, 4);
        return v;
    }
    v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(1024u + m), (int)e - 25);
    return sign ? -v : v;
}

/* The scalar decoders: the definition, value by value. */
static void fp8_span_scalar(const uint8_t *c, int64_t n, float s, int bf16, void *out) {
    for (int64_t k = 0; k < n; k++) put(out, k, E4M3[c[k]] * s, bf16);
}

__attribute__((unused)) static void mxfp4_blocks_scalar(const uint8_t *w, const uint8_t *s,
                                                        int64_t blocks, int bf16, void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        const float *t = MX_F32[s[b]];
        for (int64_t j = 0; j < 16; j++) {
            const uint8_t pair = w[16 * b + j];
            put(out, 32 * b + 2 * j, t[pair & 15], bf16);
            put(out, 32 * b + 2 * j + 1, t[pair >> 4], bf16);
        }
    }
}

__attribute__((unused)) static void nvfp4_blocks_scalar(const uint8_t *w, const uint8_t *s,
                                                        int64_t blocks, float g, int bf16,
                                                        void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        const float scale = E4M3[s[b]];
        for (int64_t j = 0; j < 8; j++) {
            const uint8_t pair = w[8 * b + j];
            put(out, 16 * b + 2 * j, (E2M1[pair & 15] * scale) * g, bf16);
            put(out, 16 * b + 2 * j + 1, (E2M1[pair >> 4] * scale) * g, bf16);
        }
    }
}

__attribute__((unused)) static void q8_0_blocks_scalar(const uint8_t *w, const uint16_t *s,
                                                       int64_t blocks, int bf16, void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        const float scale = f16_to_f32(s[b]);
        for (int64_t j = 0; j < 32; j++)
            put(out, 32 * b + j, (float)(int8_t)w[32 * b + j] * scale, bf16);
    }
}

/* A legacy block's multipliers from its other bytes s: d, m (q4_1, q5_1), the fifth bits qh
 * (q5_0, q5_1; else 0) and the codes' offset (q4_0 8, q5_0 16). Its value j: d * (q - bias),
 * or d * q + m (the product exact in fp32, so an FMA rounds as the definition's two steps). */
typedef struct {
    float d, m;
    uint32_t qh;
    int bias, has_min;
} legacy_t;

/* fp16 bits -> fp32 for a block's scales: F16C's one instruction where the build has it (as
 * q8_0's decoders read theirs; exact, NaNs kept NaN), else f16_to_f32 (whose ldexpf, twice a
 * block of 32, took q4_1 and q5_1 to 60% of q4_0's and q5_0's speed). */
static inline float f16_scale(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_to_f32(h);
#endif
}

static inline legacy_t legacy_block(int fmt, const uint8_t *s) {
    legacy_t b = {.d = f16_scale((uint16_t)(s[0] | s[1] << 8))};
    b.has_min = fmt == FMT_Q4_1 || fmt == FMT_Q5_1;
    if (b.has_min) b.m = f16_scale((uint16_t)(s[2] | s[3] << 8));
    if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1) {
        const uint8_t *h = s + (fmt == FMT_Q5_0 ? 2 : 4);
        b.qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
    }
    b.bias = fmt == FMT_Q4_0 ? 8 : fmt == FMT_Q5_0 ? 16 : 0;
    return b;
}

static inline float legacy_value(const legacy_t *b, int code) {
    return b->has_min ? b->d * (float)code + b->m : b->d * (float)(code - b->bias);
}

__attribute__((unused)) static void legacy_blocks_scalar(int fmt, int64_t rest, const uint8_t *w,
                                                         const uint8_t *s, int64_t blocks,
                                                         int bf16, void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        const legacy_t p = legacy_block(fmt, s + b * rest);
        for (int j = 0; j < 16; j++) {
            const uint8_t byte = w[16 * b + j];
            const int lo = (byte & 15) | ((p.qh >> j) & 1) << 4;
            const int hi = (byte >> 4) | ((p.qh >> (j + 16)) & 1) << 4;
            put(out, 32 * b + j, legacy_value(&p, lo), bf16);
            put(out, 32 * b + 16 + j, legacy_value(&p, hi), bf16);
        }
    }
}

/* fp8 x s by the f16 route: e4m3 bits placed as an f16's (sign << 15 | (byte & 0x7f) << 7,
 * subnormals included) are the value times 2^-8, exactly. Their product with s * 2^8 is the
 * exact product fp8 * s rounded once, as the definition's, whenever s * 2^8 is finite (then it
 * is exact); otherwise the decoders multiply by 2^8 first. A step with a NaN code goes the
 * scalar way. */
static inline int fp8_fold(float s, float *mul) {
    const float s256 = s * 256.0f;
    if (isfinite(s256) || !isfinite(s)) {
        *mul = s256;
        return 1;
    }
    *mul = s;
    return 0;
}

/* Whether values of an fp8 block may be fp32 subnormals, where AVX512-BF16's conversion (which
 * flushes them) would differ from torch's: never with the scales checkpoints use, so the
 * conversion's check is made only where they are this small (the least nonzero e4m3 is 2^-9).
 * nvfp4's tables are built with the check always on. */
static inline int fp8_tiny(float s) { return !(fabsf(s) >= 0x1p-116f); }

/* A K-quant block's multipliers: q4_k, q5_k: d * scale and dmin * min of its 8 sub-blocks of
 * 32; q6_k: d * scale of its 16 of 16 (exact in fp32). */
static inline void kq_scales(int fmt, const uint8_t *s, float *scale, float *offset) {
    if (fmt == FMT_Q6_K) {
        const float d = f16_to_f32((uint16_t)(s[80] | s[81] << 8));
        for (int i = 0; i < 16; i++) scale[i] = d * (float)(int8_t)s[64 + i];
        return;
    }
    const float d = f16_to_f32((uint16_t)(s[0] | s[1] << 8));
    const float dmin = f16_to_f32((uint16_t)(s[2] | s[3] << 8));
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(s + 4, j, &sc, &m);
        scale[j] = d * (float)sc;
        offset[j] = dmin * (float)m;
    }
}

/* K-quant super-blocks into out, each value computed as k_quant_values defines it (scalar: the
 * products are exact in fp32, so the order of the one rounding is the definition's). */
static void k_quant_blocks(int fmt, int64_t rest, const uint8_t *w, const uint8_t *s,
                           int64_t blocks, int bf16, void *out) {
    float v[256], scale[16], offset[8];
    for (int64_t b = 0; b < blocks; b++, w += 128, s += rest) {
        kq_scales(fmt, s, scale, offset);
        if (fmt == FMT_Q6_K) { /* values 128 h + 32 j + l, 16 a scale (vectorizable runs) */
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t *low = w + 64 * h + 32 * (j & 1), *high = s + 32 * h;
                    const int shift = 4 * (j >> 1), high_shift = 2 * j;
                    for (int l0 = 0; l0 < 32; l0 += 16) {
                        const float sc = scale[8 * h + 2 * j + l0 / 16];
                        for (int l = l0; l < l0 + 16; l++) {
                            const int code = ((low[l] >> shift) & 0xF) |
                                             ((high[l] >> high_shift) & 3) << 4;
                            v[128 * h + 32 * j + l] = sc * (float)(code - 32);
                        }
                    }
                }
        } else {
            for (int g = 0; g < 4; g++)
                for (int half = 0; half < 2; half++) {
                    const float sc = scale[2 * g + half], off = offset[2 * g + half];
                    for (int l = 0; l < 32; l++) {
                        int code = half ? w[32 * g + l] >> 4 : w[32 * g + l] & 0xF;
                        if (fmt == FMT_Q5_K) code |= ((s[16 + l] >> (2 * g + half)) & 1) << 4;
                        v[64 * g + 32 * half + l] = sc * (float)code - off;
                    }
                }
        }
        if (bf16) {
            uint16_t *o = (uint16_t *)out + b * 256;
            for (int i = 0; i < 256; i++) o[i] = bf16_round_bits(v[i]);
        } else {
            memcpy((float *)out + b * 256, v, sizeof(v));
        }
    }
}
