/* Routed experts on the CPU, reading weights straight from the host expert pool.
 *
 * Built at first use by kernels/native.py with the machine's own compiler (-O3 -march=native),
 * so the inner loops below become AVX-512 (or AVX2) code on the machine that runs them.
 * `ft_cpu_experts_submit` hands a job to this library's own team of threads and returns at
 * once; `ft_cpu_experts_wait` takes part in the job's remaining work, then blocks until it is
 * done (called through ctypes, which releases the GIL meanwhile). No Python thread is involved:
 * a Python thread would need the GIL to start the job, and the thread driving the GPU holds it
 * for milliseconds at a time while it launches kernels.
 *
 * The team takes work items from a shared counter rather than a fixed share each (as an OpenMP
 * static schedule would): a thread that wakes late, or shares its core with the thread driving
 * the GPU, then finishes fewer items instead of holding up the whole job. With OpenMP's static
 * schedule the GPU host's CPU path ran at half its bandwidth beside the GPU thread.
 *
 * Decode runs a few tokens through a few experts: matrix-vector products, bound by how fast
 * weights stream from DRAM. Every weight row is read once per call (the tokens of a group that
 * share an expert are multiplied while the row sits in L1), 64 elements per step into four
 * independent 16-wide accumulators so enough loads are in flight. torch's bf16 GEMV reached
 * 40 GB/s on the GPU host's CPU where a loop like this one reached 64.
 *
 * Experts kept quantized (fp8, mxfp4, nvfp4, GGUF's types: see "quantized experts" below) are
 * decoded as they are read, into the values their dequantized copy holds, and go through the
 * same arithmetic.
 *
 * Results follow the torch reference (kernels/grouped_experts.py) rounding step for step: for
 * bf16 banks the projections, the activation, its product with up, the down projection and the
 * gate-weighted contribution are each rounded to bf16 where torch rounds them; only the
 * accumulation order inside a dot product differs. Contributions are summed per token in fp32,
 * by expert id and then in the caller's route order.
 */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { DT_BF16 = 0, DT_F32 = 1 };
/* Activation codes: freetoken/activations.py holds the one table, passed as -D defines by
 * kernels/native.py when it compiles this file. */
#if !defined(ACT_SILU) || !defined(ACT_GELU) || !defined(ACT_GELU_TANH) || !defined(ACT_RELU) \
    || !defined(ACT_SWIGLU_OAI) || !defined(ACT_SWIGLU_CLAMP) || !defined(SWIGLU_CLAMP_LIMIT)
#error "compile through freetoken.kernels.native, which defines the ACT_* codes"
#endif
/* Expert formats: weights/expert_format.py's KERNEL_CODES, passed the same way. */
#if !defined(FMT_DENSE) || !defined(FMT_FP8) || !defined(FMT_MXFP4) || !defined(FMT_NVFP4) \
    || !defined(FMT_Q8_0) || !defined(FMT_Q4_K) || !defined(FMT_Q5_K) || !defined(FMT_Q6_K) \
    || !defined(FMT_K_MIXED) || !defined(MIXED_K_WIDTH) || !defined(MIXED_K_TAG) \
    || !defined(FMT_Q4_0) || !defined(FMT_Q4_1) || !defined(FMT_Q5_0) || !defined(FMT_Q5_1)
#error "compile through freetoken.kernels.native, which defines the FMT_* codes"
#endif

#define ROW_BLOCK 16 /* weight rows per work item: a few hundred items per call to balance */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to the nearest bf16, ties to even (torch's float -> bfloat16 conversion). */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f; /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline float rnd(float f, int bf16) { return bf16 ? round_bf16(f) : f; }

/* The bits of a float that is already a bf16 value. */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static float dot_f32(const float *restrict w, const float *restrict x, int64_t n) {
    float acc[4][16] = {{0}};
    int64_t k = 0;
    for (; k + 64 <= n; k += 64)
        for (int u = 0; u < 4; u++)
            for (int j = 0; j < 16; j++) acc[u][j] += w[k + 16 * u + j] * x[k + 16 * u + j];
    float s = 0.0f;
    for (; k < n; k++) s += w[k] * x[k];
    for (int u = 0; u < 4; u++)
        for (int j = 0; j < 16; j++) s += acc[u][j];
    return s;
}

/* bf16 weights against bf16 activations (x bf16, as the model holds it: exact). With
 * AVX512-BF16 one instruction multiplies 32 pairs and adds them into fp32 accumulators, half
 * the work of converting each weight to fp32 first. */
static float dot_bf16_bf16(const uint16_t *restrict w, const uint16_t *restrict x, int64_t n) {
    int64_t k = 0;
    float s = 0.0f;
#if defined(__AVX512BF16__)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (; k + 128 <= n; k += 128) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k),
                              (__m512bh)_mm512_loadu_si512(x + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32),
                              (__m512bh)_mm512_loadu_si512(x + k + 32));
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + k + 64),
                              (__m512bh)_mm512_loadu_si512(x + k + 64));
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + k + 96),
                              (__m512bh)_mm512_loadu_si512(x + k + 96));
    }
    /* The rest 32 values a step into a0, the last (< 32) by masked loads: a scalar tail of
     * dependent adds took as long as the vector loop on a 2880-wide row. */
    for (; k + 32 <= n; k += 32)
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k),
                              (__m512bh)_mm512_loadu_si512(x + k));
    if (k < n) {
        const __mmask32 m = (__mmask32)((1ull << (n - k)) - 1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, w + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
        k = n;
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
    /* Without it, dot_f32's form: 64 lanes of sums the compiler vectorizes (AVX2: 2.8x the speed
     * of the one running sum it had, on the 2-core machine built with -mno-avx512f). */
    float acc[4][16] = {{0}};
    for (; k + 64 <= n; k += 64)
        for (int u = 0; u < 4; u++)
            for (int j = 0; j < 16; j++)
                acc[u][j] += bf16_to_f32(w[k + 16 * u + j]) * bf16_to_f32(x[k + 16 * u + j]);
    for (; k < n; k++) s += bf16_to_f32(w[k]) * bf16_to_f32(x[k]);
    for (int u = 0; u < 4; u++)
        for (int j = 0; j < 16; j++) s += acc[u][j];
#endif
    for (; k < n; k++) s += bf16_to_f32(w[k]) * bf16_to_f32(x[k]);
    return s;
}

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

typedef struct {
    int fmt;        /* FMT_*: how it is stored (the two projections may differ: see submit) */
    const void *w;  /* dense weights in the model's dtype, or the codes */
    const void *s;  /* the scales (above) */
    const float *g; /* nvfp4's per-row scales */
    int64_t bn, bk; /* fp8's block: rows and columns per scale */
} proj_t;

/* One row of a quantized projection: where its codes and scales start. */
typedef struct {
    int fmt;
    const uint8_t *w;   /* its codes */
    const uint8_t *s8;  /* its scale bytes (mxfp4, nvfp4; the GGUF blocks' other bytes) */
    const uint16_t *s16; /* its fp16 scales (q8_0) */
    const float *s32;   /* its row of block scales (fp8) */
    float g;            /* its scale (nvfp4) */
    int64_t bk;         /* fp8's block columns */
    int64_t rest;       /* GGUF blocks: the bytes from one block's other bytes to the next's */
} qrow_t;

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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FT_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__)
#define FT_AVX2 1
#endif

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

/* The decoders ask for the codes PREFETCH_BYTES ahead of those they read (and the scales as
 * far ahead): the next rows of the projection, which an item reads next. Without, they waited
 * on the lines of each row (a few hundred bytes to a few KiB of codes, and their scales apart:
 * too short a stream for the hardware's prefetchers): 60-80% of this speed on the 2-core CPU,
 * with the rows in L3 as from DRAM. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif
#ifndef PREFETCH_LOCALITY /* 3: into L1 (prefetcht0); 1: into L2 (prefetcht2) */
#define PREFETCH_LOCALITY 3
#endif
#if PREFETCH_BYTES > 0
#define PREFETCH(p) __builtin_prefetch((const char *)(p), 0, PREFETCH_LOCALITY)
#else
#define PREFETCH(p) ((void)(p))
#endif

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

#if FT_AVX512
/* lo[j], hi[j] -> values 2j, 2j + 1 */
static const int32_t INTERLEAVE[32] = {
    0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31,
};

/* 16 floats -> bf16 bits (to nearest even, subnormals kept, NaN quiet) in 16-bit lanes. */
static inline __m256i bf16_rne16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, quiet));
}

static inline __mmask16 subnormal16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    return _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000))
           & _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff));
}

/* 32 floats (a, then b) -> 32 bf16 bits. AVX512-BF16's instruction rounds as torch does but
 * flushes subnormals: where `tiny` says there may be some, lanes of those go the integer way. */
static inline __m512i bf16_rne32(__m512 a, __m512 b, int tiny) {
#if defined(__AVX512BF16__)
    if (!tiny || !(subnormal16(a) | subnormal16(b))) return (__m512i)_mm512_cvtne2ps_pbh(b, a);
#else
    (void)tiny;
#endif
    return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_rne16(a)), bf16_rne16(b), 1);
}

/* fp8: a block's scale as the decoders use it. */
typedef struct {
    __m512 mul;
    float s;
    int folded, tiny;
} fp8_scale_t;

static inline fp8_scale_t fp8_scale(float s) {
    fp8_scale_t f = {.s = s, .tiny = fp8_tiny(s)};
    float mul;
    f.folded = fp8_fold(s, &mul);
    f.mul = _mm512_set1_ps(mul);
    return f;
}

/* 32 e4m3 codes (those outside `mask` zero) -> their values times the scale, fp32, in lo (the
 * first 16) and hi; 0 (and nothing) if one is a NaN. */
static inline int fp8_32(__m256i b, __mmask32 mask, const fp8_scale_t *f, __m512 *lo,
                         __m512 *hi) {
    const __m256i m7 = _mm256_set1_epi8(0x7f);
    if (_mm256_mask_cmpeq_epi8_mask(mask, _mm256_and_si256(b, m7), m7)) return 0;
    /* sign-extended, << 7: the magnitude's 7 bits at 7..13, the sign at 15 (and 14: off) */
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                                       _mm512_set1_epi16((short)0xBF80));
    __m512 l = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    __m512 u = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    if (!f->folded) {
        l = _mm512_mul_ps(l, _mm512_set1_ps(256.0f));
        u = _mm512_mul_ps(u, _mm512_set1_ps(256.0f));
    }
    *lo = _mm512_mul_ps(l, f->mul);
    *hi = _mm512_mul_ps(u, f->mul);
    return 1;
}

static void fp8_span(const uint8_t *c, int64_t n, float s, int bf16, void *out) {
    const fp8_scale_t f = fp8_scale(s);
    for (int64_t k = 0; k < n; k += 32) {
        const int64_t m = n - k < 32 ? n - k : 32;
        PREFETCH(c + k + PREFETCH_BYTES);
        const __mmask32 mask = m == 32 ? 0xffffffffu : (1u << m) - 1;
        const __m256i b = m == 32 ? _mm256_loadu_si256((const __m256i *)(c + k))
                                  : _mm256_maskz_loadu_epi8(mask, c + k);
        __m512 lo, hi;
        if (!fp8_32(b, mask, &f, &lo, &hi)) {
            fp8_span_scalar(c + k, m, s, bf16, at(out, k, bf16));
        } else if (bf16) {
            _mm512_mask_storeu_epi16((uint16_t *)out + k, mask, bf16_rne32(lo, hi, f.tiny));
        } else {
            _mm512_mask_storeu_ps((float *)out + k, (__mmask16)mask, lo);
            _mm512_mask_storeu_ps((float *)out + k + 16, (__mmask16)(mask >> 16), hi);
        }
    }
}

/* 32 fp8 codes -> bf16 values (the scalar way when one is a NaN). */
static inline __m512i fp8_bf16(const uint8_t *c, const fp8_scale_t *f) {
    __m512 lo, hi;
    if (!fp8_32(_mm256_loadu_si256((const __m256i *)c), 0xffffffffu, f, &lo, &hi)) {
        uint16_t v[32];
        fp8_span_scalar(c, 32, f->s, 1, v);
        return _mm512_loadu_si512(v);
    }
    return bf16_rne32(lo, hi, f->tiny);
}

/* 32 fp8 codes -> fp32 values (lo: the first 16). */
static inline void fp8_f32(const uint8_t *c, const fp8_scale_t *f, __m512 *lo, __m512 *hi) {
    if (fp8_32(_mm256_loadu_si256((const __m256i *)c), 0xffffffffu, f, lo, hi)) return;
    float v[32];
    fp8_span_scalar(c, 32, f->s, 0, v);
    *lo = _mm512_loadu_ps(v);
    *hi = _mm512_loadu_ps(v + 16);
}

/* q8_0: a block's 32 int8 codes times its scale, fp32 (lo: the first 16): exact products, so
 * never subnormal (the least nonzero is 2^-24) and the bf16 conversion needs no check. */
static inline void q8_f32(const uint8_t *w, float scale, __m512 *lo, __m512 *hi) {
    const __m512 vs = _mm512_set1_ps(scale);
    const __m256i b = _mm256_loadu_si256((const __m256i *)w);
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))), vs);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))),
                        vs);
}

static inline __m512i q8_bf16(const uint8_t *w, float scale) {
    __m512 lo, hi;
    q8_f32(w, scale, &lo, &hi);
    return bf16_rne32(lo, hi, 0);
}

/* A legacy block (16 code bytes w, other bytes s) -> its 32 values in fp32 (lo: values 0-15,
 * the low nibbles; hi: 16-31, the high ones), each legacy_value; never subnormal (multiples of
 * 2^-24 or zero), so the bf16 conversion needs no check. */
static inline void legacy_f32(int fmt, const uint8_t *w, const uint8_t *s, __m512 *lo,
                              __m512 *hi) {
    const legacy_t p = legacy_block(fmt, s);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
    __m512i c0 = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    __m512i c1 = _mm512_srli_epi32(bytes, 4);
    if (p.qh) { /* each value's fifth bit: bit j of qh, a mask's lane j */
        const __m512i fifth = _mm512_set1_epi32(16);
        c0 = _mm512_mask_or_epi32(c0, (__mmask16)p.qh, c0, fifth);
        c1 = _mm512_mask_or_epi32(c1, (__mmask16)(p.qh >> 16), c1, fifth);
    }
    const __m512 d = _mm512_set1_ps(p.d);
    if (p.has_min) {
        const __m512 m = _mm512_set1_ps(p.m);
        *lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(c0), m);
        *hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(c1), m);
    } else {
        const __m512i bias = _mm512_set1_epi32(p.bias);
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(c0, bias)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(c1, bias)));
    }
}

static inline __m512i legacy_bf16(int fmt, const uint8_t *w, const uint8_t *s) {
    __m512 lo, hi;
    legacy_f32(fmt, w, s, &lo, &hi);
    return bf16_rne32(lo, hi, 0);
}

/* Values 32 c .. 32 c + 31 of a K-quant block in fp32 (lo: the first 16), each k_quant_blocks'
 * value (q4_k, q5_k: scale * code - offset by one FMA, the product being exact; q6_k: scale *
 * (code - 32)); never subnormal: multiples of 2^-24 or zero. */
static inline void kq_f32(int fmt, const uint8_t *w, const uint8_t *s, int c, const float *scale,
                          const float *offset, __m512 *lo, __m512 *hi) {
    const __m256i nibble = _mm256_set1_epi8(0xF);
    __m256i code;
    if (fmt == FMT_Q6_K) { /* values 128 h + 32 j + l */
        const int h = c >> 2, j = c & 3;
        const __m256i low = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (j & 1)));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(s + 32 * h));
        code = _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (j >> 1))), nibble);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * j)),
                                             _mm256_set1_epi8(3));
        code = _mm256_or_si256(code, _mm256_slli_epi16(top, 4));
        const __m512i bias = _mm512_set1_epi32(32);
        *lo = _mm512_mul_ps(_mm512_set1_ps(scale[2 * c]),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(
                                _mm512_cvtepu8_epi32(_mm256_castsi256_si128(code)), bias)));
        *hi = _mm512_mul_ps(_mm512_set1_ps(scale[2 * c + 1]),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(
                                _mm512_cvtepu8_epi32(_mm256_extracti128_si256(code, 1)), bias)));
        return;
    }
    const int g = c >> 1, half = c & 1; /* values 64 g + 32 half + l */
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 32 * g));
    code = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(4 * half)), nibble);
    if (fmt == FMT_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(s + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(c)),
                                             _mm256_set1_epi8(1));
        code = _mm256_or_si256(code, _mm256_slli_epi16(bit, 4));
    }
    const __m512 vs = _mm512_set1_ps(scale[c]), vo = _mm512_set1_ps(offset[c]);
    *lo = _mm512_fmsub_ps(
        vs, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(code))), vo);
    *hi = _mm512_fmsub_ps(
        vs, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(code, 1))), vo);
}


/* An mxfp4 block (16 bytes) -> 32 bf16 values: one 32-bit lane per byte, whose low word indexes
 * the low nibble's value (by 5 bits: the table holds the 16 twice) and high word the high
 * nibble's. */
#if defined(__AVX512VBMI__) && !defined(NO_NIBBLE_SPREAD)
/* With VBMI, a byte permute puts each byte in both words of its lane and one variable shift
 * (0 for the low word, 4 for the high) brings the high nibble down: three instructions where
 * the zero-extension, shift and or take four (the decoding is what bounds these formats). */
