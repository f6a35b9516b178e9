/* A decode step's other layers on the CPU (part of cpu_native.c's translation unit, after the
 * experts): dense layers, stored (ft_cpu_linear_submit: kernels/cpu_linear.py) or kept quantized
 * (ft_cpu_qlinear_submit, ft_cpu_dequantize_submit: the same) and decode attention over the
 * paged KV cache (ft_cpu_attention_submit: kernels/paged_attention.py), as jobs of the team;
 * RMSNorm and the rotary embedding of a few rows on the calling thread (ft_cpu_rms_norm,
 * ft_cpu_rotary: kernels/norm_rope.py). */

/* ---- dense layers, stored or kept quantized ------------------------------------------------ */

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

/* ---- decode attention over the paged KV cache ---------------------------------------------- */

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
                                 int64_t split_as, int threads) {
    const int64_t G = heads / kv_heads;
    if (G > ATTN_MAX_GROUP || heads % kv_heads) return 0;
    uint64_t gen = begin_job(threads);
    if (!gen) return 0;
    buf_t *b = scratch[gen & 1];
    /* Splits so the team has work: two items per thread, but never splits under a block.
     * Counted for `split_as` sequences: a verify step's queries (each a sequence of its own)
     * split their keys as the decode steps they stand in for, and sum in the same order. */
    int64_t longest = 0;
    for (int64_t i = 0; i < B; i++) longest = lengths[i] > longest ? lengths[i] : longest;
    int64_t splits = (2 * (threads + 1) + split_as * kv_heads - 1) / (split_as * kv_heads);
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
