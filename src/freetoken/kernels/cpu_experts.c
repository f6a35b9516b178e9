/* The routed experts' jobs (part of cpu_native.c's translation unit, after the team): a job's
 * routes grouped by expert (build_job), its gate/up items, then its down items, each reading
 * weight rows as weight_row and row_dot take them (dense, or decoded by cpu_decoders.c and
 * cpu_dots.c); ft_cpu_experts_submit, and ft_cpu_experts_row_dots for tests. The thread of
 * cpu_listener.c submits these jobs too. Python: kernels/cpu_experts.py. */

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