static inline __m512i nibble_index(__m128i bytes) {
    const __m512i spread = _mm512_permutexvar_epi8(
        _mm512_set_epi8(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12, 11, 11,
                        11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5,
                        5, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
        _mm512_castsi128_si512(bytes));
    return _mm512_srlv_epi16(spread, _mm512_set1_epi32(0x00040000));
}
#else
static inline __m512i nibble_index(__m128i bytes) {
    const __m512i d = _mm512_cvtepu8_epi32(bytes);
    return _mm512_or_si512(d, _mm512_slli_epi32(d, 12));
}
#endif

static inline __m512i mx_bf16(const uint8_t *w, uint8_t s) {
    const __m512i index = nibble_index(_mm_loadu_si128((const __m128i *)w));
    return _mm512_permutexvar_epi16(index, _mm512_load_si512(MX_BF16[s]));
}

/* 16 bytes of fp4 codes looked up in `table` (the 16 codes' values), in pairs: e holds values
 * 2j (the low nibbles'), o values 2j + 1 (the high ones'). */
static inline void fp4_pairs(const uint8_t *w, __m512 table, __m512 *e, __m512 *o) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
    *e = _mm512_permutexvar_ps(d, table); /* (by 4 bits of the index) */
    *o = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
}

/* Pairs (e, o) -> values in order (lo: the first 16). */
static inline void interleave(__m512 e, __m512 o, __m512 *lo, __m512 *hi) {
    *lo = _mm512_permutex2var_ps(e, _mm512_loadu_si512(INTERLEAVE), o);
    *hi = _mm512_permutex2var_ps(e, _mm512_loadu_si512(INTERLEAVE + 16), o);
}

/* An mxfp4 block -> 32 fp32 values (lo: the first 16). */
static inline void mx_f32(const uint8_t *w, uint8_t s, __m512 *lo, __m512 *hi) {
    __m512 e, o;
    fp4_pairs(w, _mm512_load_ps(MX_F32[s]), &e, &o);
    interleave(e, o, lo, hi);
}

/* nvfp4: two blocks at a time (16 bytes: 32 values), their two tables in one lookup (the fifth
 * index bit picks the block). */
static inline void nv_tables(const uint8_t *s, int two, float g, __m512 *ta, __m512 *tb) {
    const __m512 values = _mm512_load_ps(E2M1), vg = _mm512_set1_ps(g);
    *ta = _mm512_mul_ps(_mm512_mul_ps(values, _mm512_set1_ps(E4M3[s[0]])), vg);
    *tb = two ? _mm512_mul_ps(_mm512_mul_ps(values, _mm512_set1_ps(E4M3[s[1]])), vg) : *ta;
}

/* nvfp4 in bf16: the 16 codes' values for each of the 256 e4m3 scales, for one per-row scale g
 * (a checkpoint's g is its tensor's: every row of a projection shares it), built once and kept
 * in a few per-thread entries, so a block's decoding is a lookup as mxfp4's is, where computing
 * its table (two products and a rounding per 16 values) halved the kernel's speed. Two parts,
 * each built when first asked for: the bf16 words (the word route and the decoders; each scale's
 * row is the 16 values twice, 64 bytes, one cache line: a block's table is one aligned load,
 * where 32-byte rows made every other 64-byte load straddle two lines) and their fp32 values
 * (the block route, which reads nothing else). A job's items switch between the experts'
 * projections, each with its own g, so entries are many (16: 512 KiB a thread, of which the
 * rows its scales use are read) and the least recently used goes. */
enum { NV_WORDS = 1, NV_FLOATS = 2 };
typedef struct {
    uint16_t t[256][32] __attribute__((aligned(64)));
    float f[256][16] __attribute__((aligned(64)));
    uint32_t key;
    unsigned built; /* NV_WORDS | NV_FLOATS: the parts made for key (0: the entry is free) */
} nv_table_t;
#define NV_TABLES 16
static _Thread_local nv_table_t nv_cache[NV_TABLES];
/* The entries from the most recently used to the least: a row pair's two tables (a gate row's
 * and its up row's) are found in the first two places, a compare each, where a scan of every
 * entry for the oldest cost 14-18 TSC ticks a lookup (6% of a row pair's time at 2880 wide). */
static _Thread_local uint8_t nv_order[NV_TABLES];
static _Thread_local int nv_ordered;
typedef const uint16_t (*nv_rows_t)[32];

/* The scales from 0x80 are the first 128 negated, and so are their rows, bit for bit (each
 * product and rounding is symmetric in sign; a NaN stays a NaN): computed once, stored twice. */
static void nv_build(nv_table_t *e, float g, unsigned part) {
    const __m512 values = _mm512_load_ps(E2M1), vg = _mm512_set1_ps(g);
    const __m512i sign32 = _mm512_set1_epi32((int)0x80000000u), sign16 = _mm512_set1_epi16(-32768);
    for (int sc = 0; sc < 128; sc += 2) { /* (e2m1 * e4m3) * g, as the definition orders it */
        const __m512 a = _mm512_mul_ps(_mm512_mul_ps(values, _mm512_set1_ps(E4M3[sc])), vg);
        const __m512 b = _mm512_mul_ps(_mm512_mul_ps(values, _mm512_set1_ps(E4M3[sc + 1])), vg);
        const __m512i ab = bf16_rne32(a, b, 1); /* (subnormals checked) sc's 16, sc + 1's 16 */
        if (part == NV_FLOATS) {
            const __m512i fa =
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(ab)), 16);
            const __m512i fb =
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(ab, 1)), 16);
            _mm512_store_si512(e->f[sc], fa);
            _mm512_store_si512(e->f[sc + 1], fb);
            _mm512_store_si512(e->f[sc + 128], _mm512_xor_si512(fa, sign32));
            _mm512_store_si512(e->f[sc + 129], _mm512_xor_si512(fb, sign32));
        } else {
            const __m512i ta = _mm512_shuffle_i64x2(ab, ab, 0x44); /* lo, lo */
            const __m512i tb = _mm512_shuffle_i64x2(ab, ab, 0xEE); /* hi, hi */
            _mm512_store_si512(e->t[sc], ta);
            _mm512_store_si512(e->t[sc + 1], tb);
            _mm512_store_si512(e->t[sc + 128], _mm512_xor_si512(ta, sign16));
            _mm512_store_si512(e->t[sc + 129], _mm512_xor_si512(tb, sign16));
        }
    }
    e->built |= part;
}

/* g's table with `part` (NV_WORDS or NV_FLOATS) built. */
static const nv_table_t *nv_table(float g, unsigned part) {
    uint32_t key;
    memcpy(&key, &g, 4);
    nv_table_t *const cache = nv_cache;
    uint8_t *const order = nv_order;
    int at = 0;
    while (at < NV_TABLES && !(cache[order[at]].built && cache[order[at]].key == key)) at++;
    if (at == NV_TABLES) { /* not there: the least recently used entry takes it */
        if (!nv_ordered) { /* (a thread's first lookup: its order, a permutation) */
            for (int i = 0; i < NV_TABLES; i++) order[i] = (uint8_t)i;
            nv_ordered = 1;
        }
        at = NV_TABLES - 1;
        cache[order[at]].key = key;
        cache[order[at]].built = 0;
    }
    const uint8_t index = order[at];
    for (; at > 0; at--) order[at] = order[at - 1]; /* (to the front) */
    order[0] = index;
    nv_table_t *e = &cache[index];
    if (!(e->built & part)) nv_build(e, g, part);
    return e;
}

/* Two blocks at a time (16 bytes: 32 values) of scales sa and sb, their tables as the two
 * sources of one permute (the sixth index bit picks the second; with rows of 32 the fifth bit
 * is free, as both halves of a row are the same); `two` 0: one block, in the first 16 lanes. */
static inline __m512i nv_bf16(const uint8_t *w, unsigned sa, unsigned sb, int two,
                              nv_rows_t t) {
    const __m128i bytes = two ? _mm_loadu_si128((const __m128i *)w)
                              : _mm_loadl_epi64((const __m128i *)w);
    const __m512i index =
        _mm512_ternarylogic_epi32(nibble_index(bytes), _mm512_set1_epi32(0x000f000f),
                                  _mm512_maskz_set1_epi32(0xff00, 0x00200020), 0xEA);
    return _mm512_permutex2var_epi16(_mm512_loadu_si512(t[sa]), index,
                                     _mm512_loadu_si512(t[two ? sb : sa]));
}

/* Two nvfp4 blocks (16 bytes; `two` 0: the first 8) -> 32 fp32 values (lo: the first 16): looked
 * up in pairs as fp4_pairs does, in the blocks' tables (the fifth index bit picks the second
 * block's for its lanes). */
static inline void nv_f32(const uint8_t *w, const uint8_t *s, int two, float g, __m512 *lo,
                          __m512 *hi) {
    __m512 ta, tb;
    nv_tables(s, two, g, &ta, &tb);
    const __m128i bytes = two ? _mm_loadu_si128((const __m128i *)w)
                              : _mm_loadl_epi64((const __m128i *)w);
    const __m512i d = _mm512_cvtepu8_epi32(bytes);
    const __m512i second = _mm512_maskz_set1_epi32(0xff00, 16);
    const __m512 e = _mm512_permutex2var_ps(
        ta, _mm512_ternarylogic_epi32(d, _mm512_set1_epi32(15), second, 0xEA), tb);
    const __m512 o =
        _mm512_permutex2var_ps(ta, _mm512_or_si512(_mm512_srli_epi32(d, 4), second), tb);
    interleave(e, o, lo, hi);
}

/* The pairs route of mxfp4 in bf16 models (qdot_bf16): 32 values as two fp32
 * vectors, e holding values 2j (the low nibbles') and o values 2j + 1 (the high ones'), looked
 * up in fp32 copies of the bf16 tables. Two permutes of 16 fp32 lanes by the zero-extended
 * bytes take the place of the word route's byte spread, shift and word permute (whose
 * two-table form is two shuffle uops): 15-17% less time a value on a Sapphire Rapids core. */
static inline void mx_pairs(const uint8_t *w, uint8_t s, __m512 *e, __m512 *o) {
    fp4_pairs(w, _mm512_load_ps(MX_BF16_F32[s]), e, o);
}

/* The block route of nvfp4 in bf16 models (qdot_bf16): one block (8 bytes: 16 values) in its
 * own table (t: its scale's row of the fp32 tables) by one 16-lane permute, where the pairs route
 * would mix two blocks in each vector and pay a two-table permute and two ors for the fifth
 * index bit. The 8 bytes are broadcast (a load, no shuffle) and lane j shifted to its code:
 * lane j holds value 8 (j % 2) + j / 2 of the block (BLOCK_LANES), the order split_blocks gives
 * x. 13-15% less time a value than the pairs route on a Sapphire Rapids core; its sums are in
 * another order than AVX512-BF16's pair products (within fp32 rounding of them, not bit for
 * bit), which is why mxfp4, whose 32-value block fills a vector, keeps the pairs route. */
static inline __m512 nv_block(const uint8_t *w, const float *t) {
    int64_t codes;
    memcpy(&codes, w, 8);
    const __m512i shifts =
        _mm512_set_epi32(28, 28, 24, 24, 20, 20, 16, 16, 12, 12, 8, 8, 4, 4, 0, 0);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(codes), shifts),
                                 _mm512_load_ps(t));
}

#if defined(__AVX512VBMI__)
/* fp8 in bf16 by tables: a block's values bf16(e4m3 * s) for the 128 magnitudes (rounded as the
 * definition rounds), kept as two byte planes (the low and the high bytes), so that 64 codes
 * decode in one byte permute of the codes, two table permutes (VBMI's take 7 index bits: the 128
 * magnitudes) and the sign xored in (exact: the products are sign-symmetric), where the f16
 * route takes about 14 instructions for 32 values. A row's tables are its scale row's, which the
 * rows of a 128-row block share: a few rows' are kept per thread, found by comparing the scales
 * themselves (so banks refilled in place cannot be read with stale tables). */
#define FP8_TABLES 1
typedef struct {
    __m512i lo[2], hi[2]; /* magnitudes 0-63, 64-127 */
} fp8_table_t;
#define FP8_TABLE_BLOCKS 64 /* column blocks of a row: K up to 64 * bk */
#define FP8_TABLE_ROWS 4    /* scale rows kept (a gate item alternates two: gate's and up's) */
typedef struct {
    fp8_table_t t[FP8_TABLE_BLOCKS];
    float scales[FP8_TABLE_BLOCKS];
    int64_t blocks;
} fp8_row_tables_t;
static _Thread_local fp8_row_tables_t fp8_rows[FP8_TABLE_ROWS];
static _Thread_local unsigned fp8_next;

/* Byte i of the codes as the table permutes take them: after them, unpacking the low and the
 * high planes' bytes (within 128-bit lanes) gives values 0-31 and 32-63 in order. */
static const uint8_t FP8_ORDER[64] __attribute__((aligned(64))) = {
    0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39,
    8,  9,  10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
    16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
    24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63,
};

static void fp8_table(float s, fp8_table_t *t) {
    const __m512 vs = _mm512_set1_ps(s);
    for (int half = 0; half < 2; half++) {
        __m512i words[2];
        for (int i = 0; i < 2; i++) {
            const float *e = E4M3 + 64 * half + 32 * i;
            words[i] = bf16_rne32(_mm512_mul_ps(_mm512_loadu_ps(e), vs),
                                  _mm512_mul_ps(_mm512_loadu_ps(e + 16), vs), 1);
        }
        t->lo[half] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(words[0])),
                                         _mm512_cvtepi16_epi8(words[1]), 1);
        t->hi[half] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(words[0], 8))),
            _mm512_cvtepi16_epi8(_mm512_srli_epi16(words[1], 8)), 1);
    }
}

/* The tables of a row whose block scales are scales[0, blocks); NULL past FP8_TABLE_BLOCKS. */
static const fp8_table_t *fp8_row_tables(const float *scales, int64_t blocks) {
    if (blocks > FP8_TABLE_BLOCKS) return NULL;
    const size_t bytes = (size_t)blocks * sizeof(float);
    for (int i = 0; i < FP8_TABLE_ROWS; i++)
        if (fp8_rows[i].blocks == blocks && !memcmp(fp8_rows[i].scales, scales, bytes))
            return fp8_rows[i].t;
    fp8_row_tables_t *e = &fp8_rows[fp8_next++ % FP8_TABLE_ROWS];
    for (int64_t b = 0; b < blocks; b++) /* (an unused entry's tables are built: blocks is 0) */
        if (b >= e->blocks || memcmp(&e->scales[b], &scales[b], sizeof(float))) {
            fp8_table(scales[b], &e->t[b]);
            e->scales[b] = scales[b];
        }
    e->blocks = blocks;
    return e->t;
}

/* 64 fp8 codes -> 64 bf16 values (w0: the first 32). */
static inline void fp8_bf16_64(const uint8_t *c, const fp8_table_t *t, __m512i *w0, __m512i *w1) {
    const __m512i p = _mm512_permutexvar_epi8(_mm512_load_si512(FP8_ORDER), _mm512_loadu_si512(c));
    const __m512i lo = _mm512_permutex2var_epi8(t->lo[0], p, t->lo[1]);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi[0], p, t->hi[1]),
                                                 p, _mm512_set1_epi8((char)0x80), 0x78);
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}
#endif

static void mxfp4_blocks(const uint8_t *w, const uint8_t *s, int64_t blocks, int bf16,
                         void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        PREFETCH(w + 16 * b + PREFETCH_BYTES);
        PREFETCH(s + b + PREFETCH_BYTES / 16);
        if (bf16) {
            _mm512_storeu_si512((uint16_t *)out + 32 * b, mx_bf16(w + 16 * b, s[b]));
        } else {
            __m512 lo, hi;
            mx_f32(w + 16 * b, s[b], &lo, &hi);
            _mm512_storeu_ps((float *)out + 32 * b, lo);
            _mm512_storeu_ps((float *)out + 32 * b + 16, hi);
        }
    }
}

static void nvfp4_blocks(const uint8_t *w, const uint8_t *s, int64_t blocks, float g, int bf16,
                         void *out) {
    const nv_rows_t table = bf16 ? nv_table(g, NV_WORDS)->t : NULL;
    for (int64_t b = 0; b < blocks; b += 2) {
        const int two = b + 1 < blocks;
        PREFETCH(w + 8 * b + PREFETCH_BYTES);
        PREFETCH(s + b + PREFETCH_BYTES / 8);
        if (bf16) {
            _mm512_mask_storeu_epi16((uint16_t *)out + 16 * b, two ? 0xffffffffu : 0xffffu,
                                     nv_bf16(w + 8 * b, s[b], two ? s[b + 1] : 0, two, table));
        } else {
            __m512 lo, hi;
            nv_f32(w + 8 * b, s + b, two, g, &lo, &hi);
            _mm512_storeu_ps((float *)out + 16 * b, lo);
            if (two) _mm512_storeu_ps((float *)out + 16 * b + 16, hi);
        }
    }
}

static void q8_0_blocks(const uint8_t *w, const uint16_t *s, int64_t blocks, int bf16,
                        void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        PREFETCH(w + 32 * b + PREFETCH_BYTES);
        PREFETCH(s + b + PREFETCH_BYTES / 32); /* (as far ahead: 2 scale bytes a 32 codes) */
        const float scale = _cvtsh_ss(s[b]);
        if (bf16) {
            _mm512_storeu_si512((uint16_t *)out + 32 * b, q8_bf16(w + 32 * b, scale));
        } else {
            __m512 lo, hi;
            q8_f32(w + 32 * b, scale, &lo, &hi);
            _mm512_storeu_ps((float *)out + 32 * b, lo);
            _mm512_storeu_ps((float *)out + 32 * b + 16, hi);
        }
    }
}

static void legacy_blocks(int fmt, int64_t rest, const uint8_t *w, const uint8_t *s,
                          int64_t blocks, int bf16, void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        PREFETCH(w + 16 * b + PREFETCH_BYTES);
        PREFETCH(s + rest * b + PREFETCH_BYTES / 2); /* (its other bytes: up to half its codes') */
        if (bf16) {
            _mm512_storeu_si512((uint16_t *)out + 32 * b,
                                legacy_bf16(fmt, w + 16 * b, s + rest * b));
        } else {
            __m512 lo, hi;
            legacy_f32(fmt, w + 16 * b, s + rest * b, &lo, &hi);
            _mm512_storeu_ps((float *)out + 32 * b, lo);
            _mm512_storeu_ps((float *)out + 32 * b + 16, hi);
        }
    }
}

