/* Dot products of a weight row with x (part of cpu_native.c's translation unit, after the
 * decoders): dense rows in fp32 and bf16 (dot_f32, dot_bf16_bf16), and quantized rows decoded in
 * registers straight into the same sums (qdot_bf16, qdot_f32; AVX-512), GGUF's block formats in
 * bf16 jobs by their scaled codes. The items of cpu_experts.c and cpu_layers.c compute with them
 * (weight_row and row_dot pick the way for a row). */

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
FT_INLINE void nv_block_dots(const qrow_t *a, const qrow_t *b, int64_t K, const float *xs,
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
FT_INLINE __m512 scaled_block(__m512 acc, __m512i codes, __m512 sv, float mn, int has_min,
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
FT_INLINE __m512i legacy_codes(int fmt, const uint8_t *w, const legacy_t *p) {
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
FT_INLINE void kq_codes_pair(int fmt, const uint8_t *w, const uint8_t *s, int g, __m512i *lo,
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
FT_INLINE __m512i q6k_codes(const uint8_t *w, const uint8_t *s, int c) {
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
FT_INLINE void scaled_rows_of(const int fmt, const int ROWS, const qrow_t *const *q, int64_t K,
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

/* qdot_bf16's steps, each format's loop as it was in qdot_bf16: products added into the four
 * accumulators a[0..3], 128 values a step (a 32-value word into each), from column 0; each
 * returns the column its whole steps reached. */
#define QDOT_STEP(w0, w1, w2, w3)                                                               \
    do {                                                                                        \
        a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)(w0), (__m512bh)_mm512_loadu_si512(x + k));    \
        a[1] = _mm512_dpbf16_ps(a[1], (__m512bh)(w1), (__m512bh)_mm512_loadu_si512(x + k + 32)); \
        a[2] = _mm512_dpbf16_ps(a[2], (__m512bh)(w2), (__m512bh)_mm512_loadu_si512(x + k + 64)); \
        a[3] = _mm512_dpbf16_ps(a[3], (__m512bh)(w3), (__m512bh)_mm512_loadu_si512(x + k + 96)); \
    } while (0)
#define PAIRS_STEP(acc, i, e, o)                                                                \
    do {                                                                                        \
        acc = _mm512_fmadd_ps(o, _mm512_loadu_ps(xs + k + 32 * (i) + 16), acc);                 \
        acc = _mm512_fmadd_ps(e, _mm512_loadu_ps(xs + k + 32 * (i)), acc);                      \
    } while (0)

/* mxfp4 by the pairs route (xs: x split by split_pairs). */
FT_INLINE int64_t mx_pairs_steps(const qrow_t *q, int64_t K, const float *xs, __m512 a[4]) {
    int64_t k = 0;
    __m512 e, o;
    for (; k + 128 <= K; k += 128) {
        const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32;
        PREFETCH(w + PREFETCH_BYTES);
        PREFETCH(s + PREFETCH_BYTES / 16);
        mx_pairs(w, s[0], &e, &o);
        PAIRS_STEP(a[0], 0, e, o);
        mx_pairs(w + 16, s[1], &e, &o);
        PAIRS_STEP(a[1], 1, e, o);
        mx_pairs(w + 32, s[2], &e, &o);
        PAIRS_STEP(a[2], 2, e, o);
        mx_pairs(w + 48, s[3], &e, &o);
        PAIRS_STEP(a[3], 3, e, o);
    }
    return k;
}

FT_INLINE int64_t mx_steps_bf16(const qrow_t *q, int64_t K, const uint16_t *x, __m512 a[4]) {
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32;
        PREFETCH(w + PREFETCH_BYTES);
        PREFETCH(s + PREFETCH_BYTES / 16);
        uint32_t s4; /* (the four scales in one load: 3-5% faster than four) */
        memcpy(&s4, s, 4);
        QDOT_STEP(mx_bf16(w, (uint8_t)s4), mx_bf16(w + 16, (uint8_t)(s4 >> 8)),
                  mx_bf16(w + 32, (uint8_t)(s4 >> 16)), mx_bf16(w + 48, (uint8_t)(s4 >> 24)));
    }
    return k;
}

FT_INLINE int64_t nv_steps_bf16(const qrow_t *q, int64_t K, const uint16_t *x, __m512 a[4]) {
    int64_t k = 0;
    const nv_rows_t t = nv_table(q->g, NV_WORDS)->t;
    for (; k + 128 <= K; k += 128) {
        const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 16;
        PREFETCH(w + PREFETCH_BYTES);
        PREFETCH(s + PREFETCH_BYTES / 8);
        uint64_t s8; /* (the eight scales in one load, as mxfp4's four) */
        memcpy(&s8, s, 8);
#define NV_S(i) ((unsigned)(s8 >> (8 * (i))) & 0xff)
        QDOT_STEP(nv_bf16(w, NV_S(0), NV_S(1), 1, t), nv_bf16(w + 16, NV_S(2), NV_S(3), 1, t),
                  nv_bf16(w + 32, NV_S(4), NV_S(5), 1, t), nv_bf16(w + 48, NV_S(6), NV_S(7), 1, t));
#undef NV_S
    }
    return k;
}

FT_INLINE int64_t q8_steps_bf16(const qrow_t *q, int64_t K, const uint16_t *x, __m512 a[4]) {
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        const uint8_t *w = q->w + k;
        const uint16_t *s = q->s16 + k / 32;
        PREFETCH(w + PREFETCH_BYTES);
        PREFETCH(w + PREFETCH_BYTES + 64);
        PREFETCH(s + PREFETCH_BYTES / 32);
        QDOT_STEP(q8_bf16(w, _cvtsh_ss(s[0])), q8_bf16(w + 32, _cvtsh_ss(s[1])),
                  q8_bf16(w + 64, _cvtsh_ss(s[2])), q8_bf16(w + 96, _cvtsh_ss(s[3])));
    }
    return k;
}

#if !FP8_TABLES /* (a build without fp8 tables passes NULL for them) */
typedef struct fp8_table fp8_table_t;
#endif

/* fp8 in blocks of a multiple of 128 columns: by the row's tables where there are, else by the
 * f16 route. */
FT_INLINE int64_t fp8_steps_bf16(const qrow_t *q, int64_t K, const uint16_t *x,
                                 const fp8_table_t *tables, __m512 a[4]) {
    int64_t k = 0;
#if FP8_TABLES
    const fp8_table_t *t = tables;
    /* (bk is a multiple of 128: the step's block moves on at the block's end, no division a
     * step) */
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
#else
    (void)tables;
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
    return k;
}
#undef QDOT_STEP
#undef PAIRS_STEP

/* The rest of a row from column k as dot_bf16_bf16 takes it: 32 values a step into a[0], the
 * last (< 32) decoded into `tail` and read by masked loads. (32-value steps never straddle an
 * fp8 block: its columns are a multiple of 128 here.) */
FT_INLINE void rest_bf16(const qrow_t *q, int64_t k, int64_t K, const uint16_t *x,
                         const fp8_table_t *tables, uint16_t *tail, __m512 a[4]) {
    if (q->fmt == FMT_MXFP4) {
        for (; k + 32 <= K; k += 32)
            a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)mx_bf16(q->w + k / 2, q->s8[k / 32]),
                                    (__m512bh)_mm512_loadu_si512(x + k));
    } else if (q->fmt == FMT_NVFP4) {
        const nv_rows_t t = nv_table(q->g, NV_WORDS)->t;
        for (; k + 32 <= K; k += 32)
            a[0] = _mm512_dpbf16_ps(a[0],
                                    (__m512bh)nv_bf16(q->w + k / 2, q->s8[k / 16],
                                                      q->s8[k / 16 + 1], 1, t),
                                    (__m512bh)_mm512_loadu_si512(x + k));
    } else if (q->fmt == FMT_Q8_0) {
        for (; k + 32 <= K; k += 32)
            a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)q8_bf16(q->w + k, _cvtsh_ss(q->s16[k / 32])),
                                    (__m512bh)_mm512_loadu_si512(x + k));
    } else {
#if FP8_TABLES
        for (; tables && k + 64 <= K; k += 64) {
            __m512i w0, w1;
            fp8_bf16_64(q->w + k, tables + k / q->bk, &w0, &w1);
            a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x + k));
            a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(x + k + 32));
        }
