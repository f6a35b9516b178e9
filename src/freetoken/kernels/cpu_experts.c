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
 * Results follow the torch reference (kernels/grouped_experts.py) rounding step for step: for
 * bf16 banks the projections, the activation, its product with up, the down projection and the
 * gate-weighted contribution are each rounded to bf16 where torch rounds them; only the
 * accumulation order inside a dot product differs. Contributions are summed per token in fp32,
 * by expert id and then in the caller's route order.
 */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { DT_BF16 = 0, DT_F32 = 1 };
/* Activation codes: freetoken/activations.py holds the one table, passed as -D defines by
 * kernels/native.py when it compiles this file. */
#if !defined(ACT_SILU) || !defined(ACT_GELU) || !defined(ACT_GELU_TANH) || !defined(ACT_RELU) \
    || !defined(ACT_SWIGLU_OAI)
#error "compile through freetoken.kernels.native, which defines the ACT_* codes"
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

static float dot_bf16(const uint16_t *restrict w, const float *restrict x, int64_t n) {
    float acc[4][16] = {{0}};
    int64_t k = 0;
    for (; k + 64 <= n; k += 64)
        for (int u = 0; u < 4; u++)
            for (int j = 0; j < 16; j++)
                acc[u][j] += bf16_to_f32(w[k + 16 * u + j]) * x[k + 16 * u + j];
    float s = 0.0f;
    for (; k < n; k++) s += bf16_to_f32(w[k]) * x[k];
    for (int u = 0; u < 4; u++)
        for (int j = 0; j < 16; j++) s += acc[u][j];
    return s;
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
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; k < n; k++) s += bf16_to_f32(w[k]) * bf16_to_f32(x[k]);
    return s;
}

/* Row `row` of an expert's [rows, n] matrix at flat id `pair` of a bank, dotted with x. */
static inline float row_dot(int dtype, const void *bank, int64_t pair, int64_t rows, int64_t row,
                            int64_t n, const float *x) {
    int64_t offset = (pair * rows + row) * n;
    if (dtype == DT_BF16) return dot_bf16((const uint16_t *)bank + offset, x, n);
    return dot_f32((const float *)bank + offset, x, n);
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
 * torch would multiply, each already rounded to bf16), for dot_bf16_bf16. */
enum { JOB_EXPERTS = 0, JOB_LINEAR = 1, JOB_ATTENTION = 2 };