#elif FT_AVX2
/* 8 floats -> bf16 bits (to nearest even, subnormals kept, NaN quiet). */
static inline __m128i bf16_rne8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    /* [r0..3 r0..3 | r4..7 r4..7] -> r0..7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

static inline void emit8(void *out, int64_t k, __m256 v, int bf16) {
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + k), bf16_rne8(v));
    else
        _mm256_storeu_ps((float *)out + k, v);
}

static void fp8_span(const uint8_t *c, int64_t n, float s, int bf16, void *out) {
    float mul;
    const int folded = fp8_fold(s, &mul);
    const __m256 vs = _mm256_set1_ps(mul), v256 = _mm256_set1_ps(256.0f);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        PREFETCH(c + k + PREFETCH_BYTES);
        const __m128i b = _mm_loadu_si128((const __m128i *)(c + k));
        const __m128i m7 = _mm_set1_epi8(0x7f);
        if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(b, m7), m7))) {
            fp8_span_scalar(c + k, 16, s, bf16, at(out, k, bf16));
            continue;
        }
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                           _mm256_set1_epi16((short)0xBF80));
        __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        if (!folded) {
            lo = _mm256_mul_ps(lo, v256);
            hi = _mm256_mul_ps(hi, v256);
        }
        emit8(out, k, _mm256_mul_ps(lo, vs), bf16);
        emit8(out, k + 8, _mm256_mul_ps(hi, vs), bf16);
    }
    fp8_span_scalar(c + k, n - k, s, bf16, at(out, k, bf16));
}

/* 8 bytes of codes against a table of the 8 magnitudes: 16 values in order, each code's sign
 * bit xored in (exact: the products are sign-symmetric). */
static inline void fp4_16(const uint8_t *w, __m256 mag, int64_t k, int bf16, void *out) {
    const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)w));
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    __m256 lo = _mm256_permutevar8x32_ps(mag, d); /* (by 3 bits of the index) */
    __m256 hi = _mm256_permutevar8x32_ps(mag, _mm256_srli_epi32(d, 4));
    lo = _mm256_xor_ps(lo, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
    hi = _mm256_xor_ps(hi, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 24), sign)));
    const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);
    emit8(out, k, _mm256_permute2f128_ps(a, b, 0x20), bf16);
    emit8(out, k + 8, _mm256_permute2f128_ps(a, b, 0x31), bf16);
}

static void mxfp4_blocks(const uint8_t *w, const uint8_t *s, int64_t blocks, int bf16,
                         void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        PREFETCH(w + 16 * b + PREFETCH_BYTES);
        PREFETCH(s + b + PREFETCH_BYTES / 16);
        const __m256 mag = _mm256_load_ps(MX_F32[s[b]]);
        fp4_16(w + 16 * b, mag, 32 * b, bf16, out);
        fp4_16(w + 16 * b + 8, mag, 32 * b + 16, bf16, out);
    }
}

static void nvfp4_blocks(const uint8_t *w, const uint8_t *s, int64_t blocks, float g, int bf16,
                         void *out) {
    const __m256 values = _mm256_load_ps(E2M1), vg = _mm256_set1_ps(g);
    for (int64_t b = 0; b < blocks; b++) {
        PREFETCH(w + 8 * b + PREFETCH_BYTES);
        PREFETCH(s + b + PREFETCH_BYTES / 8);
        const __m256 mag = _mm256_mul_ps(_mm256_mul_ps(values, _mm256_set1_ps(E4M3[s[b]])), vg);
        fp4_16(w + 8 * b, mag, 16 * b, bf16, out);
    }
}

static void q8_0_blocks(const uint8_t *w, const uint16_t *s, int64_t blocks, int bf16,
                        void *out) {
    for (int64_t b = 0; b < blocks; b++) {
        PREFETCH(w + 32 * b + PREFETCH_BYTES);
        const __m256 vs = _mm256_set1_ps(_cvtsh_ss(s[b]));
        for (int64_t j = 0; j < 32; j += 8) {
            const __m128i codes = _mm_loadl_epi64((const __m128i *)(w + 32 * b + j));
            const __m256i d = _mm256_cvtepi8_epi32(codes);
            emit8(out, 32 * b + j, _mm256_mul_ps(_mm256_cvtepi32_ps(d), vs), bf16);
        }
    }
}

/* Legacy blocks 8 values at a time: value 16 half + 8 e + i from nibble `half` of code byte
 * 8 e + i, its fifth bit from bit 16 half + 8 e + i of qh. */
static void legacy_blocks(int fmt, int64_t rest, const uint8_t *w, const uint8_t *s,
                          int64_t blocks, int bf16, void *out) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    for (int64_t b = 0; b < blocks; b++) {
        PREFETCH(w + 16 * b + PREFETCH_BYTES);
        const legacy_t p = legacy_block(fmt, s + rest * b);
        const __m256 d = _mm256_set1_ps(p.d), m = _mm256_set1_ps(p.m);
        const __m256i bias = _mm256_set1_epi32(p.bias);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + 16 * b));
        for (int half = 0; half < 2; half++) {
            const __m128i nibbles = _mm_and_si128(half ? _mm_srli_epi16(bytes, 4) : bytes,
                                                  _mm_set1_epi8(15));
            for (int e = 0; e < 2; e++) {
                __m256i c = _mm256_cvtepu8_epi32(e ? _mm_srli_si128(nibbles, 8) : nibbles);
                const int at = 16 * half + 8 * e;
                if (p.qh) {
                    const __m256i bits = _mm256_set1_epi32((int)((p.qh >> at) & 0xff));
                    c = _mm256_or_si256(
                        c, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(bits, lanes), one),
                                             4));
                }
                /* (d * q exact: the product rounds nothing, so mul then add is the FMA's) */
                const __m256 v =
                    p.has_min ? _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(c)), m)
                              : _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(c, bias)));
                emit8(out, 32 * b + at, v, bf16);
            }
        }
    }
}

#else
#define fp8_span fp8_span_scalar
#define mxfp4_blocks mxfp4_blocks_scalar
#define nvfp4_blocks nvfp4_blocks_scalar
#define q8_0_blocks q8_0_blocks_scalar
#define legacy_blocks legacy_blocks_scalar
#endif

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

/* Values [k0, k1) of a quantized row into out (value k0 first), in the model's dtype. mxfp4,
 * nvfp4, q8_0, the K-quants and the legacy types take whole blocks (k0 and k1 multiples of 32,
 * 16, 32, 256, 32). */
static void decode_range(const qrow_t *q, int64_t k0, int64_t k1, int bf16, void *out) {
    if (q->fmt == FMT_FP8) {
#if FP8_TABLES
        const fp8_table_t *t = bf16 ? fp8_row_tables(q->s32, (k1 + q->bk - 1) / q->bk) : NULL;
#endif
        for (int64_t b = k0 / q->bk; b * q->bk < k1; b++) {
            int64_t lo = b * q->bk > k0 ? b * q->bk : k0;
            const int64_t hi = (b + 1) * q->bk < k1 ? (b + 1) * q->bk : k1;
#if FP8_TABLES
            for (; t && lo + 64 <= hi; lo += 64) {
                __m512i w0, w1;
                PREFETCH(q->w + lo + PREFETCH_BYTES);
                fp8_bf16_64(q->w + lo, t + b, &w0, &w1);
                _mm512_storeu_si512((uint16_t *)out + (lo - k0), w0);
                _mm512_storeu_si512((uint16_t *)out + (lo - k0) + 32, w1);
            }
#endif
            fp8_span(q->w + lo, hi - lo, q->s32[b], bf16, at(out, lo - k0, bf16));
        }
    } else if (q->fmt == FMT_MXFP4) {
        mxfp4_blocks(q->w + k0 / 2, q->s8 + k0 / 32, (k1 - k0) / 32, bf16, out);
    } else if (q->fmt == FMT_Q8_0) {
        q8_0_blocks(q->w + k0, q->s16 + k0 / 32, (k1 - k0) / 32, bf16, out);
    } else if (is_k_quant(q->fmt)) {
        k_quant_blocks(q->fmt, q->rest, q->w + k0 / 2, q->s8 + k0 / 256 * q->rest,
                       (k1 - k0) / 256, bf16, out);
    } else if (is_legacy(q->fmt)) {
        legacy_blocks(q->fmt, q->rest, q->w + k0 / 2, q->s8 + k0 / 32 * q->rest, (k1 - k0) / 32,
                      bf16, out);
    } else { /* FMT_NVFP4 */
        nvfp4_blocks(q->w + k0 / 2, q->s8 + k0 / 16, (k1 - k0) / 16, q->g, bf16, out);
    }
}

/* Decoded in registers into the dot products: AVX-512 (and its BF16 instructions for bf16
 * models, whose dot product uses them). fp8 rows whose blocks a step would straddle do not. */
#if FT_AVX512 && defined(__AVX512BF16__)
#define QDOT_BF16 1
#endif
#if FT_AVX512
#define QDOT_F32 1
#endif

static inline int qdot_takes(const qrow_t *q, int bf16) {
#if QDOT_BF16
    if (bf16) return q->fmt != FMT_FP8 || q->bk % 128 == 0;
#endif
#if QDOT_F32
    if (!bf16) return q->fmt != FMT_FP8 || q->bk % 64 == 0;
#endif
    (void)q;
    (void)bf16;
    return 0;
}

/* Whether qdot_bf16 reads x split for the row's format (mxfp4: the pairs route, nvfp4: the block
 * route; so its caller splits x by split_x); -DNO_SPLIT builds the word route alone (for
 * measurements). */
static inline int qdot_split(int fmt, int bf16) {
#if QDOT_BF16 && !defined(NO_SPLIT)
    return bf16 && (fmt == FMT_MXFP4 || fmt == FMT_NVFP4);
#else
    (void)fmt;
    (void)bf16;
    return 0;
#endif
}

#if QDOT_BF16
/* x [K] (bf16) as the pairs route reads it: each whole 32 values as their 16 even values, then
 * their 16 odd ones, in fp32 (exact). */
static void split_pairs(const uint16_t *x, int64_t K, float *xs) {
    for (int64_t k = 0; k + 32 <= K; k += 32) {
        const __m512i v = _mm512_loadu_si512(x + k);
        _mm512_storeu_si512(xs + k, _mm512_slli_epi32(v, 16));
        _mm512_storeu_si512(xs + k + 16, _mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    }
}

/* Lane j of nv_block's vector: value 8 (j % 2) + j / 2 of its block. */
static const int32_t BLOCK_LANES[16] __attribute__((aligned(64))) = {0, 8,  1, 9,  2, 10, 3, 11,
                                                                     4, 12, 5, 13, 6, 14, 7, 15};

/* x [K] (bf16) as the block route reads it: each whole 16 values in fp32 (exact), in
 * BLOCK_LANES order. */
static void split_blocks(const uint16_t *x, int64_t K, float *xs) {
    const __m512i lanes = _mm512_load_si512(BLOCK_LANES);
    for (int64_t k = 0; k + 16 <= K; k += 16) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + k)));
        _mm512_storeu_ps(xs + k, _mm512_permutexvar_ps(lanes, _mm512_castsi512_ps(
                                                                  _mm512_slli_epi32(v, 16))));
    }
}

/* x split as qdot_bf16 reads it for rows of format fmt (where qdot_split says so). */
static void split_x(int fmt, const uint16_t *x, int64_t K, float *xs) {
    if (fmt == FMT_NVFP4)
        split_blocks(x, K, xs);
    else
        split_pairs(x, K, xs);
}

/* nvfp4's block route (nv_block) of row a, and of row b beside it where b is not NULL (a gate
 * row and its up row, two down rows: one x), into out[0] (and out[1]): 128 values a step, each
 * block into one of four accumulators a row, the blocks past the last whole step into the first.
 * Each row's sum is the same, bit for bit, alone or beside another; beside one, x is loaded once
 * for both, and a step's eight scales come in one load: the loads, not the arithmetic, bound a
 * row alone (two rows: 12% less time a value on a Sapphire Rapids core, the scales' one load 4%).
 * K: whole blocks, x split by split_blocks. */
static inline __attribute__((always_inline)) void nv_block_dots(const qrow_t *a, const qrow_t *b,
                                                                int64_t K, const float *xs,
                                                                float *out) {
    const char *ta = (const char *)nv_table(a->g, NV_FLOATS)->f;
    const char *tb = b ? (const char *)nv_table(b->g, NV_FLOATS)->f : ta;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    /* (scale i of a step's eight, times 64 bytes: its row of the table) */
#define NV_ROW(t, s8, i)                                                                        \
    ((const float *)((t) + (((i) ? (s8) >> (8 * (i) - 6) : (s8) << 6) & 0x3fc0)))
#define BLOCK_STEP(acc_a, acc_b, i)                                                             \
    do {                                                                                        \
        const __m512 xv = _mm512_loadu_ps(xs + k + 16 * (i));                                   \
        acc_a = _mm512_fmadd_ps(nv_block(wa + 8 * (i), NV_ROW(ta, sa, i)), xv, acc_a);          \
        if (b) acc_b = _mm512_fmadd_ps(nv_block(wb + 8 * (i), NV_ROW(tb, sb, i)), xv, acc_b);   \
    } while (0)
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        const uint8_t *wa = a->w + k / 2, *wb = b ? b->w + k / 2 : wa;
        uint64_t sa, sb = 0;
        memcpy(&sa, a->s8 + k / 16, 8);
        PREFETCH(wa + PREFETCH_BYTES);
        PREFETCH(a->s8 + k / 16 + PREFETCH_BYTES / 8);
        if (b) {
            memcpy(&sb, b->s8 + k / 16, 8);
            PREFETCH(wb + PREFETCH_BYTES);
            PREFETCH(b->s8 + k / 16 + PREFETCH_BYTES / 8);
        }
        BLOCK_STEP(a0, b0, 0);
        BLOCK_STEP(a1, b1, 1);
        BLOCK_STEP(a2, b2, 2);
        BLOCK_STEP(a3, b3, 3);
        BLOCK_STEP(a0, b0, 4);
        BLOCK_STEP(a1, b1, 5);
        BLOCK_STEP(a2, b2, 6);
        BLOCK_STEP(a3, b3, 7);
    }
#undef BLOCK_STEP
#undef NV_ROW
    for (; k + 16 <= K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(xs + k);
        const float *row_a = (const float *)ta + 16 * a->s8[k / 16];
        a0 = _mm512_fmadd_ps(nv_block(a->w + k / 2, row_a), xv, a0);
        if (b) {
            const float *row_b = (const float *)tb + 16 * b->s8[k / 16];
            b0 = _mm512_fmadd_ps(nv_block(b->w + k / 2, row_b), xv, b0);
        }
    }
    out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    if (b)
        out[1] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3)));
}

/* ---- scaled codes: GGUF's block formats in bf16 jobs ----------------------------------------
 *
 * A legacy or K-quant value is a small integer code times its block's scale, plus its block's
 * minimum where the format has one: d (q - bias), d q + m, d sc q - dmin m, d sc (q - 32). A bf16
 * job takes each block as those codes, exact in bf16 (at most six bits), multiplied with x by
 * AVX512-BF16's pair dot product (each product exact in fp32), then scales the block's 16 lane
 * sums by its scale in fp32, and adds its minimum times the block's sum of x (the same
 * instruction against ones): the file's values, as an fp32 model computes them, not their
 * bf16 roundings (those are what a dequantized bf16 layer holds: prefill's GEMMs, the GPU's
 * tiles; the two differ by a bf16 rounding of the weights). Rounding each value first, as the
 * other formats do, cost ~14 vector instructions per 32 values against ~8 here: the 0.5B
 * Qwen's Q5_0 rows went from 21.6 to 34.6 G values/s on one Zen 5 core.
 *
 * A row read by one route is decoded in registers (scaled_dot); one read by several is decoded
 * once into the thread's buffer as its codes and each block's multipliers (scaled_decode), then
 * dotted with each route (scaled_buffer_dot) by the same instructions in the same order: the
 * two ways are equal bit for bit. Blocks go into four accumulators by their index mod 4, as
 * the dense dot product's steps do. */
static inline int scaled_format(int fmt) { return is_legacy(fmt) || is_k_quant(fmt); }

/* Whether the format's values add a minimum (q4_1, q5_1, q4_k, q5_k). */
static inline int scaled_has_min(int fmt) {
    return fmt == FMT_Q4_1 || fmt == FMT_Q5_1 || fmt == FMT_Q4_K || fmt == FMT_Q5_K;
}

/* One block of 32 values into acc: its codes' dot products with x [32] scaled by sv (per lane:
 * q6_k's two sub-blocks of 16 have a scale each), plus mn times the sum of x where has_min. */
static inline __attribute__((always_inline)) __m512 scaled_block(__m512 acc, __m512i codes, __m512 sv, float mn, int has_min,
                                  const uint16_t *x) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x);
    acc = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)codes, xv), sv, acc);
    if (has_min) {
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
        acc = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), ones, xv),
                              _mm512_set1_ps(mn), acc);
    }
    return acc;
}

/* q6_k's scale vector: lanes 0-7 (values 0-15 of the block) a, lanes 8-15 b. */
static inline __m512 scale_pair(float a, float b) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

/* A legacy block's 32 codes (values 0-15: the low nibbles, 16-31: the high ones) as bf16
 * integers, less the format's offset (q4_0 8, q5_0 16). */
