/* The vector decoders (part of cpu_native.c's translation unit, after cpu_formats.c): AVX-512 or
 * AVX2, as -march=native finds (else cpu_formats.c's scalar ones under their names), which write
 * a row's values in the model's dtype into a buffer; decode_range, which decodes a row's values
 * by them; and the decoding the tests check against the definition (ft_cpu_experts_decode,
 * ft_cpu_experts_decoder_bits: kernels/cpu_banks.py). */

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