#else
        (void)tables;
#endif
        for (; k + 32 <= K; k += 32) {
            const fp8_scale_t f = fp8_scale(q->s32[k / q->bk]);
            a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)fp8_bf16(q->w + k, &f),
                                    (__m512bh)_mm512_loadu_si512(x + k));
        }
    }
    if (k < K) {
        decode_range(q, k, K, 1, tail);
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)_mm512_maskz_loadu_epi16(m, tail),
                                (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
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
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
#if FP8_TABLES /* (the row's, for its steps and its tail) */
    const fp8_table_t *tables =
        q->fmt == FMT_FP8 ? fp8_row_tables(q->s32, (K + q->bk - 1) / q->bk) : NULL;
#else
    const fp8_table_t *tables = NULL;
#endif
    int64_t k;
    if (xs && q->fmt == FMT_MXFP4) {
        k = mx_pairs_steps(q, K, xs, a);
    } else if (xs && q->fmt == FMT_NVFP4) {
        float out;
        nv_block_dots(q, NULL, K, xs, &out);
        return out;
    } else if (q->fmt == FMT_MXFP4) {
        k = mx_steps_bf16(q, K, x, a);
    } else if (q->fmt == FMT_NVFP4) {
        k = nv_steps_bf16(q, K, x, a);
    } else if (q->fmt == FMT_Q8_0) {
        k = q8_steps_bf16(q, K, x, a);
    } else { /* FMT_FP8, blocks of a multiple of 128 columns */
        k = fp8_steps_bf16(q, K, x, tables, a);
    }
    rest_bf16(q, k, K, x, tables, tail, a);
    return _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}