static inline __attribute__((always_inline)) __m512i legacy_codes(int fmt, const uint8_t *w, const legacy_t *p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w));
    __m512i c = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(15))),
        _mm256_srli_epi16(b, 4), 1);
    if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1) /* the fifth bits: bit j of qh, lane j's */
        c = _mm512_mask_add_epi16(c, (__mmask32)p->qh, c, _mm512_set1_epi16(16));
    const uint16_t *table = fmt == FMT_Q4_0 ? CODES + 24 : fmt == FMT_Q5_0 ? CODES + 16 : CODES + 32;
    return _mm512_permutexvar_epi16(c, _mm512_loadu_si512(table));
}

/* A K-quant block's values 64 g .. 64 g + 63 (q4_k, q5_k: two sub-blocks of 32, the low and the
 * high nibbles of 32 bytes) as bf16 codes, in lo and hi. */
static inline __attribute__((always_inline)) void kq_codes_pair(int fmt, const uint8_t *w, const uint8_t *s, int g, __m512i *lo,
                                 __m512i *hi) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * g)));
    __m512i c0 = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
    __m512i c1 = _mm512_srli_epi16(bytes, 4);
    if (fmt == FMT_Q5_K) { /* bit 2 g (+ 1) of byte l of qh: value l's fifth bit */
        const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(s + 16)));
        const __m512i one = _mm512_set1_epi16(1);
        c0 = _mm512_or_si512(c0, _mm512_slli_epi16(
                                     _mm512_and_si512(_mm512_srli_epi16(qh, 2 * g), one), 4));
        c1 = _mm512_or_si512(c1, _mm512_slli_epi16(
                                     _mm512_and_si512(_mm512_srli_epi16(qh, 2 * g + 1), one), 4));
    }
    const __m512i table = _mm512_load_si512(CODES + 32);
    *lo = _mm512_permutexvar_epi16(c0, table);
    *hi = _mm512_permutexvar_epi16(c1, table);
}

/* q6_k's values 32 c .. 32 c + 31 (128 h + 32 j + l) as bf16 codes less 32. */
static inline __attribute__((always_inline)) __m512i q6k_codes(const uint8_t *w, const uint8_t *s, int c) {
    const int h = c >> 2, j = c & 3;
    const __m256i low = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (j & 1)));
    const __m256i high = _mm256_loadu_si256((const __m256i *)(s + 32 * h));
    const __m256i nibble = _mm256_set1_epi8(0xF);
    __m256i code = _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (j >> 1))), nibble);
    const __m256i top = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * j)),
                                         _mm256_set1_epi8(3));
    code = _mm256_or_si256(code, _mm256_slli_epi16(top, 4));
    return _mm512_permutex2var_epi16(_mm512_load_si512(CODES), _mm512_cvtepu8_epi16(code),
                                     _mm512_load_si512(CODES + 32));
}

static inline float scaled_sum(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* Rows' dot products with one x (K: whole blocks), decoded in registers: ROWS rows of format
 * fmt into out, each by its own accumulators. Built once per format (scaled_dot), whose
 * constant lets the compiler drop the other formats' branches (a third of a row's time while it
 * tested them). (Two rows at a time, x's loads shared, made the 0.5B Qwen's decode step 20%
 * slower on the 2-core machine: one row it is.) */
static inline __attribute__((always_inline)) void scaled_rows_of(const int fmt, const int ROWS,
                                                                 const qrow_t *const *q, int64_t K,
                                                                 const uint16_t *x, float *out) {
    __m512 acc[2][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    const int has_min = scaled_has_min(fmt);
    if (is_legacy(fmt)) {
        const int64_t rest = q[0]->rest, blocks = K / 32;
        /* (block b into accumulator b % 4, by constant indices: a computed one put them in
         * memory) */
#define LEGACY_BLOCK(i, b)                                                                      \
    for (int r = 0; r < ROWS; r++) {                                                            \
        const legacy_t p = legacy_block(fmt, q[r]->s8 + (b) * rest);                            \
        acc[r][i] = scaled_block(acc[r][i], legacy_codes(fmt, q[r]->w + 16 * (b), &p),          \
                                 _mm512_set1_ps(p.d), p.m, has_min, x + 32 * (b));              \
    }
        int64_t b = 0;
        for (; b + 4 <= blocks; b += 4) {
            for (int r = 0; r < ROWS; r++) {
                PREFETCH(q[r]->w + 16 * b + PREFETCH_BYTES);
                PREFETCH(q[r]->s8 + b * rest + PREFETCH_BYTES / 2);
            }
            LEGACY_BLOCK(0, b)
            LEGACY_BLOCK(1, b + 1)
            LEGACY_BLOCK(2, b + 2)
            LEGACY_BLOCK(3, b + 3)
        }
        if (b < blocks) LEGACY_BLOCK(0, b)
        if (b + 1 < blocks) LEGACY_BLOCK(1, b + 1)
        if (b + 2 < blocks) LEGACY_BLOCK(2, b + 2)
#undef LEGACY_BLOCK
    } else {
        for (int64_t k = 0; k + 256 <= K; k += 256) { /* K-quants: super-blocks of 256 */
            const uint16_t *xk = x + k;
            for (int r = 0; r < ROWS; r++) {
                const uint8_t *w = q[r]->w + k / 2, *s = q[r]->s8 + k / 256 * q[r]->rest;
                PREFETCH(w + PREFETCH_BYTES);
                PREFETCH(w + PREFETCH_BYTES + 64);
                PREFETCH(s + PREFETCH_BYTES / 2);
                float scale[16], offset[8];
                kq_scales(fmt, s, scale, offset);
                if (fmt == FMT_Q6_K) {
                    for (int c = 0; c < 8; c++)
                        acc[r][c & 3] = scaled_block(acc[r][c & 3], q6k_codes(w, s, c),
                                                     scale_pair(scale[2 * c], scale[2 * c + 1]),
                                                     0.0f, 0, xk + 32 * c);
                    continue;
                }
                for (int g = 0; g < 4; g++) {
                    __m512i lo, hi;
                    kq_codes_pair(fmt, w, s, g, &lo, &hi);
                    const int c = 2 * g;
                    acc[r][c & 3] = scaled_block(acc[r][c & 3], lo, _mm512_set1_ps(scale[c]),
                                                 -offset[c], has_min, xk + 32 * c);
                    acc[r][(c + 1) & 3] =
                        scaled_block(acc[r][(c + 1) & 3], hi, _mm512_set1_ps(scale[c + 1]),
                                     -offset[c + 1], has_min, xk + 32 * c + 32);
                }
            }
        }
    }
    for (int r = 0; r < ROWS; r++) out[r] = scaled_sum(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

#define SCALED_FORMATS(ROWS)                                                                    \
    switch (q[0]->fmt) {                                                                        \
    case FMT_Q4_0: scaled_rows_of(FMT_Q4_0, ROWS, q, K, x, out); break;                        \
    case FMT_Q4_1: scaled_rows_of(FMT_Q4_1, ROWS, q, K, x, out); break;                        \
    case FMT_Q5_0: scaled_rows_of(FMT_Q5_0, ROWS, q, K, x, out); break;                        \
    case FMT_Q5_1: scaled_rows_of(FMT_Q5_1, ROWS, q, K, x, out); break;                        \
    case FMT_Q4_K: scaled_rows_of(FMT_Q4_K, ROWS, q, K, x, out); break;                        \
    case FMT_Q5_K: scaled_rows_of(FMT_Q5_K, ROWS, q, K, x, out); break;                        \
    default: scaled_rows_of(FMT_Q6_K, ROWS, q, K, x, out); break;                              \
    }

static float scaled_dot(const qrow_t *row, int64_t K, const uint16_t *x) {
    const qrow_t *const q[1] = {row};
    float out[1];
    SCALED_FORMATS(1)
    return out[0];
}
#undef SCALED_FORMATS

/* The row decoded for scaled_buffer_dot into buf: its codes (K bf16), then for each block of 32
 * its two scales (lanes 0-7's and 8-15's) and its minimum, fp32. Needs 2.375 K bytes. */
static void scaled_decode(const qrow_t *q, int64_t K, void *buf) {
    uint16_t *codes = buf;
    float *m = (float *)(codes + K); /* (K is a multiple of 32: aligned) */
    const int fmt = q->fmt;
    if (is_legacy(fmt)) {
        for (int64_t b = 0; b < K / 32; b++) {
            const legacy_t p = legacy_block(fmt, q->s8 + b * q->rest);
            _mm512_storeu_si512(codes + 32 * b, legacy_codes(fmt, q->w + 16 * b, &p));
            m[3 * b] = m[3 * b + 1] = p.d;
            m[3 * b + 2] = p.m;
        }
        return;
    }
    for (int64_t k = 0; k + 256 <= K; k += 256) {
        const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 256 * q->rest;
        float scale[16], offset[8];
        kq_scales(fmt, s, scale, offset);
        float *mb = m + 3 * (k / 32);
        for (int c = 0; c < 8; c++) {
            if (fmt == FMT_Q6_K) {
                _mm512_storeu_si512(codes + k + 32 * c, q6k_codes(w, s, c));
                mb[3 * c] = scale[2 * c];
                mb[3 * c + 1] = scale[2 * c + 1];
                mb[3 * c + 2] = 0.0f;
            } else if (c % 2 == 0) {
                __m512i lo, hi;
                kq_codes_pair(fmt, w, s, c / 2, &lo, &hi);
                _mm512_storeu_si512(codes + k + 32 * c, lo);
                _mm512_storeu_si512(codes + k + 32 * c + 32, hi);
                for (int i = c; i < c + 2; i++) {
                    mb[3 * i] = mb[3 * i + 1] = scale[i];
                    mb[3 * i + 2] = -offset[i];
                }
            }
        }
    }
}

/* scaled_dot's sum from a row scaled_decode wrote, bit for bit. */
static float scaled_buffer_dot(int fmt, const void *buf, int64_t K, const uint16_t *x) {
    const uint16_t *codes = buf;
    const float *m = (const float *)(codes + K);
    const int has_min = scaled_has_min(fmt), pair = fmt == FMT_Q6_K;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 sv = pair ? scale_pair(m[3 * b], m[3 * b + 1]) : _mm512_set1_ps(m[3 * b]);
        acc[b & 3] = scaled_block(acc[b & 3], _mm512_loadu_si512(codes + 32 * b), sv,
                                  m[3 * b + 2], has_min, x + 32 * b);
    }
    return scaled_sum(acc[0], acc[1], acc[2], acc[3]);
}

/* dot_bf16_bf16 of the decoded row with x: 128 values a step into its four accumulators, the
 * values past the last whole step through `tail` (K values' room) and its scalar loop. With
 * xs (x split by split_x) mxfp4 takes the pairs route: each 32 values' odd products, then
 * their even ones, added by FMAs into the accumulator AVX512-BF16's pair dot product adds them
 * to, in its order (odd first), so the sums are its sums bit for bit (the products of bf16
 * values are exact in fp32); only subnormal inputs differ (it flushes them). nvfp4 takes the
 * block route (nv_block: equal within fp32 rounding). */
static float qdot_bf16(const qrow_t *q, int64_t K, const uint16_t *x, const float *xs,
                       uint16_t *tail) {
    if (scaled_format(q->fmt)) return scaled_dot(q, K, x);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
#if FP8_TABLES /* (the row's, for its steps and its tail) */
    const fp8_table_t *tables =
        q->fmt == FMT_FP8 ? fp8_row_tables(q->s32, (K + q->bk - 1) / q->bk) : NULL;
#endif
#define QDOT_STEP(w0, w1, w2, w3)                                                               \
    do {                                                                                        \
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)(w0), (__m512bh)_mm512_loadu_si512(x + k));        \
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)(w1), (__m512bh)_mm512_loadu_si512(x + k + 32));   \
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)(w2), (__m512bh)_mm512_loadu_si512(x + k + 64));   \
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)(w3), (__m512bh)_mm512_loadu_si512(x + k + 96));   \
    } while (0)
#define PAIRS_STEP(a, i, e, o)                                                                  \
    do {                                                                                        \
        a = _mm512_fmadd_ps(o, _mm512_loadu_ps(xs + k + 32 * (i) + 16), a);                     \
        a = _mm512_fmadd_ps(e, _mm512_loadu_ps(xs + k + 32 * (i)), a);                          \
    } while (0)
    int64_t k = 0;
    __m512 e, o;
    if (xs && q->fmt == FMT_MXFP4) {
        for (; k + 128 <= K; k += 128) {
            const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(s + PREFETCH_BYTES / 16);
            mx_pairs(w, s[0], &e, &o);
            PAIRS_STEP(a0, 0, e, o);
            mx_pairs(w + 16, s[1], &e, &o);
            PAIRS_STEP(a1, 1, e, o);
            mx_pairs(w + 32, s[2], &e, &o);
            PAIRS_STEP(a2, 2, e, o);
            mx_pairs(w + 48, s[3], &e, &o);
            PAIRS_STEP(a3, 3, e, o);
        }
    } else if (xs && q->fmt == FMT_NVFP4) {
        float out;
        nv_block_dots(q, NULL, K, xs, &out);
        return out;
    } else if (q->fmt == FMT_MXFP4) {
        for (; k + 128 <= K; k += 128) {
            const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(s + PREFETCH_BYTES / 16);
            uint32_t s4; /* (the four scales in one load: 3-5% faster than four) */
            memcpy(&s4, s, 4);
            QDOT_STEP(mx_bf16(w, (uint8_t)s4), mx_bf16(w + 16, (uint8_t)(s4 >> 8)),
                      mx_bf16(w + 32, (uint8_t)(s4 >> 16)), mx_bf16(w + 48, (uint8_t)(s4 >> 24)));
        }
    } else if (q->fmt == FMT_NVFP4) {
        const nv_rows_t t = nv_table(q->g, NV_WORDS)->t;
        for (; k + 128 <= K; k += 128) {
            const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 16;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(s + PREFETCH_BYTES / 8);
            uint64_t s8; /* (the eight scales in one load, as mxfp4's four) */
            memcpy(&s8, s, 8);
#define NV_S(i) ((unsigned)(s8 >> (8 * (i))) & 0xff)
            QDOT_STEP(nv_bf16(w, NV_S(0), NV_S(1), 1, t), nv_bf16(w + 16, NV_S(2), NV_S(3), 1, t),
                      nv_bf16(w + 32, NV_S(4), NV_S(5), 1, t),
                      nv_bf16(w + 48, NV_S(6), NV_S(7), 1, t));
#undef NV_S
        }
    } else if (q->fmt == FMT_Q8_0) {
        for (; k + 128 <= K; k += 128) {
            const uint8_t *w = q->w + k;
            const uint16_t *s = q->s16 + k / 32;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(w + PREFETCH_BYTES + 64);
            PREFETCH(s + PREFETCH_BYTES / 32);
            QDOT_STEP(q8_bf16(w, _cvtsh_ss(s[0])), q8_bf16(w + 32, _cvtsh_ss(s[1])),
                      q8_bf16(w + 64, _cvtsh_ss(s[2])), q8_bf16(w + 96, _cvtsh_ss(s[3])));
        }
    } else { /* FMT_FP8, blocks of a multiple of 128 columns */
#if FP8_TABLES
        const fp8_table_t *t = tables;
        /* (bk is a multiple of 128: the step's block moves on at the block's end, no
         * division a step) */
        for (int64_t end = q->bk; t && k + 128 <= K; k += 128) {
            if (k == end) {
                t++;
                end += q->bk;
            }
            const uint8_t *w = q->w + k;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(w + PREFETCH_BYTES + 64);
            __m512i w0, w1, w2, w3;
            fp8_bf16_64(w, t, &w0, &w1);
            fp8_bf16_64(w + 64, t, &w2, &w3);
            QDOT_STEP(w0, w1, w2, w3);
        }
#endif
        for (int64_t b = k / q->bk; k + 128 <= K; b++) {
            const fp8_scale_t f = fp8_scale(q->s32[b]);
            for (const int64_t end = (b + 1) * q->bk; k + 128 <= K && k < end; k += 128) {
                const uint8_t *w = q->w + k;
                PREFETCH(w + PREFETCH_BYTES);
                PREFETCH(w + PREFETCH_BYTES + 64);
                QDOT_STEP(fp8_bf16(w, &f), fp8_bf16(w + 32, &f), fp8_bf16(w + 64, &f),
                          fp8_bf16(w + 96, &f));
            }
        }
    }
#undef QDOT_STEP
#undef PAIRS_STEP
    /* The rest as dot_bf16_bf16 takes it: 32 values a step into a0, the last (< 32) decoded
     * into `tail` and read by masked loads. (32-value steps never straddle an fp8 block: its
     * columns are a multiple of 128 here.) */
    if (q->fmt == FMT_MXFP4) {
        for (; k + 32 <= K; k += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)mx_bf16(q->w + k / 2, q->s8[k / 32]),
                                  (__m512bh)_mm512_loadu_si512(x + k));
    } else if (q->fmt == FMT_NVFP4) {
        const nv_rows_t t = nv_table(q->g, NV_WORDS)->t;
        for (; k + 32 <= K; k += 32)
            a0 = _mm512_dpbf16_ps(a0,
                                  (__m512bh)nv_bf16(q->w + k / 2, q->s8[k / 16],
                                                    q->s8[k / 16 + 1], 1, t),
                                  (__m512bh)_mm512_loadu_si512(x + k));
    } else if (q->fmt == FMT_Q8_0) {
        for (; k + 32 <= K; k += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)q8_bf16(q->w + k, _cvtsh_ss(q->s16[k / 32])),
                                  (__m512bh)_mm512_loadu_si512(x + k));
    } else {
#if FP8_TABLES
        for (; tables && k + 64 <= K; k += 64) {
            __m512i w0, w1;
            fp8_bf16_64(q->w + k, tables + k / q->bk, &w0, &w1);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x + k));
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)w1, (__m512bh)_mm512_loadu_si512(x + k + 32));
        }
