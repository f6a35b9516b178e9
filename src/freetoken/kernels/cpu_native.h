/* The native CPU library's shared declarations, included first by cpu_native.c (the library's
 * one translation unit; see there): the build's switches, the types the parts hand each other (a
 * projection, a quantized row, a job of the team), the bf16 helpers and atomics they all use,
 * the work items the team runs and the functions the library exports. */
#ifndef FREETOKEN_CPU_NATIVE_H
#define FREETOKEN_CPU_NATIVE_H

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
 * kernels/native.py when it compiles the library. */
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

/* The vector units the decoders are built for, as -march=native finds them. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FT_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__)
#define FT_AVX2 1
#endif

/* Decoded in registers into the dot products: AVX-512 (and its BF16 instructions for bf16
 * models, whose dot product uses them). fp8 rows whose blocks a step would straddle do not. */
#if FT_AVX512 && defined(__AVX512BF16__)
#define QDOT_BF16 1
#endif
#if FT_AVX512
#define QDOT_F32 1
#endif

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

/* A helper the compiler must inline into its caller (a part of a hot loop: compiled as if written
 * there). */
#define FT_INLINE static inline __attribute__((always_inline))

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

/* Atomics (sequentially consistent), and a spin loop's pause. */
#define LOAD(p) __atomic_load_n(p, __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n(p, v, __ATOMIC_SEQ_CST)
#define ADD(p, v) __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* A projection as the kernels read it: the experts' [P, N, K] bank, or a dense layer's weight
 * (P = 1), dense or quantized (the formats: cpu_formats.c). */
typedef struct {
    int fmt;        /* FMT_*: how it is stored (the two projections may differ: see submit) */
    const void *w;  /* dense weights in the model's dtype, or the codes */
    const void *s;  /* the scales (cpu_formats.c) */
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

/* A job of the team (cpu_team.c), of one kind (JOB_*), its fields by kind.
 *
 * The routed experts' (JOB_EXPERTS, cpu_experts.c): routes grouped by expert. Group g is routes
 * [group_start[g], group_start[g + 1]), all with the expert at flat id group_pair[g]. Route r
 * reads row route_row[r] of x [*, H] and adds route_w[r] * expert(x) into row route_row[r] of
 * out [*, H] (fp32, zeroed at submission). a_buf [R, I] is scratch. With bf16 banks the
 * activations are bf16 too (x16, a16: the values torch would multiply, each already rounded to
 * bf16), for dot_bf16_bf16. A group's down rows wait for its own gate/up items only
 * (group_done), not for every group's: a thread out of gate/up items starts on the down rows of
 * the groups done first. */
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

/* The team's work items (run_items, cpu_team.c), defined by the parts of their jobs: item `item`
 * of job *j's first phase (gate_items) or second (down_items). */
static void gate_item(const job_t *j, int64_t item); /* cpu_experts.c */
static void down_item(const job_t *j, int64_t item);
static void linear_item(const job_t *j, int64_t item); /* cpu_layers.c */
static void qlinear_item(const job_t *j, int64_t item);
static void dequantize_item(const job_t *j, int64_t item);
static void attention_partial(const job_t *j, int64_t item);
static void attention_merge(const job_t *j, int64_t item);

/* ---- the exported functions (the library's ABI) -----------------------------------------------
 *
 * Each documented where it is defined; the Python module named declares its ctypes signature
 * (kernels/cpu_team.py's `declare`), which must match the prototype here. */

/* cpu_decoders.c (kernels/cpu_banks.py) */
int ft_cpu_experts_decoder_bits(void);
void ft_cpu_experts_decode(int dtype, int fmt, const void *w, const void *s, const float *g,
                           int64_t bn, int64_t bk, int64_t pair, int64_t N, int64_t K, void *out);

/* cpu_dots.c (kernels/cpu_banks.py) */
int ft_cpu_bf16_scaled_codes(void);

/* cpu_team.c (kernels/cpu_team.py) */
double ft_cpu_experts_wait(uint64_t gen);
void ft_cpu_experts_set_spin(double seconds);
void ft_cpu_experts_prepare(double seconds);
int ft_cpu_experts_item_seconds(double *out);

/* cpu_experts.c (kernels/cpu_experts.py) */
uint64_t ft_cpu_experts_submit(int dtype, int fmt, int fmt_down, const void *w_gate_up,
                               const void *s_gate_up, const float *g_gate_up, int64_t bn_gate_up,
                               int64_t bk_gate_up, const void *w_down, const void *s_down,
                               const float *g_down, int64_t bn_down, int64_t bk_down,
                               const void *b_gate_up, int64_t H, int64_t I, const void *x,
                               int x_bf16, int64_t n_rows, int64_t n_routes,
                               const int64_t *route_row, const int64_t *route_pair,
                               const float *route_w, float *out, int act, int threads,
                               int64_t *experts);
void ft_cpu_experts_row_dots(int fmt, const void *w, const void *s, const float *g, int64_t bn,
                             int64_t bk, int64_t pair, int64_t N, int64_t K, int64_t row,
                             int64_t other, const uint16_t *x, float *out);

/* cpu_layers.c (kernels/cpu_linear.py, kernels/paged_attention.py, kernels/norm_rope.py) */
uint64_t ft_cpu_linear_submit(int dtype, const void *w, const void *bias, int64_t N, int64_t H,
                              const void *x, int x_bf16, int64_t T, float *out, int threads);
uint64_t ft_cpu_qlinear_submit(int dtype, int fmt, const void *w, const void *s, const float *g,
                               int64_t bn, int64_t bk, const void *bias, int64_t N, int64_t H,
                               const void *x, int x_bf16, int64_t T, float *out, int threads);
uint64_t ft_cpu_dequantize_submit(int dtype, int fmt, const void *w, const void *s,
                                  const float *g, int64_t bn, int64_t bk, int64_t N, int64_t K,
                                  void *dense, int threads);
uint64_t ft_cpu_attention_submit(int dtype, const void *q, const void *k_pool,
                                 const void *v_pool, const int64_t *table, int64_t width,
                                 int64_t page, const int64_t *rows, const int64_t *lengths,
                                 int64_t B, int64_t heads, int64_t kv_heads, int64_t D,
                                 int64_t window, float scale, const float *sinks, float *out,
                                 int64_t split_as, int threads);
void ft_cpu_rms_norm(int dtype, const void *x, const void *delta, const void *weight, int64_t T,
                     int64_t H, float eps, int mode, void *sum, void *out);
void ft_cpu_rotary(int dtype, const void *x, int64_t x_stride, int64_t h_stride, int64_t T,
                   int64_t heads, int64_t D, const void *cos, const void *sin, int64_t c_stride,
                   int64_t rot, void *out);

/* cpu_listener.c (moe/doorbell.py) */
void *ft_listener_start(const uint32_t *seq, const uint32_t *shape, uint32_t *done,
                        const int64_t *pairs, const float *weights, const void *x, int x_bf16,
                        float *out, int64_t max_routes, int dtype, int fmt, int fmt_down,
                        const void *w_gate_up, const void *s_gate_up, const float *g_gate_up,
                        int64_t bn_gate_up, int64_t bk_gate_up, const void *w_down,
                        const void *s_down, const float *g_down, int64_t bn_down,
                        int64_t bk_down, const void *b_gate_up, int64_t H, int64_t I, int act,
                        int threads, double *stats, int64_t layers, double idle_spin,
                        double prepare);
void ft_listener_stop(void *handle);

#endif