#endif

#if QDOT_F32
/* qdot_f32's steps, each format's loop as it was in qdot_f32: 64 values a step into the
 * accumulators a[0..3] (a product, then a sum, as dot_f32's loop), from column 0; each returns
 * the column its whole steps reached. */
#define QDOT_STEP(w0, w1, w2, w3)                                                               \
    do {                                                                                        \
        a[0] = _mm512_add_ps(a[0], _mm512_mul_ps(w0, _mm512_loadu_ps(x + k)));                  \
        a[1] = _mm512_add_ps(a[1], _mm512_mul_ps(w1, _mm512_loadu_ps(x + k + 16)));             \
        a[2] = _mm512_add_ps(a[2], _mm512_mul_ps(w2, _mm512_loadu_ps(x + k + 32)));             \
        a[3] = _mm512_add_ps(a[3], _mm512_mul_ps(w3, _mm512_loadu_ps(x + k + 48)));             \
    } while (0)

FT_INLINE int64_t mx_steps_f32(const qrow_t *q, int64_t K, const float *x, __m512 a[4]) {
    int64_t k = 0;
    __m512 w0, w1, w2, w3;
    for (; k + 64 <= K; k += 64) {
        const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32;
        PREFETCH(w + PREFETCH_BYTES); /* (every other step's: the same line) */
        PREFETCH(s + PREFETCH_BYTES / 16);
        mx_f32(w, s[0], &w0, &w1);
        mx_f32(w + 16, s[1], &w2, &w3);
        QDOT_STEP(w0, w1, w2, w3);
    }
    return k;
}

FT_INLINE int64_t nv_steps_f32(const qrow_t *q, int64_t K, const float *x, __m512 a[4]) {
    int64_t k = 0;
    __m512 w0, w1, w2, w3;
    for (; k + 64 <= K; k += 64) {
        const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 16;
        PREFETCH(w + PREFETCH_BYTES);
        PREFETCH(s + PREFETCH_BYTES / 8);
        nv_f32(w, s, 1, q->g, &w0, &w1);
        nv_f32(w + 16, s + 2, 1, q->g, &w2, &w3);
        QDOT_STEP(w0, w1, w2, w3);
    }
    return k;
}