#endif
        for (; k + 32 <= K; k += 32) {
            const fp8_scale_t f = fp8_scale(q->s32[k / q->bk]);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)fp8_bf16(q->w + k, &f),
                                  (__m512bh)_mm512_loadu_si512(x + k));
        }
    }
    if (k < K) {
        decode_range(q, k, K, 1, tail);
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, tail),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#endif

#if QDOT_F32
/* dot_f32 of the decoded row with x: 64 values a step into its 4 x 16 accumulators (a product,
 * then a sum, as its loop), the values past the last whole step through `tail`, then its
 * order: the tail's sum first, the accumulators' lanes after it one by one. */
static float qdot_f32(const qrow_t *q, int64_t K, const float *x, float *tail) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
#define QDOT_STEP(w0, w1, w2, w3)                                                               \
    do {                                                                                        \
        a[0] = _mm512_add_ps(a[0], _mm512_mul_ps(w0, _mm512_loadu_ps(x + k)));                  \
        a[1] = _mm512_add_ps(a[1], _mm512_mul_ps(w1, _mm512_loadu_ps(x + k + 16)));             \
        a[2] = _mm512_add_ps(a[2], _mm512_mul_ps(w2, _mm512_loadu_ps(x + k + 32)));             \
        a[3] = _mm512_add_ps(a[3], _mm512_mul_ps(w3, _mm512_loadu_ps(x + k + 48)));             \
    } while (0)
    int64_t k = 0;
    __m512 w0, w1, w2, w3;
    if (q->fmt == FMT_MXFP4) {
        for (; k + 64 <= K; k += 64) {
            const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32;
            PREFETCH(w + PREFETCH_BYTES); /* (every other step's: the same line) */
            PREFETCH(s + PREFETCH_BYTES / 16);
            mx_f32(w, s[0], &w0, &w1);
            mx_f32(w + 16, s[1], &w2, &w3);
            QDOT_STEP(w0, w1, w2, w3);
        }
    } else if (q->fmt == FMT_NVFP4) {
        for (; k + 64 <= K; k += 64) {
            const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 16;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(s + PREFETCH_BYTES / 8);
            nv_f32(w, s, 1, q->g, &w0, &w1);
            nv_f32(w + 16, s + 2, 1, q->g, &w2, &w3);
            QDOT_STEP(w0, w1, w2, w3);
        }
    } else if (q->fmt == FMT_Q8_0) {
        for (; k + 64 <= K; k += 64) {
            PREFETCH(q->w + k + PREFETCH_BYTES);
            q8_f32(q->w + k, _cvtsh_ss(q->s16[k / 32]), &w0, &w1);
            q8_f32(q->w + k + 32, _cvtsh_ss(q->s16[k / 32 + 1]), &w2, &w3);
            QDOT_STEP(w0, w1, w2, w3);
        }
    } else if (is_k_quant(q->fmt)) { /* whole blocks of 256: four steps each */
        const int fmt = q->fmt;
        while (k + 256 <= K) {
            const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 256 * q->rest;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(w + PREFETCH_BYTES + 64);
            PREFETCH(s + PREFETCH_BYTES / 2);
            float scale[16], offset[8];
            kq_scales(fmt, s, scale, offset);
            for (int c = 0; c < 8; c += 2, k += 64) {
                kq_f32(fmt, w, s, c, scale, offset, &w0, &w1);
                kq_f32(fmt, w, s, c + 1, scale, offset, &w2, &w3);
                QDOT_STEP(w0, w1, w2, w3);
            }
        }
    } else if (is_legacy(q->fmt)) {
        for (; k + 64 <= K; k += 64) {
            const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32 * q->rest;
            PREFETCH(w + PREFETCH_BYTES);
            PREFETCH(s + PREFETCH_BYTES / 2);
            legacy_f32(q->fmt, w, s, &w0, &w1);
            legacy_f32(q->fmt, w + 16, s + q->rest, &w2, &w3);
            QDOT_STEP(w0, w1, w2, w3);
        }
    } else { /* FMT_FP8, blocks of a multiple of 64 columns */
        for (int64_t b = 0; k + 64 <= K; b++) {
            const fp8_scale_t f = fp8_scale(q->s32[b]);
            for (const int64_t end = (b + 1) * q->bk; k + 64 <= K && k < end; k += 64) {
                PREFETCH(q->w + k + PREFETCH_BYTES);
                fp8_f32(q->w + k, &f, &w0, &w1);
                fp8_f32(q->w + k + 32, &f, &w2, &w3);
                QDOT_STEP(w0, w1, w2, w3);
            }
        }
    }
#undef QDOT_STEP
    float s = 0.0f;
    if (k < K) {
        decode_range(q, k, K, 0, tail);
        for (int64_t i = 0; k + i < K; i++) s += tail[i] * x[k + i];
    }
    float lanes[4][16];
    for (int u = 0; u < 4; u++) _mm512_storeu_ps(lanes[u], a[u]);
    for (int u = 0; u < 4; u++)
        for (int j = 0; j < 16; j++) s += lanes[u][j];
    return s;
}
#endif

#if !QDOT_BF16 /* (never called where qdot_takes says no) */
static float qdot_bf16(const qrow_t *q, int64_t K, const uint16_t *x, const float *xs,
                       uint16_t *tail) {
    (void)q, (void)K, (void)x, (void)xs, (void)tail;
    return 0.0f;
}
static void split_x(int fmt, const uint16_t *x, int64_t K, float *xs) {
    (void)fmt, (void)x, (void)K, (void)xs;
}
#endif
#if !QDOT_F32
static float qdot_f32(const qrow_t *q, int64_t K, const float *x, float *tail) {
    (void)q, (void)K, (void)x, (void)tail;
    return 0.0f;
}
#endif

/* The vector width the decoders were built for (512, 256; 0: the scalar ones): for tests of the
 * builds -march=native does not pick here. */
int ft_cpu_experts_decoder_bits(void) {
#if FT_AVX512
    return 512;
#elif FT_AVX2
    return 256;
#else
    return 0;
#endif
}

/* Rows [0, N) of expert `pair`'s quantized projection (as ft_cpu_experts_submit takes one) decoded
 * into out [N, K] in `dtype`, as the jobs decode them: for tests against the definition. */
void ft_cpu_experts_decode(int dtype, int fmt, const void *w, const void *s, const float *g,
                           int64_t bn, int64_t bk, int64_t pair, int64_t N, int64_t K, void *out) {
    pthread_once(&tables_once, init_tables);
    const proj_t p = {fmt, w, s, g, bn, bk};
    const int bf16 = dtype == DT_BF16;
    for (int64_t row = 0; row < N; row++) {
        const qrow_t q = quantized_row(&p, pair, N, K, row);
        decode_range(&q, 0, K, bf16, at(out, row * K, bf16));
    }
}

/* This thread's scratch for an expert item (kept for its next items): decoded rows, and the
 * item's outputs, gathered there and stored once at its end (written in place one by one, the
 * outputs of neighbouring items, which share cache lines, would bounce those lines between the
 * threads at every value). */
static _Thread_local void *item_scratch;
static _Thread_local size_t item_capacity;

static char *thread_scratch(size_t bytes) {
    if (bytes > item_capacity) {
        const size_t capacity = (bytes + 4095) & ~(size_t)4095;
        void *p = aligned_alloc(64, capacity);
        if (!p) { /* tens of KiB: the process is out of memory */
            fputs("freetoken cpu_experts: no memory for a work item's scratch\n", stderr);
            abort();
        }
        free(item_scratch);
        item_scratch = p;
        item_capacity = capacity;
    }
    return item_scratch;
}

/* gpt-oss's clamped SwiGLU (activations.py), in fp32; its constants are the release's. */
static inline float swiglu_oai(float gate, float up) {
    const float g = gate < 7.0f ? gate : 7.0f;
    const float u = up < -7.0f ? -7.0f : (up > 7.0f ? 7.0f : up);
    return (u + 1.0f) * (g / (1.0f + expf(-1.702f * g)));
}

static inline float activate(float g, int act) {
    switch (act) {
    case ACT_GELU: return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    case ACT_GELU_TANH:
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    case ACT_RELU: return g > 0.0f ? g : 0.0f;
    default: return g / (1.0f + expf(-g));
    }
}

/* A job: routes grouped by expert. Group g is routes [group_start[g], group_start[g + 1]), all
 * with the expert at flat id group_pair[g]. Route r reads row route_row[r] of x [*, H] and adds
 * route_w[r] * expert(x) into row route_row[r] of out [*, H] (fp32, zeroed at submission).
 * a_buf [R, I] is scratch. With bf16 banks the activations are bf16 too (x16, a16: the values
 * torch would multiply, each already rounded to bf16), for dot_bf16_bf16. A group's down rows
 * wait for its own gate/up items only (group_done), not for every group's: a thread out of
 * gate/up items starts on the down rows of the groups done first. */
enum { JOB_EXPERTS = 0, JOB_LINEAR = 1, JOB_ATTENTION = 2, JOB_QLINEAR = 3, JOB_DEQUANTIZE = 4 };

typedef struct {
    int dtype, act, workers;
    int fmt;                 /* FMT_*: the gate/up projection's (the routes of both: see submit) */
    proj_t gate_up, down;    /* [P, 2I, H] and [P, H, I] */
    int64_t H, I, n_groups;
    const float *x, *route_w;
    const int64_t *group_start, *group_pair, *route_row;
    float *a_buf, *out;
    uint16_t *a16;
    /* Per group: its gate/up items done, one more once its activations are ready for the down
     * projection (split, where a single route's rows take a split x: a_split [R, I]). */
    int64_t *group_done;
    float *a_split;
    int64_t gate_items, down_items; /* gate items come first, then down items */
    int64_t n_rows;                 /* rows of x and out */
    int64_t gate_rows, down_rows;   /* weight rows per gate item, output columns per down item */
    int64_t gate_blocks;            /* gate items per group: ceil(I / gate_rows) */
    /* A dense layer (JOB_LINEAR): out [T, N] = x [T, H] . w [N, H]^T + bias, each output
     * rounded as torch rounds it; its items are ROW_BLOCK rows of w, for every row of x. A
     * dense layer kept quantized (JOB_QLINEAR): w is gate_up's projection (P = 1) in `fmt`, its
     * items gate_rows rows; xs: x split by split_x where qdot_split says so (T = 1), else NULL.
     * Such a weight dequantized (JOB_DEQUANTIZE): its rows decoded into dense [N, H]. */
    int kind;
    const void *w, *bias;
    const uint16_t *x16; /* with bf16 weights: x in bf16 (else x, fp32) */
    const float *xs;
    void *dense;
    int64_t N, T;
    /* Decode attention over the paged KV cache (JOB_ATTENTION): phase 1 items are (sequence,
     * KV head, split of its keys), each an online softmax over its keys for the KV head's
     * group of query heads, left as partials; phase 2 items merge one (sequence, head). */
    const void *k_pool, *v_pool;
    const int64_t *table, *rows, *lengths;
    const float *sinks;
    int64_t B, heads, kv_heads, D, page, width, window, splits;
    float scale;
    float *part_m, *part_l, *part_acc;
    /* Experts with biases (gpt-oss): the gate/up projections' bias bank [P, 2I] in `dtype`,
     * by the same flat ids as w_gate_up; NULL without. */
    const void *b_gate_up;
} job_t;

static inline float bias_at(const job_t *j, int64_t index) {
    return j->dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)j->b_gate_up)[index])
                               : ((const float *)j->b_gate_up)[index];
}


/* A weight row for the dot products: in registers as qdot_* decodes it (`direct`), or at p (in a
 * dense bank, or decoded into the caller's buffer). */
typedef struct {
    const void *p;
    qrow_t q;
    int direct;
    int scaled; /* p holds scaled_decode's codes and multipliers (a bf16 job's GGUF blocks) */
} wrow_t;

/* Row `row` of expert `pair`'s projection p [N, K], for `routes` dot products, into *w: decoded
 * into buf (K values' room) unless one route reads it and qdot_* can take it. (Filled in place:
 * returned by value, the struct went through the stack by vector moves that waited on its
 * scalar stores, which halved the speed of the down projection's short rows.) */
static inline void weight_row(const job_t *j, const proj_t *p, int64_t pair, int64_t N, int64_t K,
                              int64_t row, int64_t routes, void *buf, wrow_t *w) {
    const int bf16 = j->dtype == DT_BF16;
    w->scaled = 0;
    if (j->fmt == FMT_DENSE) {
        const size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
        w->p = (const char *)p->w + (pair * N + row) * K * size;
        w->direct = 0;
        return;
    }
    w->q = quantized_row(p, pair, N, K, row);
    w->direct = routes == 1 && qdot_takes(&w->q, bf16);
    if (!w->direct) {
#if QDOT_BF16
        if (bf16 && scaled_format(w->q.fmt)) {
            scaled_decode(&w->q, K, buf);
            w->p = buf;
            w->scaled = 1;
            return;
        }
#endif
        decode_range(&w->q, 0, K, bf16, buf);
        w->p = buf;
    }
}

/* The row's dot product with x (a bf16 model's: bf16 x; else fp32): the dense path's, or its
 * equal on the quantized row (buf: room for its tail; xs: x split by split_x, or NULL). */
static inline float row_dot(const job_t *j, const wrow_t *w, int64_t K, const void *x,
                            const float *xs, void *buf) {
    if (j->dtype == DT_BF16) {
#if QDOT_BF16
        if (w->scaled) return scaled_buffer_dot(w->q.fmt, w->p, K, x);
#endif
        return w->direct ? qdot_bf16(&w->q, K, x, xs, buf) : dot_bf16_bf16(w->p, x, K);
    }
    return w->direct ? qdot_f32(&w->q, K, x, buf) : dot_f32(w->p, x, K);
}

/* Two rows' dot products with one x into out[0] and out[1], as row_dot gives them: nvfp4's
 * block route takes the two together (x's loads shared), every other way goes one by one. */
static inline void row_dot_pair(const job_t *j, const wrow_t *wa, const wrow_t *wb, int64_t K,
                                const void *x, const float *xs, void *buf_a, void *buf_b,
                                float *out) {
#if QDOT_BF16
    if (xs && wa->direct && wb->direct && wa->q.fmt == FMT_NVFP4) {
        nv_block_dots(&wa->q, &wb->q, K, xs, out);
        return;
    }
#endif
    out[0] = row_dot(j, wa, K, x, xs, buf_a);
    out[1] = row_dot(j, wb, K, x, xs, buf_b);
}

/* Row `row` of expert `pair`'s quantized projection (as ft_cpu_experts_decode takes one) dotted
 * with x [K] (bf16) each way a bf16 job may take it, in fp32 before any rounding: out[0] in
 * registers by the word route, out[1] by the route that reads x split (mxfp4's pairs route,
 * nvfp4's block route; else out[0]'s way), out[2] decoded into a buffer and dotted as a dense row;
 * out[3] and out[4]: rows `row` and `other` by out[1]'s way, two at a time where it takes two
 * (nvfp4). For tests that they agree (bit for bit but for the block route's order); the job's
 * outputs, rounded to bf16, hide most differences in the last fp32 bits. Where this build decodes
 * nothing in registers, all are out[2]'s way. */
void ft_cpu_experts_row_dots(int fmt, const void *w, const void *s, const float *g, int64_t bn,
                             int64_t bk, int64_t pair, int64_t N, int64_t K, int64_t row,
                             int64_t other, const uint16_t *x, float *out) {
    pthread_once(&tables_once, init_tables);
    const proj_t p = {fmt, w, s, g, bn, bk};
    const qrow_t q = quantized_row(&p, pair, N, K, row);
    const qrow_t q2 = quantized_row(&p, pair, N, K, other);
    float *xs = malloc(sizeof(float) * (size_t)K);
    if (!xs) abort();
    uint16_t *buf = malloc(sizeof(float) * (size_t)K); /* (room for scaled_decode) */
    if (!buf) abort();
#if QDOT_BF16
    if (scaled_format(q.fmt)) {
        scaled_decode(&q, K, buf);
        out[2] = scaled_buffer_dot(q.fmt, buf, K, x);
    } else
#endif
    {
        decode_range(&q, 0, K, 1, buf);
        out[2] = dot_bf16_bf16(buf, x, K);
    }
    out[0] = qdot_takes(&q, 1) ? qdot_bf16(&q, K, x, NULL, buf) : out[2];
    split_x(fmt, x, K, xs);
    out[1] = qdot_split(fmt, 1) ? qdot_bf16(&q, K, x, xs, buf) : out[0];
    const job_t job = {.dtype = DT_BF16, .fmt = fmt};
    wrow_t wa = {.q = q, .direct = qdot_takes(&q, 1)}, wb = {.q = q2, .direct = qdot_takes(&q2, 1)};
    uint16_t *buf2 = malloc(sizeof(uint16_t) * (size_t)K);
    if (!buf2) abort();
    if (!wa.direct) decode_range(&q, 0, K, 1, buf), wa.p = buf;
    if (!wb.direct) decode_range(&q2, 0, K, 1, buf2), wb.p = buf2;
    row_dot_pair(&job, &wa, &wb, K, x, qdot_split(fmt, 1) ? xs : NULL, buf, buf2, out + 3);
    free(buf);
    free(buf2);
    free(xs);
}

/* Linear item: ROW_BLOCK rows of w, each streamed once for all T rows of x. */
static void linear_item(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t n0 = item * ROW_BLOCK, n1 = n0 + ROW_BLOCK < j->N ? n0 + ROW_BLOCK : j->N;
    for (int64_t n = n0; n < n1; n++) {
        float b = 0.0f;
        if (j->bias)
            b = bf16 ? bf16_to_f32(((const uint16_t *)j->bias)[n]) : ((const float *)j->bias)[n];
        for (int64_t t = 0; t < j->T; t++) {
            float y = bf16 ? dot_bf16_bf16((const uint16_t *)j->w + n * j->H, j->x16 + t * j->H,
                                           j->H)
                           : dot_f32((const float *)j->w + n * j->H, j->x + t * j->H, j->H);
            j->out[t * j->N + n] = rnd(y + b, bf16);
        }
    }
}

