/* Routed experts on the CPU, reading weights straight from the host expert pool.
 *
 * Built at first use by kernels/native.py with the machine's own compiler
 * (-O3 -march=native -fopenmp), so the inner loops below become AVX-512 (or AVX2) code on the
 * machine that runs them. `ft_cpu_experts_submit` hands a job to a worker thread of this
 * library and returns at once; `ft_cpu_experts_wait` blocks until it is done (called through
 * ctypes, which releases the GIL meanwhile). No Python thread is involved: a Python thread would
 * need the GIL to start the job, and the thread driving the GPU holds it for milliseconds at a
 * time while it launches kernels.
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
 * accumulation order inside a dot product differs. Contributions are summed per token in fp32
 * in route order (the caller orders the routes).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { DT_BF16 = 0, DT_F32 = 1 };
enum { ACT_SILU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_RELU = 3 };

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

/* Row `row` of an expert's [rows, n] matrix at flat id `pair` of a bank, dotted with x. */
static inline float row_dot(int dtype, const void *bank, int64_t pair, int64_t rows, int64_t row,
                            int64_t n, const float *x) {
    int64_t offset = (pair * rows + row) * n;
    if (dtype == DT_BF16) return dot_bf16((const uint16_t *)bank + offset, x, n);
    return dot_f32((const float *)bank + offset, x, n);
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

/* Routes come grouped by expert: group g is routes [group_start[g], group_start[g + 1]), all
 * with the expert at flat id group_pair[g]. Route r reads row route_row[r] of x [*, H] and adds
 * route_w[r] * expert(x) into row route_row[r] of out [*, H] (fp32, zeroed by the caller).
 * a_buf [R, I] and c_buf [R, H] are scratch. Returns 0. */
int ft_cpu_experts(int dtype, const void *w_gate_up, const void *w_down, int64_t H, int64_t I,
                   const float *x, int64_t n_groups, const int64_t *group_start,
                   const int64_t *group_pair, const int64_t *route_row, const float *route_w,
                   float *a_buf, float *c_buf, float *out, int act, int threads) {
    const int bf16 = dtype == DT_BF16;
    const int64_t gate_blocks = (I + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t down_blocks = (H + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t n_routes = group_start[n_groups];

#pragma omp parallel num_threads(threads)
    {
        /* gate/up: a[r, n] = act(gate_n . x) * (up_n . x), rounded as torch rounds. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n_groups * gate_blocks; item++) {
            int64_t g = item / gate_blocks, n0 = (item % gate_blocks) * ROW_BLOCK;
            int64_t n1 = n0 + ROW_BLOCK < I ? n0 + ROW_BLOCK : I;
            for (int64_t n = n0; n < n1; n++)
                for (int64_t r = group_start[g]; r < group_start[g + 1]; r++) {
                    const float *xr = x + route_row[r] * H;
                    float gate = rnd(row_dot(dtype, w_gate_up, group_pair[g], 2 * I, n, H, xr), bf16);
                    float up = rnd(row_dot(dtype, w_gate_up, group_pair[g], 2 * I, I + n, H, xr), bf16);
                    a_buf[r * I + n] = rnd(rnd(activate(gate, act), bf16) * up, bf16);
                }
        }
        /* down: c[r, n] = route_w[r] * (down_n . a[r]), rounded as torch rounds. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n_groups * down_blocks; item++) {
            int64_t g = item / down_blocks, n0 = (item % down_blocks) * ROW_BLOCK;
            int64_t n1 = n0 + ROW_BLOCK < H ? n0 + ROW_BLOCK : H;
            for (int64_t n = n0; n < n1; n++)
                for (int64_t r = group_start[g]; r < group_start[g + 1]; r++) {
                    float y = rnd(row_dot(dtype, w_down, group_pair[g], H, n, I, a_buf + r * I), bf16);
                    c_buf[r * H + n] = rnd(y * route_w[r], bf16);
                }
        }
        /* out[row] += c[r], every column by one thread, routes in order: deterministic. */
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < H; n0 += 256) {
            int64_t n1 = n0 + 256 < H ? n0 + 256 : H;
            for (int64_t r = 0; r < n_routes; r++)
                for (int64_t n = n0; n < n1; n++) out[route_row[r] * H + n] += c_buf[r * H + n];
        }
    }
    return 0;
}

/* ---- one job at a time on a worker thread ---------------------------------------------- */

typedef struct {
    int dtype, act, threads;
    const void *w_gate_up, *w_down;
    int64_t H, I, n_groups;
    const float *x, *route_w;
    const int64_t *group_start, *group_pair, *route_row;
    float *a_buf, *c_buf, *out;
} job_t;

/* Decode hands over a job every layer step, 1-2 ms apart: the worker and the waiting caller
 * may spin this long before sleeping on the condition variable, since a futex wake-up costs
 * tens of microseconds (more under a sandboxing kernel such as gVisor) against a job of a few
 * hundred. Off by default: spinning pays only where no other thread pool wants these cores
 * (on a 2-core machine beside torch's own pool it made each job 4x slower). */
static double spin_seconds = 0.0;

void ft_cpu_experts_set_spin(double seconds) { spin_seconds = seconds; }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static pthread_mutex_t job_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t job_cond = PTHREAD_COND_INITIALIZER;
static job_t pending;
static int has_job = 0, job_done = 1, worker_started = 0;
static double job_seconds = 0.0; /* the last job's compute time, without handoff or waiting */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void spin_until_set(int *flag) {
    if (spin_seconds <= 0.0) return;
    double until = now() + spin_seconds;
    while (!__atomic_load_n(flag, __ATOMIC_ACQUIRE) && now() < until) cpu_relax();
}

static void *worker_main(void *unused) {
    (void)unused;
    for (;;) {
        spin_until_set(&has_job);
        pthread_mutex_lock(&job_mutex);
        while (!has_job) pthread_cond_wait(&job_cond, &job_mutex);
        job_t j = pending;
        __atomic_store_n(&has_job, 0, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&job_mutex);
        double start = now();
        ft_cpu_experts(j.dtype, j.w_gate_up, j.w_down, j.H, j.I, j.x, j.n_groups, j.group_start,
                       j.group_pair, j.route_row, j.route_w, j.a_buf, j.c_buf, j.out, j.act,
                       j.threads);
        double seconds = now() - start;
        pthread_mutex_lock(&job_mutex);
        job_seconds = seconds;
        __atomic_store_n(&job_done, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&job_cond);
        pthread_mutex_unlock(&job_mutex);
    }
    return NULL;
}

/* Same arguments as ft_cpu_experts; the buffers must stay alive until ft_cpu_experts_wait.
 * Waits for a previous job first (one at a time). Returns 0, or -1 if no thread starts. */
int ft_cpu_experts_submit(int dtype, const void *w_gate_up, const void *w_down, int64_t H,
                          int64_t I, const float *x, int64_t n_groups, const int64_t *group_start,
                          const int64_t *group_pair, const int64_t *route_row,
                          const float *route_w, float *a_buf, float *c_buf, float *out, int act,
                          int threads) {
    pthread_mutex_lock(&job_mutex);
    if (!worker_started) {
        pthread_t worker;
        if (pthread_create(&worker, NULL, worker_main, NULL) != 0) {
            pthread_mutex_unlock(&job_mutex);
            return -1;
        }
        pthread_detach(worker);
        worker_started = 1;
    }
    while (!job_done) pthread_cond_wait(&job_cond, &job_mutex);
    job_t j = {dtype, act, threads, w_gate_up, w_down, H, I, n_groups, x, route_w, group_start,
               group_pair, route_row, a_buf, c_buf, out};
    pending = j;
    __atomic_store_n(&job_done, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&has_job, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&job_cond);
    pthread_mutex_unlock(&job_mutex);
    return 0;
}

/* Blocks until the job is done; returns its compute time in seconds. */
double ft_cpu_experts_wait(void) {
    spin_until_set(&job_done);
    pthread_mutex_lock(&job_mutex);
    while (!job_done) pthread_cond_wait(&job_cond, &job_mutex);
    double seconds = job_seconds;
    pthread_mutex_unlock(&job_mutex);
    return seconds;
}