FT_INLINE int64_t q8_steps_f32(const qrow_t *q, int64_t K, const float *x, __m512 a[4]) {
    int64_t k = 0;
    __m512 w0, w1, w2, w3;
    for (; k + 64 <= K; k += 64) {
        PREFETCH(q->w + k + PREFETCH_BYTES);
        q8_f32(q->w + k, _cvtsh_ss(q->s16[k / 32]), &w0, &w1);
        q8_f32(q->w + k + 32, _cvtsh_ss(q->s16[k / 32 + 1]), &w2, &w3);
        QDOT_STEP(w0, w1, w2, w3);
    }
    return k;
}

/* The K-quants in whole blocks of 256: four steps each. */
FT_INLINE int64_t kq_steps_f32(const qrow_t *q, int64_t K, const float *x, __m512 a[4]) {
    int64_t k = 0;
    __m512 w0, w1, w2, w3;
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
    return k;
}

FT_INLINE int64_t legacy_steps_f32(const qrow_t *q, int64_t K, const float *x, __m512 a[4]) {
    int64_t k = 0;
    __m512 w0, w1, w2, w3;
    for (; k + 64 <= K; k += 64) {
        const uint8_t *w = q->w + k / 2, *s = q->s8 + k / 32 * q->rest;
        PREFETCH(w + PREFETCH_BYTES);
        PREFETCH(s + PREFETCH_BYTES / 2);
        legacy_f32(q->fmt, w, s, &w0, &w1);
        legacy_f32(q->fmt, w + 16, s + q->rest, &w2, &w3);
        QDOT_STEP(w0, w1, w2, w3);
    }
    return k;
}

/* fp8 in blocks of a multiple of 64 columns. */
FT_INLINE int64_t fp8_steps_f32(const qrow_t *q, int64_t K, const float *x, __m512 a[4]) {
    int64_t k = 0;
    __m512 w0, w1, w2, w3;
    for (int64_t b = 0; k + 64 <= K; b++) {
        const fp8_scale_t f = fp8_scale(q->s32[b]);
        for (const int64_t end = (b + 1) * q->bk; k + 64 <= K && k < end; k += 64) {
            PREFETCH(q->w + k + PREFETCH_BYTES);
            fp8_f32(q->w + k, &f, &w0, &w1);
            fp8_f32(q->w + k + 32, &f, &w2, &w3);
            QDOT_STEP(w0, w1, w2, w3);
        }
    }
    return k;
}
#undef QDOT_STEP

/* dot_f32 of the decoded row with x: 64 values a step into its 4 x 16 accumulators (a product,
 * then a sum, as its loop), the values past the last whole step through `tail`, then its
 * order: the tail's sum first, the accumulators' lanes after it one by one. */
static float qdot_f32(const qrow_t *q, int64_t K, const float *x, float *tail) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    int64_t k;
    if (q->fmt == FMT_MXFP4)
        k = mx_steps_f32(q, K, x, a);
    else if (q->fmt == FMT_NVFP4)
        k = nv_steps_f32(q, K, x, a);
    else if (q->fmt == FMT_Q8_0)
        k = q8_steps_f32(q, K, x, a);
    else if (is_k_quant(q->fmt))
        k = kq_steps_f32(q, K, x, a);
    else if (is_legacy(q->fmt))
        k = legacy_steps_f32(q, K, x, a);
    else /* FMT_FP8 */
        k = fp8_steps_f32(q, K, x, a);
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

/* Whether this build's bf16 jobs take GGUF's scaled formats by scaled codes (with the file's
 * values: AVX512-BF16's pair dot product), or decode them to their bf16 roundings as the other
 * formats (the dense layer's on the dequantized weight): for tests and the docs' claim. */
int ft_cpu_bf16_scaled_codes(void) {
#if QDOT_BF16
    return 1;
#else
    return 0;
#endif
}