typedef struct {
    int dtype, act, workers;
    const void *w_gate_up, *w_down;
    int64_t H, I, n_groups;
    const float *x, *route_w;
    const int64_t *group_start, *group_pair, *route_row;
    float *a_buf, *out;
    uint16_t *a16;
    int64_t gate_items, down_items; /* gate items come first, then down items */
    /* A dense layer (JOB_LINEAR): out [T, N] = x [T, H] . w [N, H]^T + bias, each output
     * rounded as torch rounds it; its items are ROW_BLOCK rows of w, for every row of x. */
    int kind;
    const void *w, *bias;
    const uint16_t *x16; /* with bf16 weights: x in bf16 (else x, fp32) */
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

/* Gate item: ROW_BLOCK rows of one group's gate and up projections, for every route of the
 * group: a[r, n] = act(gate_n . x) * (up_n . x), rounded as torch rounds. */
static void gate_item(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t blocks = (j->I + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t g = item / blocks, n0 = (item % blocks) * ROW_BLOCK;
    const int64_t n1 = n0 + ROW_BLOCK < j->I ? n0 + ROW_BLOCK : j->I;
    const int64_t H = j->H, I = j->I, pair = j->group_pair[g];
    const uint16_t *gu16 = (const uint16_t *)j->w_gate_up + pair * 2 * I * H;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t r = j->group_start[g]; r < j->group_start[g + 1]; r++) {
            float gate, up;
            if (bf16) {
                const uint16_t *xr = j->x16 + j->route_row[r] * H;
                gate = round_bf16(dot_bf16_bf16(gu16 + n * H, xr, H));
                up = round_bf16(dot_bf16_bf16(gu16 + (I + n) * H, xr, H));
            } else {
                const float *xr = j->x + j->route_row[r] * H;
                gate = row_dot(j->dtype, j->w_gate_up, pair, 2 * I, n, H, xr);
                up = row_dot(j->dtype, j->w_gate_up, pair, 2 * I, I + n, H, xr);
            }
            if (j->b_gate_up) { /* torch: (x @ W) + b, each op rounded */
                gate = rnd(gate + bias_at(j, pair * 2 * I + n), bf16);
                up = rnd(up + bias_at(j, pair * 2 * I + I + n), bf16);
            }
            /* swiglu_oai rounded once (torch rounds it op by op: a rounding apart in bf16) */
            float a = j->act == ACT_SWIGLU_OAI ? rnd(swiglu_oai(gate, up), bf16)
                                               : rnd(rnd(activate(gate, j->act), bf16) * up, bf16);
            if (bf16)
                j->a16[r * I + n] = bf16_bits(a);
            else
                j->a_buf[r * I + n] = a;
        }
}

/* Down item: ROW_BLOCK output columns, over every group and route in route order, so each
 * output element is summed by one thread in a fixed order (deterministic):
 * out[row_r, n] += round(route_w[r] * round(down_n . a[r])). */
static void down_item(const job_t *j, int64_t item) {
    const int bf16 = j->dtype == DT_BF16;
    const int64_t H = j->H, I = j->I, n0 = item * ROW_BLOCK;
    const int64_t n1 = n0 + ROW_BLOCK < H ? n0 + ROW_BLOCK : H;
    for (int64_t g = 0; g < j->n_groups; g++)
        for (int64_t n = n0; n < n1; n++)
            for (int64_t r = j->group_start[g]; r < j->group_start[g + 1]; r++) {
                float y = bf16 ? round_bf16(dot_bf16_bf16(
                                     (const uint16_t *)j->w_down + (j->group_pair[g] * H + n) * I,
                                     j->a16 + r * I, I))
                               : row_dot(j->dtype, j->w_down, j->group_pair[g], H, n, I,
                                         j->a_buf + r * I);
                j->out[j->route_row[r] * H + n] += rnd(y * j->route_w[r], bf16);
            }
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

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#define MAX_TEAM 1024
#define LOAD(p) __atomic_load_n(p, __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n(p, v, __ATOMIC_SEQ_CST)
#define ADD(p, v) __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST)

static pthread_mutex_t team_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cond = PTHREAD_COND_INITIALIZER; /* a job was published */
static pthread_cond_t done_cond = PTHREAD_COND_INITIALIZER; /* a job was completed */
static job_t jobs[2];
static double job_started[2], job_seconds[2];
static uint64_t claim, published, completed;
static int64_t gate_done, items_done;
static int team_size = 0, sleeping_workers = 0, sleeping_waiters = 0;
static double ready_until = 0.0; /* ft_cpu_experts_prepare: stay awake until then */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

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
        if (j->kind == JOB_LINEAR) {
            linear_item(j, item);
        } else if (item < j->gate_items) {
            if (j->kind == JOB_ATTENTION)
                attention_partial(j, item);
            else
                gate_item(j, item);
            ADD(&gate_done, 1);
        } else {
            /* Phase 2 items read every phase 1 item's output; all are taken by now, and each
             * takes microseconds. */
            while (LOAD(&gate_done) < j->gate_items) cpu_relax();
            if (j->kind == JOB_ATTENTION)
                attention_merge(j, item - j->gate_items);
            else
                down_item(j, item - j->gate_items);
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
enum { B_X, B_A, B_GROUP_START, B_GROUP_PAIR, B_ROW, B_W, B_ORDER, B_META, N_BUFS };
static buf_t scratch[2][N_BUFS];

static void *grow(buf_t *b, size_t bytes) {
    if (bytes > b->cap) {
        void *q = realloc(b->p, bytes ? bytes : 1);
        if (!q) return NULL;
        b->p = q;
        b->cap = bytes;
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
    if (!xs || !a || !start || !pair || !row || !w || !order) return 0;
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
    j->x = xs;
    j->x16 = xs;
    j->route_w = w;
    j->group_start = start;
    j->group_pair = pair;
    j->route_row = row;
    j->a_buf = a;
    j->a16 = (uint16_t *)a;
    j->out = out;
    j->gate_items = groups * ((I + ROW_BLOCK - 1) / ROW_BLOCK);
    j->down_items = groups ? (H + ROW_BLOCK - 1) / ROW_BLOCK : 0;
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
 * (bf16 when x_bf16, else fp32), into out [n_rows, H] (fp32, zeroed here). The routes and x
 * are copied before this returns; `out` must stay alive until the job is waited for.
 * *experts receives the number of distinct experts the job reads. Returns 0 if no thread can
 * be started or the job's buffers cannot be allocated. */
uint64_t ft_cpu_experts_submit(int dtype, const void *w_gate_up, const void *w_down,
                               const void *b_gate_up, int64_t H, int64_t I, const void *x,
                               int x_bf16, int64_t n_rows, int64_t n_routes,
                               const int64_t *route_row, const int64_t *route_pair,
                               const float *route_w, float *out, int act, int threads,
                               int64_t *experts) {
    uint64_t gen = begin_job(threads);
    if (!gen) return 0;
    job_t j = {dtype, act, threads, w_gate_up, w_down, H, I};
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
    const void *w_gate_up, *w_down, *b_gate_up;
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
    uint64_t ticket = ft_cpu_experts_submit(l->dtype, l->w_gate_up, l->w_down, l->b_gate_up,
                                            l->H, l->I, l->x, l->x_bf16, tokens, n, l->rows,
                                            l->routes, l->gates, l->out, l->act, l->threads,
                                            &experts);
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
 * `weights` hold max_routes entries, x and out max_routes rows. `threads`: the team threads of
 * each job (the listener joins them). */
void *ft_listener_start(const uint32_t *seq, const uint32_t *shape, uint32_t *done,
                        const int64_t *pairs, const float *weights, const void *x, int x_bf16,
                        float *out,
                        int64_t max_routes, int dtype, const void *w_gate_up, const void *w_down,
                        const void *b_gate_up, int64_t H, int64_t I, int act, int threads,
                        double *stats, int64_t layers, double idle_spin, double prepare) {
    listener_t *l = calloc(1, sizeof(listener_t));
    if (!l) return NULL;
    *l = (listener_t){seq, shape, done, pairs, weights, x, out, x_bf16, dtype, act, threads,
                      max_routes, H, I, layers, w_gate_up, w_down, b_gate_up, stats, idle_spin,
                      prepare};
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
