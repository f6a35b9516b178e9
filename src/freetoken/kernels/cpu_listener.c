/* The device's doorbell's listener (part of cpu_native.c's translation unit, last; Python:
 * moe/doorbell.py).
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
