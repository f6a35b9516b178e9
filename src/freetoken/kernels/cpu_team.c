/* The team of threads (part of cpu_native.c's translation unit, after the dot products): jobs
 * published to it one at a time, their items taken from a shared counter by the team and by the
 * caller that waits (ft_cpu_experts_wait); the clock, a wait for another item's work and the
 * profiling build's times; each thread's scratch for its items, the job slots' buffers, and the
 * start and the publishing of a job, which every submission (cpu_experts.c, cpu_layers.c) goes
 * through. Python: kernels/cpu_team.py. */

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