/* Quantized linear item: gate_rows rows of the weight, each read once from its blocks for all T
 * rows of x: decoded in registers into the dot product where T = 1 (qdot_*), else decoded once
 * into this thread's scratch and dotted from there with each row of x, as the experts' rows read
 * by one route and by several are (weight_row). Each output is the dense layer's on the
 * dequantized weight (linear_item's). */
static inline float qlinear_bias(const job_t *j, int64_t n) {
    if (!j->bias) return 0.0f;
    return j->dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)j->bias)[n])
                               : ((const float *)j->bias)[n];
}

static void qlinear_item(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t K = j->H, n0 = item * j->gate_rows;
    const int64_t n1 = n0 + j->gate_rows < j->N ? n0 + j->gate_rows : j->N;
    void *buf = thread_scratch(sizeof(float) * (size_t)K); /* (scaled_decode's 2.375 K bytes) */
    const void *x = bf16 ? (const void *)j->x16 : (const void *)j->x;
    const size_t x_row = (bf16 ? sizeof(uint16_t) : sizeof(float)) * (size_t)K;
    for (int64_t n = n0; n < n1; n++) {
        wrow_t w;
        weight_row(j, &j->gate_up, 0, j->N, K, n, j->T, buf, &w);
        const float b = qlinear_bias(j, n);
        for (int64_t t = 0; t < j->T; t++) {
            const float y = row_dot(j, &w, K, (const char *)x + t * x_row, j->xs, buf);
            j->out[t * j->N + n] = rnd(y + b, bf16);
        }
    }
}

/* Dequantize item: gate_rows rows of the weight decoded into j->dense in the job's dtype. */
static void dequantize_item(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t n0 = item * j->gate_rows;
    const int64_t n1 = n0 + j->gate_rows < j->N ? n0 + j->gate_rows : j->N;
    for (int64_t n = n0; n < n1; n++) {
        const qrow_t q = quantized_row(&j->gate_up, 0, j->N, j->H, n);
        decode_range(&q, 0, j->H, bf16, at(j->dense, n * j->H, bf16));
    }
}

#define ATTN_BLOCK 32 /* keys scored at once, before their softmax weights are applied */
#define ATTN_MAX_GROUP 64

/* Phase 1: keys [lo, hi) of one sequence for one KV head's group of query heads. */
static void attention_partial(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t s = item % j->splits, kvh = (item / j->splits) % j->kv_heads;
    const int64_t b = item / (j->splits * j->kv_heads);
    const int64_t G = j->heads / j->kv_heads, D = j->D, L = j->lengths[b];
    const int64_t first = j->window > 0 && L > j->window ? L - j->window : 0;
    const int64_t per = (L - first + j->splits - 1) / j->splits;
    const int64_t lo = first + s * per, hi = lo + per < L ? lo + per : L;
    const int64_t *pages = j->table + j->rows[b] * j->width;
    const int64_t stride = j->kv_heads * D; /* elements from one slot to the next */
    float m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP], scores[ATTN_MAX_GROUP][ATTN_BLOCK];
    float *acc = j->part_acc + ((b * j->heads + kvh * G) * j->splits + s) * D;
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        float *a = acc + g * j->splits * D;
        for (int64_t d = 0; d < D; d++) a[d] = 0.0f;
    }
    for (int64_t start = lo; start < hi; start += ATTN_BLOCK) {
        const int64_t n = hi - start < ATTN_BLOCK ? hi - start : ATTN_BLOCK;
        int64_t off[ATTN_BLOCK]; /* element offset of each key's head vector in the pools */
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = start + t;
            off[t] = (pages[pos / j->page] * j->page + pos % j->page) * stride + kvh * D;
        }
        for (int64_t g = 0; g < G; g++) {
            const int64_t q = (b * j->heads + kvh * G + g) * D;
            float top = m[g];
            for (int64_t t = 0; t < n; t++) {
                float sc = bf16 ? dot_bf16_bf16((const uint16_t *)j->k_pool + off[t], j->x16 + q,
                                                D)
                                : dot_f32((const float *)j->k_pool + off[t], j->x + q, D);
                sc *= j->scale;
                scores[g][t] = sc;
                if (sc > top) top = sc;
            }
            float *a = acc + g * j->splits * D;
            if (top > m[g]) { /* a larger logit: rescale what is summed so far */
                const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - top);
                l[g] *= alpha;
                for (int64_t d = 0; d < D; d++) a[d] *= alpha;
                m[g] = top;
            }
            for (int64_t t = 0; t < n; t++) {
                const float p = expf(scores[g][t] - top);
                l[g] += p;
                if (bf16) {
                    const uint16_t *v = (const uint16_t *)j->v_pool + off[t];
                    for (int64_t d = 0; d < D; d++) a[d] += p * bf16_to_f32(v[d]);
                } else {
                    const float *v = (const float *)j->v_pool + off[t];
                    for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
                }
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const int64_t i = (b * j->heads + kvh * G + g) * j->splits + s;
        j->part_m[i] = m[g];
        j->part_l[i] = l[g];
    }
}

/* Phase 2: one (sequence, head) from its splits' partials (and its sink's logit). */
static void attention_merge(const job_t *j, int64_t item) {
    const int64_t h = item % j->heads, D = j->D, S = j->splits;
    const int64_t base = item * S;
    float top = j->sinks ? j->sinks[h] : -INFINITY;
    for (int64_t s = 0; s < S; s++)
        if (j->part_m[base + s] > top) top = j->part_m[base + s];
    float total = j->sinks ? expf(j->sinks[h] - top) : 0.0f;
    float *out = j->out + item * D;
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t s = 0; s < S; s++) {
        if (j->part_m[base + s] == -INFINITY) continue; /* a split with no keys */
        const float w = expf(j->part_m[base + s] - top);
        total += w * j->part_l[base + s];
        const float *a = j->part_acc + (base + s) * D;
        for (int64_t d = 0; d < D; d++) out[d] += w * a[d];
    }
    for (int64_t d = 0; d < D; d++) out[d] /= total;
}

/* ---- shared by the items and the team: atomics, the clock, the profiling build's times ---- */

#define LOAD(p) __atomic_load_n(p, __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n(p, v, __ATOMIC_SEQ_CST)
#define ADD(p, v) __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* A thread of a job that waits for another's item (a group's gate/up rows, attention's first
 * phase) spins this long, then naps: an item takes microseconds, but one whose thread was
 * preempted (another process wants the core: an oversubscribed machine) comes back only when
 * the scheduler runs it again, milliseconds later. Spinning meanwhile kept this core busy, so
 * the preempted thread could not move here; napping leaves the core idle, and it does. */
#define ITEM_WAIT_SPIN_SECONDS 50e-6
#define ITEM_WAIT_NAP_NS 20000

static void wait_at_least(const int64_t *value, int64_t target) {
    if (LOAD(value) >= target) return;
    const double until = now() + ITEM_WAIT_SPIN_SECONDS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (LOAD(value) >= target) return;
            cpu_relax();
        }
        if (now() >= until) break;
    }
    const struct timespec nap = {0, ITEM_WAIT_NAP_NS};
    while (LOAD(value) < target) nanosleep(&nap, NULL);
}

/* With -DITEM_TIMES (a profiling build: FREETOKEN_NATIVE_FLAGS), the team's thread-seconds in
 * phase 1 items, in phase 2 items and waiting between the two, summed over jobs until read by
 * ft_cpu_experts_item_seconds: where a job's time goes besides the items' own work. */
static uint64_t item_ns[3];

int ft_cpu_experts_item_seconds(double *out) {
    for (int i = 0; i < 3; i++)
        out[i] = (double)__atomic_exchange_n(&item_ns[i], 0, __ATOMIC_SEQ_CST) * 1e-9;
#ifdef ITEM_TIMES
    return 1;
#else
    return 0;
#endif
}

#ifdef ITEM_TIMES
#define ITEM_CLOCK(t) const double t = now()
#define ITEM_ADD(which, seconds) ADD(&item_ns[which], (uint64_t)(int64_t)((seconds) * 1e9))
#else
#define ITEM_CLOCK(t)
#define ITEM_ADD(which, seconds)
#endif
#define ITEM_TIME(which, t0) ITEM_ADD(which, now() - (t0))

/* Gate item: gate_rows rows of one group's gate and up projections, for every route of the
 * group: a[r, n] = act(gate_n . x) * (up_n . x), rounded as torch rounds. The group's last item
 * to finish readies its activations for the down items (group_done). */
static void gate_item(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t block = j->gate_rows, blocks = j->gate_blocks;
    const int64_t g = item / blocks, n0 = (item % blocks) * block;
    const int64_t n1 = n0 + block < j->I ? n0 + block : j->I;
    const int64_t H = j->H, I = j->I, pair = j->group_pair[g];
    const int64_t first = j->group_start[g], last = j->group_start[g + 1];
    /* [the gate's and the up projection's decoded rows (quantized experts)] [x split for the
     * pairs or block route] [outputs] */
    const size_t rows = j->fmt == FMT_DENSE ? 0 : 2 * (size_t)H * sizeof(float);
    const int split = last - first == 1 && qdot_split(j->fmt, bf16);
    const size_t split_bytes = split ? (size_t)H * sizeof(float) : 0;
    char *scratch = thread_scratch(rows + split_bytes + sizeof(float) * block * (last - first));
    char *buf = scratch, *buf_up = scratch + rows / 2;
    float *xs = split ? (float *)(scratch + rows) : NULL;
    float *a_item = (float *)(scratch + rows + split_bytes); /* [route][row of the block] */
    if (split) split_x(j->fmt, j->x16 + j->route_row[first] * H, H, xs);
    for (int64_t n = n0; n < n1; n++) {
        wrow_t gw, uw;
        weight_row(j, &j->gate_up, pair, 2 * I, H, n, last - first, buf, &gw);
        weight_row(j, &j->gate_up, pair, 2 * I, H, I + n, last - first, buf_up, &uw);
        for (int64_t r = first; r < last; r++) {
            const void *xr = bf16 ? (const void *)(j->x16 + j->route_row[r] * H)
                                  : (const void *)(j->x + j->route_row[r] * H);
            float dots[2];
            row_dot_pair(j, &gw, &uw, H, xr, xs, buf, buf_up, dots);
            float gate = rnd(dots[0], bf16), up = rnd(dots[1], bf16);
            if (j->b_gate_up) { /* torch: (x @ W) + b, each op rounded */
                gate = rnd(gate + bias_at(j, pair * 2 * I + n), bf16);
                up = rnd(up + bias_at(j, pair * 2 * I + I + n), bf16);
            }
            /* swiglu_oai rounded once (torch rounds it op by op: a rounding apart in bf16);
             * swiglu_clamp (DeepSeek-V4): silu of the clamped gate times the clamped up, the
             * clamps exact, so rounded as torch rounds it */
            if (j->act == ACT_SWIGLU_CLAMP) {
                const float lim = (float)SWIGLU_CLAMP_LIMIT;
                gate = fminf(gate, lim);
                up = fmaxf(fminf(up, lim), -lim);
            }
            const int act = j->act == ACT_SWIGLU_CLAMP ? ACT_SILU : j->act;
            a_item[(r - first) * block + n - n0] =
                act == ACT_SWIGLU_OAI ? rnd(swiglu_oai(gate, up), bf16)
                                      : rnd(rnd(activate(gate, act), bf16) * up, bf16);
        }
    }
    for (int64_t r = first; r < last; r++)
        for (int64_t n = n0; n < n1; n++) {
            const float a = a_item[(r - first) * block + n - n0];
            if (bf16)
                j->a16[r * I + n] = bf16_bits(a);
            else
                j->a_buf[r * I + n] = a;
        }
    if (ADD(&j->group_done[g], 1) == blocks) { /* the group's activations are all in */
        /* Split once here for every down item (each had split it again: 1/16 of their work) */
        if (split) split_x(j->fmt, j->a16 + first * I, I, j->a_split + first * I);
        ADD(&j->group_done[g], 1);
    }
}

/* Asks for the first PREFETCH_BYTES of rows `row` on of expert `pair`'s projection p [N, K] (and
 * of their scales): a down item reads a few rows of each group's expert in turn, each group's a
 * new stream, and the hardware's prefetchers catch on to it only after its first lines came. */
static void prefetch_rows(const job_t *j, const proj_t *p, int64_t pair, int64_t N, int64_t K,
                          int64_t row) {
#if PREFETCH_BYTES > 0
    if (j->fmt == FMT_DENSE) {
        const size_t size = j->dtype == DT_BF16 ? sizeof(uint16_t) : sizeof(float);
        const char *w = (const char *)p->w + (pair * N + row) * K * size;
        for (int64_t b = 0; b < PREFETCH_BYTES; b += 64) PREFETCH(w + b);
        return;
    }
    const qrow_t q = quantized_row(p, pair, N, K, row);
    for (int64_t b = 0; b < PREFETCH_BYTES; b += 64) PREFETCH(q.w + b);
    const void *s = q.s8 ? (const void *)q.s8 : q.s16 ? (const void *)q.s16 : (const void *)q.s32;
    for (int64_t b = 0; b < PREFETCH_BYTES / 8; b += 64) PREFETCH((const char *)s + b);
#else
    (void)j, (void)p, (void)pair, (void)N, (void)K, (void)row;
#endif
}

/* Down item: down_rows output columns, over every group and route in route order, so each
 * output element is summed by one thread in a fixed order (deterministic):
 * out[row_r, n] += round(route_w[r] * round(down_n . a[r])), summed from 0 in the thread's
 * scratch and stored once (out is zeroed at submission and these columns are the item's). */
static void down_item(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t H = j->H, I = j->I, block = j->down_rows, n0 = item * block;
    const int64_t n1 = n0 + block < H ? n0 + block : H;
    /* [a decoded row (quantized experts)] [outputs] */
    const size_t rows = j->fmt == FMT_DENSE ? 0 : (size_t)I * sizeof(float);
    const int split = qdot_split(j->fmt, bf16);
    char *scratch = thread_scratch(rows + sizeof(float) * block * j->n_rows);
    void *buf = scratch;
    float *out = (float *)(scratch + rows); /* [row of x][column of the block] */
    memset(out, 0, sizeof(float) * block * j->n_rows);
    for (int64_t g = 0; g < j->n_groups; g++) {
        const int64_t first = j->group_start[g], last = j->group_start[g + 1];
        const int pairs = split && last - first == 1;
        const float *as = pairs ? j->a_split + first * I : NULL;
        if (g + 1 < j->n_groups) prefetch_rows(j, &j->down, j->group_pair[g + 1], H, I, n0);
        if (LOAD(&j->group_done[g]) <= j->gate_blocks) { /* its last gate/up items still run */
            ITEM_CLOCK(t0);
            wait_at_least(&j->group_done[g], j->gate_blocks + 1);
            ITEM_TIME(2, t0);
            ITEM_ADD(1, t0 - now()); /* (run_items counts the whole item) */
        }
        /* (nvfp4's block route takes two rows at a time; its rows are read in place, direct, so
         * the two need no room of their own) */
        const int64_t step = pairs && j->fmt == FMT_NVFP4 ? 2 : 1;
        for (int64_t n = n0; n < n1; n += step) {
            const int rows_now = n + step <= n1 ? (int)step : 1;
            wrow_t w[2];
            for (int i = 0; i < rows_now; i++)
                weight_row(j, &j->down, j->group_pair[g], H, I, n + i, last - first, buf, &w[i]);
            for (int64_t r = first; r < last; r++) {
                const void *ar = bf16 ? (const void *)(j->a16 + r * I)
                                      : (const void *)(j->a_buf + r * I);
                float y[2];
                if (rows_now == 2)
                    row_dot_pair(j, &w[0], &w[1], I, ar, as, buf, buf, y);
                else
                    y[0] = row_dot(j, &w[0], I, ar, as, buf);
                for (int i = 0; i < rows_now; i++)
                    out[j->route_row[r] * block + n + i - n0] +=
                        rnd(rnd(y[i], bf16) * j->route_w[r], bf16);
            }
        }
    }
    for (int64_t row = 0; row < j->n_rows; row++)
        memcpy(j->out + row * H + n0, out + row * block, sizeof(float) * (n1 - n0));
}

/* ---- the team ---------------------------------------------------------------------------
 *
 * One job at a time. Publishing job `gen` writes jobs[gen & 1], zeroes the counters and stores
 * `claim = gen << 32`, then `published = gen`. A thread takes item i by moving claim from
 * (gen << 32 | i) to (gen << 32 | i + 1) with a compare-and-swap, so a thread still holding an
 * older job's description can never take (and lose) an item of a newer job: its generation no
 * longer matches. The description a thread copied is intact whenever its claim succeeds: the
 * slot it read is rewritten only for job gen + 2, which cannot start before job gen + 1 is
 * published, that is, before claim moved past gen. */

/* Decode hands over a job every layer step, 1-2 ms apart: idle team threads and the waiting
 * caller may spin this long before sleeping on a condition variable, since a futex wake-up
 * costs tens of microseconds (more under a sandboxing kernel such as gVisor) against a job of a
 * few hundred. Off by default: spinning pays only where no other thread pool wants these cores
 * (on a 2-core machine beside torch's own pool it made each job 4x slower). */
static double spin_seconds = 0.0;

void ft_cpu_experts_set_spin(double seconds) { spin_seconds = seconds; }

#define MAX_TEAM 1024

static pthread_mutex_t team_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cond = PTHREAD_COND_INITIALIZER; /* a job was published */
static pthread_cond_t done_cond = PTHREAD_COND_INITIALIZER; /* a job was completed */
static job_t jobs[2];
static double job_started[2], job_seconds[2];
static uint64_t claim, published, completed;
static int64_t gate_done, items_done;
static int team_size = 0, sleeping_workers = 0, sleeping_waiters = 0;
static double ready_until = 0.0; /* ft_cpu_experts_prepare: stay awake until then */

/* Spin until *value differs from `from` (gives up after spin_seconds); returns what it saw. */
static uint64_t spin_while_equal(uint64_t *value, uint64_t from) {
    uint64_t v = LOAD(value);
    if (v != from || spin_seconds <= 0.0) return v;
    double until = now() + spin_seconds;
    while ((v = LOAD(value)) == from && now() < until)
        for (int i = 0; i < 32; i++) cpu_relax();
    return v;
}

static void finish(uint64_t gen) {
    pthread_mutex_lock(&team_mutex);
    job_seconds[gen & 1] = now() - job_started[gen & 1];
    STORE(&completed, gen);
    int wake = sleeping_waiters;
    pthread_mutex_unlock(&team_mutex);
    if (wake) pthread_cond_broadcast(&done_cond); /* after unlocking, as in submit */
}

/* Takes and runs items of job `gen` (described by *j) until none is left. */
static void run_items(const job_t *j, uint64_t gen) {
    const uint64_t tag = (gen & 0xffffffffu) << 32;
    const int64_t total = j->gate_items + j->down_items;
    int64_t did = 0;
    for (;;) {
        uint64_t c = LOAD(&claim);
        if ((c & ~0xffffffffull) != tag || (int64_t)(c & 0xffffffffu) >= total) break;
        if (!__atomic_compare_exchange_n(&claim, &c, c + 1, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST))
            continue;
        int64_t item = (int64_t)(c & 0xffffffffu);
        ITEM_CLOCK(t0);
        if (j->kind == JOB_LINEAR) {
            linear_item(j, item);
        } else if (j->kind == JOB_QLINEAR) {
            qlinear_item(j, item);
        } else if (j->kind == JOB_DEQUANTIZE) {
            dequantize_item(j, item);
        } else if (item < j->gate_items) {
            if (j->kind == JOB_ATTENTION)
                attention_partial(j, item);
            else
                gate_item(j, item);
            ITEM_TIME(0, t0);
            ADD(&gate_done, 1); /* (read by attention's phase 2) */
        } else if (j->kind == JOB_ATTENTION) {
            /* Phase 2 items read every phase 1 item's output; all are taken by now, and each
             * takes microseconds (unless its thread was preempted: see wait_at_least). */
            wait_at_least(&gate_done, j->gate_items);
            ITEM_TIME(2, t0);
            ITEM_CLOCK(t1);
            attention_merge(j, item - j->gate_items);
            ITEM_TIME(1, t1);
        } else {
            down_item(j, item - j->gate_items); /* waits for each group's gate/up items */
            ITEM_TIME(1, t0);
        }
        did++;
    }
    if (did && ADD(&items_done, did) == total) finish(gen);
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint64_t seen = LOAD(&published);
    for (;;) {
        uint64_t gen = spin_while_equal(&published, seen);
        if (gen == seen) {
            double until;
            pthread_mutex_lock(&team_mutex);
            sleeping_workers++;
            while ((gen = LOAD(&published)) == seen && now() >= (until = ready_until))
                pthread_cond_wait(&work_cond, &team_mutex);
            sleeping_workers--;
            pthread_mutex_unlock(&team_mutex);
            if (gen == seen) { /* woken ahead of a job (ft_cpu_experts_prepare): wait awake */
                while ((gen = LOAD(&published)) == seen && now() < until)
                    for (int i = 0; i < 32; i++) cpu_relax();
                if (gen == seen) continue;
            }
        }
        seen = gen;
        job_t j = jobs[gen & 1]; /* checked by the first claim (see above) */
        if (index < j.workers) run_items(&j, gen);
    }
    return NULL;
}

/* Blocks until job `gen` is done, taking part in its remaining items first; returns the job's
 * time from submission to completion in seconds. */
double ft_cpu_experts_wait(uint64_t gen) {
    if (LOAD(&published) == gen) {
        job_t j = jobs[gen & 1];
        run_items(&j, gen);
    }
    if (spin_while_equal(&completed, gen - 1) < gen) {
        pthread_mutex_lock(&team_mutex);
        sleeping_waiters++;
        while (LOAD(&completed) < gen) pthread_cond_wait(&done_cond, &team_mutex);
        sleeping_waiters--;
        pthread_mutex_unlock(&team_mutex);
    }
    return job_seconds[gen & 1];
}

/* Wakes the sleeping team ahead of a job about to be submitted: they wait for it awake, for at
 * most `seconds`. The caller pays for the wake-up (a futex broadcast, tens of microseconds
 * under gVisor) where it would wait anyway, for the device say, instead of in
 * ft_cpu_experts_submit, and the team starts the job at once. */
void ft_cpu_experts_prepare(double seconds) {
    pthread_mutex_lock(&team_mutex);
    ready_until = now() + seconds;
    int wake = sleeping_workers;
    pthread_mutex_unlock(&team_mutex);
    if (wake) pthread_cond_broadcast(&work_cond);
}

/* Per job slot, buffers the job owns (grown as needed, kept for the next job of the slot): the
 * routes grouped by expert, x in fp32 and the gate/up scratch. A slot is rebuilt only for job
 * gen + 2, after job gen is complete, so no thread still reads it then (see above). */
typedef struct {
    void *p;
    size_t cap;
} buf_t;
enum { B_X, B_A, B_A_SPLIT, B_GROUP_START, B_GROUP_PAIR, B_GROUP_DONE, B_ROW, B_W, B_ORDER,
       B_META, N_BUFS };
static buf_t scratch[2][N_BUFS];

/* At least `bytes` (their contents not kept), on a cache line: the vector loads of x and of the
 * activations would otherwise straddle two lines each (a fifth to a third slower, in a loop of
 * them alone on the 2-core CPU). */
static void *grow(buf_t *b, size_t bytes) {
    if (bytes > b->cap) {
        const size_t cap = (bytes + 63) & ~(size_t)63;
        void *q = aligned_alloc(64, cap ? cap : 64);
        if (!q) return NULL;
        free(b->p);
        b->p = q;
        b->cap = cap;
    }
    return b->p;
}

typedef struct {
    int64_t pair, index;
} route_key_t;

static int by_pair_then_index(const void *a, const void *b) {
    const route_key_t *x = a, *y = b;
    if (x->pair != y->pair) return x->pair < y->pair ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* Rows of a work item of a phase of `rows` weight rows in all: ROW_BLOCK for dense experts, 4x
 * as many for quantized ones (whose rows are 2-4x shorter in bytes: an item's first rows wait
 * for the hardware's prefetchers to catch on, and ROW_BLOCK rows of a quantized format ran at
 * 75-85% of the speed of 4x as many on the 2-core CPU), but no fewer than 8 items a thread. */
#ifndef QUANTIZED_ITEM_TIMES
#define QUANTIZED_ITEM_TIMES 4
#endif
static int64_t item_rows(const job_t *j, int64_t rows) {
    if (j->fmt == FMT_DENSE) return ROW_BLOCK;
    int64_t times = rows / (ROW_BLOCK * 8 * (j->workers + 1));
    times = times < QUANTIZED_ITEM_TIMES ? times : QUANTIZED_ITEM_TIMES;
    return ROW_BLOCK * (times > 1 ? times : 1);
}

/* Fills slot `slot`'s buffers for a job and describes it in *j; 0 when out of memory. */
static int build_job(job_t *j, int slot, const void *x, int x_bf16, int64_t n_rows,
                     int64_t n_routes, const int64_t *route_row, const int64_t *route_pair,
                     const float *route_w, float *out) {
    buf_t *b = scratch[slot];
    const int64_t H = j->H, I = j->I;
    const int bf16 = j->dtype == DT_BF16;
    void *xs = grow(&b[B_X], (bf16 ? sizeof(uint16_t) : sizeof(float)) * n_rows * H);
    float *a = grow(&b[B_A], sizeof(float) * n_routes * I);
    int64_t *start = grow(&b[B_GROUP_START], sizeof(int64_t) * (n_routes + 1));
    int64_t *pair = grow(&b[B_GROUP_PAIR], sizeof(int64_t) * (n_routes + 1));
    int64_t *row = grow(&b[B_ROW], sizeof(int64_t) * (n_routes + 1));
    float *w = grow(&b[B_W], sizeof(float) * (n_routes + 1));
    route_key_t *order = grow(&b[B_ORDER], sizeof(route_key_t) * (n_routes + 1));
    int64_t *done = grow(&b[B_GROUP_DONE], sizeof(int64_t) * (n_routes + 1));
    const int split = qdot_split(j->fmt, bf16); /* (down items read a split activation) */
    float *a_split = split ? grow(&b[B_A_SPLIT], sizeof(float) * n_routes * I) : NULL;
    if (!xs || !a || !start || !pair || !row || !w || !order || !done || (split && !a_split))
        return 0;
    memset(done, 0, sizeof(int64_t) * (n_routes + 1));
    /* x in the banks' dtype, as torch casts it: bf16 banks take bf16 x (rounded from fp32). */
    const int64_t nx = n_rows * H;
    if (bf16 && x_bf16)
        memcpy(xs, x, sizeof(uint16_t) * nx);
    else if (bf16)
        for (int64_t i = 0; i < nx; i++)
            ((uint16_t *)xs)[i] = bf16_bits(round_bf16(((const float *)x)[i]));
    else if (x_bf16)
        for (int64_t i = 0; i < nx; i++) ((float *)xs)[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    else
        memcpy(xs, x, sizeof(float) * nx);
    memset(out, 0, sizeof(float) * n_rows * H);
    /* Group the routes by expert, keeping their order within a group (a stable sort). */
    for (int64_t r = 0; r < n_routes; r++) order[r] = (route_key_t){route_pair[r], r};
    qsort(order, (size_t)n_routes, sizeof(route_key_t), by_pair_then_index);
    int64_t groups = 0;
    for (int64_t r = 0; r < n_routes; r++) {
        if (r == 0 || order[r].pair != order[r - 1].pair) {
            start[groups] = r;
            pair[groups++] = order[r].pair;
        }
        row[r] = route_row[order[r].index];
        w[r] = route_w[order[r].index];
    }
    start[groups] = n_routes;
    j->n_groups = groups;
    j->n_rows = n_rows;
    j->x = xs;
    j->x16 = xs;
    j->route_w = w;
    j->group_start = start;
    j->group_pair = pair;
    j->route_row = row;
    j->a_buf = a;
    j->a16 = (uint16_t *)a;
    j->a_split = a_split;
    j->group_done = done;
    j->out = out;
    j->gate_rows = item_rows(j, groups * I);
    j->down_rows = item_rows(j, H);
    j->gate_blocks = (I + j->gate_rows - 1) / j->gate_rows;
    j->gate_items = groups * j->gate_blocks;
    j->down_items = groups ? (H + j->down_rows - 1) / j->down_rows : 0;
    return 1;
}

/* The start of a submission: the team grown to `threads`, any job still running waited for.
 * Returns the new job's generation with team_mutex held, or 0 (unlocked) if no thread can be
 * started. */
static uint64_t begin_job(int threads) {
    if (threads > MAX_TEAM) threads = MAX_TEAM;
    pthread_mutex_lock(&team_mutex);
    for (; team_size < threads; team_size++) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker_main, (void *)(intptr_t)team_size) != 0) break;
        pthread_detach(t);
    }
    if (team_size == 0) {
        pthread_mutex_unlock(&team_mutex);
        return 0;
    }
    uint64_t last;
    while (LOAD(&completed) < (last = LOAD(&published))) { /* another caller's job runs */
        pthread_mutex_unlock(&team_mutex);
        ft_cpu_experts_wait(last);
        pthread_mutex_lock(&team_mutex);
    }
    return LOAD(&published) + 1;
}

/* Publishes job `gen` (described by j) to the team and releases team_mutex. */
static uint64_t publish(const job_t *j, uint64_t gen, int64_t items) {
    jobs[gen & 1] = *j;
    ready_until = 0.0; /* a prepared team sleeps again after this job */
    job_started[gen & 1] = now();
    STORE(&gate_done, 0);
    STORE(&items_done, 0);
    STORE(&claim, (gen & 0xffffffffu) << 32);
    STORE(&published, gen);
    if (items == 0) {
        job_seconds[gen & 1] = 0.0;
        STORE(&completed, gen);
    }
    int wake = sleeping_workers;
    pthread_mutex_unlock(&team_mutex);
    /* After unlocking: woken workers would otherwise block at once on the mutex still held
     * here. No wake-up is lost: a worker counts itself asleep and checks `published` under
     * the mutex, so it either saw this job or waits on the condition before this broadcast. */
    if (wake) pthread_cond_broadcast(&work_cond);
    return gen;
}

/* Starts a job on `threads` team threads (the caller of ft_cpu_experts_wait joins them) and
 * returns its ticket for ft_cpu_experts_wait, after waiting for the job before it. The job is
 * `n_routes` routes (row of x, flat expert id, gate weight) in any order, over x [n_rows, H]
 * (bf16 when x_bf16, else fp32), into out [n_rows, H] (fp32, zeroed here). The experts: each
 * projection's weights w, scales s and per-row scales g and fp8's block (bn rows, bk columns)
 * as `fmt` (the down projection: `fmt_down`) stores them (FMT_DENSE: w only, in `dtype`; the
 * two differ only where neither is mxfp4 or nvfp4, whose split routes read x split for `fmt`),
 * computed in `dtype`; the
 * gate/up biases b_gate_up [P, 2I] in `dtype`, or NULL. The routes and x are copied before
 * this returns; `out` must stay alive until the job is waited for. *experts receives the
 * number of distinct experts the job reads. Returns 0 if no thread can be started or the
 * job's buffers cannot be allocated. */
uint64_t ft_cpu_experts_submit(int dtype, int fmt, int fmt_down, const void *w_gate_up, const void *s_gate_up,
                               const float *g_gate_up, int64_t bn_gate_up, int64_t bk_gate_up,
                               const void *w_down, const void *s_down, const float *g_down,
                               int64_t bn_down, int64_t bk_down, const void *b_gate_up, int64_t H,
                               int64_t I, const void *x, int x_bf16, int64_t n_rows,
                               int64_t n_routes, const int64_t *route_row,
                               const int64_t *route_pair, const float *route_w, float *out,
                               int act, int threads, int64_t *experts) {
    pthread_once(&tables_once, init_tables);
    uint64_t gen = begin_job(threads);
    if (!gen) return 0;
    job_t j = {.dtype = dtype, .act = act, .workers = threads, .fmt = fmt, .H = H, .I = I};
    j.gate_up = (proj_t){fmt, w_gate_up, s_gate_up, g_gate_up, bn_gate_up, bk_gate_up};
    j.down = (proj_t){fmt_down, w_down, s_down, g_down, bn_down, bk_down};
    j.kind = JOB_EXPERTS;
    j.b_gate_up = b_gate_up;
    if (!build_job(&j, gen & 1, x, x_bf16, n_rows, n_routes, route_row, route_pair, route_w,
                   out)) {
        pthread_mutex_unlock(&team_mutex);
        return 0;
    }
    *experts = j.n_groups;
    return publish(&j, gen, j.gate_items + j.down_items);
}

/* Starts a dense layer on the team: out [T, N] (fp32, each value rounded as torch rounds the
 * layer's output dtype) = x [T, H] . w [N, H]^T + bias (bias [N] or NULL; w and bias in
 * `dtype`, x bf16 when x_bf16, else fp32). x is copied before this returns; wait with
 * ft_cpu_experts_wait. Returns 0 if no thread can be started or memory runs out. */
uint64_t ft_cpu_linear_submit(int dtype, const void *w, const void *bias, int64_t N, int64_t H,
                              const void *x, int x_bf16, int64_t T, float *out, int threads) {
    uint64_t gen = begin_job(threads);
    if (!gen) return 0;
    /* x copied into the slot's buffer, in the weights' dtype (the layer's dtype: exact). */
    const size_t item = dtype == DT_BF16 ? sizeof(uint16_t) : sizeof(float);
    void *xc = grow(&scratch[gen & 1][B_X], item * T * H);
    if (!xc || (dtype == DT_BF16) != (x_bf16 != 0)) {
        pthread_mutex_unlock(&team_mutex);
        return 0;
    }
    memcpy(xc, x, item * T * H);
    job_t j = {dtype, 0, threads};
    j.kind = JOB_LINEAR;
    j.w = w;
    j.bias = bias;
    j.N = N;
    j.H = H;
    j.T = T;
    j.x = xc;
    j.x16 = xc;
    j.out = out;
    j.gate_items = (N + ROW_BLOCK - 1) / ROW_BLOCK; /* (the count run_items reads) */
    j.down_items = 0;
    return publish(&j, gen, j.gate_items);
}

/* A job over the rows of one quantized weight [N, K] (JOB_QLINEAR, JOB_DEQUANTIZE): its items
 * gate_rows rows each. */
static job_t weight_job(int kind, int dtype, int fmt, const void *w, const void *s, const float *g,
                        int64_t bn, int64_t bk, int64_t N, int64_t K, int threads) {
    job_t j = {dtype, 0, threads};
    j.kind = kind;
    j.fmt = fmt;
    j.gate_up = (proj_t){fmt, w, s, g, bn, bk};
    j.N = N;
    j.H = K;
    j.gate_rows = item_rows(&j, N);
    j.gate_items = (N + j.gate_rows - 1) / j.gate_rows;
    j.down_items = 0;
    return j;
}

/* Starts a dense layer kept quantized on the team: out [T, N] (fp32, each value rounded to
 * `dtype`) = x [T, H] . W [N, H]^T + bias, W stored as `fmt` (w, s, g and fp8's block: bn rows,
 * bk columns, as ft_cpu_experts_submit takes one expert's projection), bias [N] in `dtype` or
 * NULL, x in `dtype` (bf16 when x_bf16). Each value is the dense layer's on W dequantized to
 * `dtype` (ft_cpu_linear_submit's). x is copied before this returns; wait with
 * ft_cpu_experts_wait. Returns 0 if no thread can be started or memory runs out. */
uint64_t ft_cpu_qlinear_submit(int dtype, int fmt, const void *w, const void *s, const float *g,
                               int64_t bn, int64_t bk, const void *bias, int64_t N, int64_t H,
                               const void *x, int x_bf16, int64_t T, float *out, int threads) {
    pthread_once(&tables_once, init_tables);
    uint64_t gen = begin_job(threads);
    if (!gen) return 0;
    const int bf16 = dtype == DT_BF16;
    const size_t item = bf16 ? sizeof(uint16_t) : sizeof(float);
    buf_t *b = scratch[gen & 1];
    void *xc = grow(&b[B_X], item * T * H);
    const int split = T == 1 && qdot_split(fmt, bf16);
    float *xs = split ? grow(&b[B_A_SPLIT], sizeof(float) * H) : NULL;
    if (!xc || (split && !xs) || bf16 != (x_bf16 != 0) || fmt == FMT_DENSE) {
        pthread_mutex_unlock(&team_mutex);
        return 0;
    }
    memcpy(xc, x, item * T * H);
    if (split) split_x(fmt, xc, H, xs);
    job_t j = weight_job(JOB_QLINEAR, dtype, fmt, w, s, g, bn, bk, N, H, threads);
    j.bias = bias;
    j.T = T;
    j.x = xc;
    j.x16 = xc;
    j.xs = xs;
    j.out = out;
    return publish(&j, gen, j.gate_items);
}

/* Starts the dequantizing of a weight stored as `fmt` (as ft_cpu_qlinear_submit takes it) on the
 * team: dense [N, K] in `dtype`, each value as the jobs decode it. Wait with
 * ft_cpu_experts_wait; 0 if no thread can be started. */
uint64_t ft_cpu_dequantize_submit(int dtype, int fmt, const void *w, const void *s,
                                  const float *g, int64_t bn, int64_t bk, int64_t N, int64_t K,
                                  void *dense, int threads) {
    pthread_once(&tables_once, init_tables);
    uint64_t gen = begin_job(threads);
    if (!gen) return 0;
    if (fmt == FMT_DENSE) {
        pthread_mutex_unlock(&team_mutex);
        return 0;
    }
    job_t j = weight_job(JOB_DEQUANTIZE, dtype, fmt, w, s, g, bn, bk, N, K, threads);
    j.dense = dense;
    return publish(&j, gen, j.gate_items);
}

/* Starts decode attention over the paged KV cache on the team: one query per sequence,
 * q [B, heads, D] (in the pools' dtype, copied here) against each sequence's first lengths[b]
 * keys, found through row rows[b] of table [*, width] (page ids; a position p lives at slot
 * table[row, p / page] * page + p % page of the [slots, kv_heads, D] pools), the last `window`
 * of them when window > 0, with each head's sink logit in the softmax's denominator when
 * sinks is given (fp32 [heads]). out [B, heads, D] fp32. rows, lengths and sinks are copied;
 * the pools and table are read in place until the job is waited for. */
uint64_t ft_cpu_attention_submit(int dtype, const void *q, const void *k_pool,
                                 const void *v_pool, const int64_t *table, int64_t width,
                                 int64_t page, const int64_t *rows, const int64_t *lengths,
                                 int64_t B, int64_t heads, int64_t kv_heads, int64_t D,
                                 int64_t window, float scale, const float *sinks, float *out,
                                 int threads) {
    const int64_t G = heads / kv_heads;
    if (G > ATTN_MAX_GROUP || heads % kv_heads) return 0;
    uint64_t gen = begin_job(threads);
    if (!gen) return 0;
    buf_t *b = scratch[gen & 1];
    /* Splits so the team has work: two items per thread, but never splits under a block. */
    int64_t longest = 0;
    for (int64_t i = 0; i < B; i++) longest = lengths[i] > longest ? lengths[i] : longest;
    int64_t splits = (2 * (threads + 1) + B * kv_heads - 1) / (B * kv_heads);
    const int64_t most = (longest + ATTN_BLOCK - 1) / ATTN_BLOCK;
    splits = splits > most ? most : splits;
    splits = splits < 1 ? 1 : splits;
    const size_t item = dtype == DT_BF16 ? sizeof(uint16_t) : sizeof(float);
    void *qc = grow(&b[B_X], item * B * heads * D);
    float *acc = grow(&b[B_A], sizeof(float) * B * heads * splits * (D + 2));
    int64_t *meta = grow(&b[B_META], sizeof(int64_t) * 2 * B + sizeof(float) * heads);
    if (!qc || !acc || !meta) {
        pthread_mutex_unlock(&team_mutex);
        return 0;
    }
    memcpy(qc, q, item * B * heads * D);
    memcpy(meta, rows, sizeof(int64_t) * B);
    memcpy(meta + B, lengths, sizeof(int64_t) * B);
    float *sink = sinks ? (float *)(meta + 2 * B) : NULL;
    if (sink) memcpy(sink, sinks, sizeof(float) * heads);
    job_t j = {dtype, 0, threads};
    j.kind = JOB_ATTENTION;
    j.x = qc;
    j.x16 = qc;
    j.k_pool = k_pool;
    j.v_pool = v_pool;
    j.table = table;
    j.rows = meta;
    j.lengths = meta + B;
    j.sinks = sink;
    j.B = B;
    j.heads = heads;
    j.kv_heads = kv_heads;
    j.D = D;
    j.page = page;
    j.width = width;
    j.window = window;
    j.splits = splits;
    j.scale = scale;
    j.part_acc = acc;
    j.part_m = acc + B * heads * splits * D;
    j.part_l = j.part_m + B * heads * splits;
    j.out = out;
    j.gate_items = B * kv_heads * splits;
    j.down_items = B * heads;
    return publish(&j, gen, j.gate_items + j.down_items);
}

/* ---- a decode step's row operations ---------------------------------------------------
 *
 * RMSNorm (with the residual add before it) and the rotary embedding of a few rows, on the
 * calling thread: at decode each is a few thousand values, so torch's half-dozen ops a norm
 * and a rotation (each a dispatch of several microseconds on a CPU) cost more than the
 * arithmetic; these take one call each. Each rounds as the reference does (layers/norm.py,
 * layers/rope.py), like the GPU's kernels (kernels/norm_rope.py): only the norm's sum of
 * squares may differ in its last fp32 bit (its order). */

static inline float load_value(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

enum { NORM_LLAMA = 0, NORM_SCALE_FP32 = 1, NORM_ZERO_CENTERED = 2 };

/* T rows of H: with delta (else NULL), s = x + delta rounded to the dtype, written to `sum`,
 * then out = RMSNorm(s) (of x where delta is NULL). x, delta, weight, sum and out all in the
 * dtype; out may not alias x. mode: NORM_LLAMA (the normalised row rounded, then scaled),
 * NORM_SCALE_FP32 (scaled in fp32, then rounded), NORM_ZERO_CENTERED (by 1 + weight, fp32). */
void ft_cpu_rms_norm(int dtype, const void *x, const void *delta, const void *weight, int64_t T,
                     int64_t H, float eps, int mode, void *sum, void *out) {
    const int bf16 = dtype == DT_BF16;
    for (int64_t t = 0; t < T; t++) {
        const int64_t base = t * H;
        const void *row = x;
        if (delta) {
            for (int64_t i = 0; i < H; i++)
                put(sum, base + i,
                            load_value(x, base + i, bf16) + load_value(delta, base + i, bf16),
                            bf16);
            row = sum;
        }
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= H; i += 16)
            for (int l = 0; l < 16; l++) {
                const float v = load_value(row, base + i + l, bf16);
                acc[l] += v * v;
            }
        for (; i < H; i++) {
            const float v = load_value(row, base + i, bf16);
            acc[0] += v * v;
        }
        float squares = 0.0f;
        for (int l = 0; l < 16; l++) squares += acc[l];
        const float inv = 1.0f / sqrtf(squares / (float)H + eps);
        for (i = 0; i < H; i++) {
            const float h = load_value(row, base + i, bf16) * inv, w = load_value(weight, i, bf16);
            const float y = mode == NORM_ZERO_CENTERED ? h * (1.0f + w)
                            : mode == NORM_SCALE_FP32  ? w * h
                                                       : w * rnd(h, bf16);
            put(out, base + i, y, bf16);
        }
    }
}

/* out [T, heads, D] (contiguous) = x rotated by cos, sin [T, rot] (rows `c_stride` apart):
 * x * cos + rotate_half(x) * sin over the first rot dimensions, each product and the sum
 * rounded to the dtype as torch rounds them; the rest copied. x's rows and heads lie
 * `x_stride` and `h_stride` values apart (a view of a stacked q/k/v projection). */
void ft_cpu_rotary(int dtype, const void *x, int64_t x_stride, int64_t h_stride, int64_t T,
                   int64_t heads, int64_t D, const void *cos, const void *sin, int64_t c_stride,
                   int64_t rot, void *out) {
    const int bf16 = dtype == DT_BF16;
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t in = t * x_stride + h * h_stride, at = (t * heads + h) * D;
            const int64_t c = t * c_stride;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = load_value(x, in + i, bf16), x2 = load_value(x, in + half + i, bf16);
                const float c1 = load_value(cos, c + i, bf16), c2 = load_value(cos, c + half + i, bf16);
                const float s1 = load_value(sin, c + i, bf16), s2 = load_value(sin, c + half + i, bf16);
                const float a1 = rnd(x1 * c1, bf16), b1 = rnd(-x2 * s1, bf16);
                const float a2 = rnd(x2 * c2, bf16), b2 = rnd(x1 * s2, bf16);
                put(out, at + i, a1 + b1, bf16);
                put(out, at + half + i, a2 + b2, bf16);
            }
            for (int64_t i = rot; i < D; i++)
                put(out, at + i, load_value(x, in + i, bf16), bf16);
        }
}

/* ---- the device's doorbell ---------------------------------------------------------------
 *
 * A decode step captured in one CUDA graph hands each MoE layer's CPU share to this library
 * with no host call (moe/doorbell.py). Three words of mapped pinned memory, each written by
 * one side only: the device's plan kernel writes the layer's routes, gate weights and
 * activations into mapped buffers, then `shape` (tokens << 20 | top_k << 12 | layer + 1) and,
 * last, with a system-scope release, `seq`: a number that changes with every ring. A listener
 * thread started here watches `seq`: when it differs from the last one served, it reads the
 * shape, runs the routes whose pair is >= 0 on the team (joining it, as a waiting caller
 * does), writes the fp32 partial to `out` and answers by writing the same number to `done`;
 * the device's merge kernel, queued after the GPU's share, spins until `done` holds it and adds
 * the partial. Nothing is ever cleared, so neither side writes a word the other writes. The
 * listener spins while steps come (pause loops, one core), polls every 20 us once idle for
 * `idle_spin` seconds and every millisecond after a second. */

typedef struct {
    const uint32_t *seq, *shape;
    uint32_t *done;
    const int64_t *pairs;
    const float *weights;
    const void *x;
    float *out;
    int x_bf16, dtype, act, threads;
    int64_t max_routes, H, I, layers;
    proj_t gate_up, down; /* the experts, as ft_cpu_experts_submit takes them */
    const void *b_gate_up;
    double *stats; /* per layer: jobs, routes, seconds, experts (accumulated); then a row of
                    * their sums, then one whose first value counts the steps not served */
    double idle_spin, prepare;
    int stop;
    uint32_t served; /* the last number answered: the one `seq` held at start, then each job's */
    int64_t *rows, *routes;
    float *gates;
    pthread_t thread;
} listener_t;

static void count_error(listener_t *l) { l->stats[4 * (l->layers + 1)] += 1.0; }

static void serve(listener_t *l, uint32_t shape) {
    const int64_t layer = (int64_t)(shape & 0xfffu) - 1, k = (shape >> 12) & 0xffu;
    const int64_t tokens = shape >> 20;
    if (layer < 0 || layer >= l->layers || k < 1 || tokens * k > l->max_routes) {
        count_error(l); /* and no partial: the merge must not add an earlier layer's */
        const int64_t rows = tokens < 1 ? 1 : (tokens > l->max_routes ? l->max_routes : tokens);
        memset(l->out, 0, sizeof(float) * rows * l->H);
        return;
    }
    int64_t n = 0;
    for (int64_t r = 0; r < tokens * k; r++)
        if (l->pairs[r] >= 0) {
            l->rows[n] = r / k;
            l->routes[n] = l->pairs[r];
            l->gates[n++] = l->weights[r];
        }
    if (!n) {
        memset(l->out, 0, sizeof(float) * tokens * l->H);
        return;
    }
    int64_t experts = 0;
    const proj_t *gu = &l->gate_up, *d = &l->down;
    uint64_t ticket = ft_cpu_experts_submit(
        l->dtype, gu->fmt, d->fmt, gu->w, gu->s, gu->g, gu->bn, gu->bk, d->w, d->s, d->g, d->bn, d->bk,
        l->b_gate_up, l->H, l->I, l->x, l->x_bf16, tokens, n, l->rows, l->routes, l->gates, l->out,
        l->act, l->threads, &experts);
    if (!ticket) { /* no thread or no memory: a zero partial, counted, and the graph goes on */
        memset(l->out, 0, sizeof(float) * tokens * l->H);
        count_error(l);
        return;
    }
    double seconds = ft_cpu_experts_wait(ticket);
    double *s = l->stats + 4 * layer, *sums = l->stats + 4 * l->layers;
    const double add[4] = {1.0, (double)n, seconds, (double)experts};
    for (int c = 0; c < 4; c++) {
        s[c] += add[c];
        sums[c] += add[c];
    }
}

static void *listener_main(void *arg) {
    listener_t *l = arg;
    double last = now();
    while (!LOAD(&l->stop)) {
        const uint32_t seq = __atomic_load_n(l->seq, __ATOMIC_ACQUIRE);
        if (seq == l->served) {
            const double idle = now() - last;
            if (idle < l->idle_spin) {
                for (int i = 0; i < 32; i++) cpu_relax();
            } else { /* 20 us polls, 1 ms ones after a second without steps */
                struct timespec pause = {0, idle < 1.0 ? 20000 : 1000000};
                nanosleep(&pause, NULL);
            }
            continue;
        }
        l->served = seq;
        if (now() - last > l->prepare) ft_cpu_experts_prepare(l->prepare); /* wake the team */
        serve(l, __atomic_load_n(l->shape, __ATOMIC_ACQUIRE));
        __atomic_store_n(l->done, seq, __ATOMIC_SEQ_CST); /* after the partial's stores */
        /* The next layer's job comes within a layer step: the team waits for it awake rather
         * than asleep (a futex wake-up of every thread per layer otherwise). Off the GPU's
         * path: done is written. */
        ft_cpu_experts_prepare(l->prepare);
        last = now();
    }
    return NULL;
}

/* Starts a listener (see above); NULL if its thread or buffers cannot be had. `pairs` and
 * `weights` hold max_routes entries, x and out max_routes rows. The experts and `dtype` as
 * ft_cpu_experts_submit takes them; `threads`: the team threads of each job (the listener
 * joins them). */
void *ft_listener_start(const uint32_t *seq, const uint32_t *shape, uint32_t *done,
                        const int64_t *pairs, const float *weights, const void *x, int x_bf16,
                        float *out, int64_t max_routes, int dtype, int fmt, int fmt_down,
                        const void *w_gate_up, const void *s_gate_up, const float *g_gate_up,
                        int64_t bn_gate_up, int64_t bk_gate_up, const void *w_down,
                        const void *s_down, const float *g_down, int64_t bn_down,
                        int64_t bk_down, const void *b_gate_up, int64_t H, int64_t I, int act,
                        int threads, double *stats, int64_t layers, double idle_spin,
                        double prepare) {
    listener_t *l = calloc(1, sizeof(listener_t));
    if (!l) return NULL;
    *l = (listener_t){.seq = seq, .shape = shape, .done = done, .pairs = pairs,
                      .weights = weights, .x = x, .out = out, .x_bf16 = x_bf16, .dtype = dtype,
                      .act = act, .threads = threads, .max_routes = max_routes,
                      .H = H, .I = I, .layers = layers, .b_gate_up = b_gate_up, .stats = stats,
                      .idle_spin = idle_spin, .prepare = prepare};
    l->gate_up = (proj_t){fmt, w_gate_up, s_gate_up, g_gate_up, bn_gate_up, bk_gate_up};
    l->down = (proj_t){fmt_down, w_down, s_down, g_down, bn_down, bk_down};
    /* read here, not on the thread: a ring made before the thread first runs is a job */
    l->served = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
    const size_t routes = (size_t)max_routes;
    l->rows = malloc(sizeof(int64_t) * routes);
    l->routes = malloc(sizeof(int64_t) * routes);
    l->gates = malloc(sizeof(float) * routes);
    if (!l->rows || !l->routes || !l->gates ||
        pthread_create(&l->thread, NULL, listener_main, l) != 0) {
        free(l->rows);
        free(l->routes);
        free(l->gates);
        free(l);
        return NULL;
    }
    return l;
}

/* Stops and frees a listener; no graph may still ring it. */
void ft_listener_stop(void *handle) {
    listener_t *l = handle;
    STORE(&l->stop, 1);
    pthread_join(l->thread, NULL);
    free(l->rows);
    free(l->routes);
    free(l->gates);
    free(l);
}
