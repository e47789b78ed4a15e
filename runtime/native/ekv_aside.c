/* A helper thread beside a CPU decode step's compute thread (runtime/aside.py AsideThread).
 *
 * The step runs torch on one core and leaves the other to the reads, which keep it busy a fraction of the step.  The
 * helper takes two kinds of work there, both as units a kernel defines (fn(ctx, unit, worker), worker 0 the caller,
 * 1 the helper, so each has scratch of its own):
 *   - posted jobs (ekv_aside_post): run by the helper alone while the caller goes on, in order, each with a ticket
 *     (the next layer's K_lr scores, ekv_score.c);
 *   - a shared job (ekv_aside_share): the caller and the helper take its units from one counter until none is left,
 *     and the call returns once all are done (a correction's scores, a part of a sequence a unit).
 * Between units the helper looks at the shared job first: the caller is waiting on it.  A thread of C, so it never
 * takes Python's GIL (a Python thread making the scorer's calls took it to start each call and to hand back its
 * result, and the compute thread waited for it between its own ops: 1.03x a step where this thread gave 1.12x).
 * A layer's record attention is shared as (sequence, KV head) units (ekv_attend.c): where the step posts the scores
 * the helper is still making them then, and gains little (SmolLM2 8K, batch 4, this machine's disk: 110.3 -> 106.8
 * ms a step), where it shares them the helper is free (94.4 -> 87.0 ms).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef void (*ekv_unit_fn)(void *ctx, int64_t unit, int worker);

enum { QUEUE = 4 }; /* posted jobs not yet done; a post waits for room */

typedef struct {
    ekv_unit_fn fn;
    void *ctx;
    int64_t units;
} job_t;

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    job_t queue[QUEUE];      /* posted jobs: ticket t at queue[(t - 1) % QUEUE] */
    int64_t posted, finished; /* tickets: the last posted, the last done */
    int64_t queued_next;      /* the next unit of the oldest posted job not done */
    job_t shared;             /* the caller's shared job, while shared_active */
    int64_t shared_next, shared_done;
    int shared_active, stop;
    /* Spinning (ekv_aside_spin): a thread out of work watches these counters, bumped atomically under the lock, for
     * `spin_ns` before it sleeps on the condition: waking a sleeping thread took longer than half of a small layer's
     * dot products on the 2-core VM, so a job shared a few tens of microseconds after the last went to the caller
     * alone. */
    int64_t work_seq, done_seq; /* work posted or shared (or the thread told to stop); shared units done */
    int64_t spin_ns;
} ekv_aside;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Called with the lock held, returns with it held: with spinning on, waits up to spin_ns unlocked for `*counter`
 * to move from `seen` (1 if it moved), else 0 at once.  The counter is read once more under the lock: a change made
 * between the last unlocked look and the relock (its broadcast sent while nobody waited) is not slept through. */
static int spun(ekv_aside *a, const int64_t *counter, int64_t seen) {
    if (a->spin_ns <= 0) return 0;
    const int64_t until = now_ns() + a->spin_ns;
    pthread_mutex_unlock(&a->lock);
    int moved = 0;
    for (int i = 0; !moved; i++) {
        moved = __atomic_load_n(counter, __ATOMIC_ACQUIRE) != seen;
        if ((i & 63) == 63 && now_ns() > until) break;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    pthread_mutex_lock(&a->lock);
    return moved || *counter != seen;
}

/* One unit of the shared job if one is left (1), else 0; called with the lock held, returns with it held. */
static int shared_unit(ekv_aside *a, int worker) {
    if (!a->shared_active || a->shared_next >= a->shared.units) return 0;
    int64_t unit = a->shared_next++;
    job_t job = a->shared; /* as posted jobs are: read under the lock */
    pthread_mutex_unlock(&a->lock);
    job.fn(job.ctx, unit, worker);
    pthread_mutex_lock(&a->lock);
    __atomic_add_fetch(&a->done_seq, 1, __ATOMIC_RELEASE);
    if (++a->shared_done == a->shared.units) pthread_cond_broadcast(&a->changed);
    return 1;
}

static void *helper_main(void *arg) {
    ekv_aside *a = arg;
    pthread_mutex_lock(&a->lock);
    for (;;) {
        if (shared_unit(a, 1)) continue;
        if (a->finished < a->posted) {
            job_t job = a->queue[a->finished % QUEUE];
            int64_t unit = a->queued_next++;
            pthread_mutex_unlock(&a->lock);
            if (unit < job.units) job.fn(job.ctx, unit, 1);
            pthread_mutex_lock(&a->lock);
            if (unit + 1 >= job.units) {
                a->finished++;
                a->queued_next = 0;
                pthread_cond_broadcast(&a->changed);
            }
            continue;
        }
        if (a->stop) break;
        if (spun(a, &a->work_seq, a->work_seq)) continue;
        pthread_cond_wait(&a->changed, &a->lock);
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

/* A helper thread, or NULL when none could start (the caller runs every unit itself). */
ekv_aside *ekv_aside_open(void) {
    ekv_aside *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->changed, NULL);
    if (pthread_create(&a->thread, NULL, helper_main, a) != 0) {
        pthread_cond_destroy(&a->changed);
        pthread_mutex_destroy(&a->lock);
        free(a);
        return NULL;
    }
    return a;
}

/* fn's units 0 .. units-1 run on the helper, after the jobs posted before; returns the job's ticket.  ctx and what
 * it points into must live until the ticket is waited for. */
int64_t ekv_aside_post(ekv_aside *a, ekv_unit_fn fn, void *ctx, int64_t units) {
    pthread_mutex_lock(&a->lock);
    while (a->posted - a->finished == QUEUE) pthread_cond_wait(&a->changed, &a->lock);
    a->queue[a->posted % QUEUE] = (job_t){fn, ctx, units};
    int64_t ticket = ++a->posted;
    __atomic_add_fetch(&a->work_seq, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&a->changed);
    pthread_mutex_unlock(&a->lock);
    return ticket;
}

/* `n` jobs posted in order in one call (a select's scores, votes and top-M: one crossing from Python where there were
 * three); returns the last one's ticket. */
int64_t ekv_aside_post_chain(ekv_aside *a, const ekv_unit_fn *fns, void *const *ctxs, const int64_t *units, int n) {
    int64_t ticket = 0;
    for (int i = 0; i < n; i++) ticket = ekv_aside_post(a, fns[i], ctxs[i], units[i]);
    return ticket;
}

/* 1 once posted job `ticket` is done (and every one before it), else 0 (never waits) */
int ekv_aside_done(ekv_aside *a, int64_t ticket) {
    pthread_mutex_lock(&a->lock);
    int done = a->finished >= ticket;
    pthread_mutex_unlock(&a->lock);
    return done;
}

/* Waits for posted job `ticket` and every one before it, helping with nothing meanwhile. */
void ekv_aside_wait(ekv_aside *a, int64_t ticket) {
    pthread_mutex_lock(&a->lock);
    while (a->finished < ticket) pthread_cond_wait(&a->changed, &a->lock);
    pthread_mutex_unlock(&a->lock);
}

/* fn's units 0 .. units-1, run by the caller (worker 0) and, once free, the helper (worker 1); returns when all are
 * done.  One shared job at a time: the caller's thread is the only one that shares. */
void ekv_aside_share(ekv_aside *a, ekv_unit_fn fn, void *ctx, int64_t units) {
    pthread_mutex_lock(&a->lock);
    a->shared = (job_t){fn, ctx, units};
    a->shared_next = a->shared_done = 0;
    a->shared_active = 1;
    __atomic_add_fetch(&a->work_seq, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&a->changed);
    while (shared_unit(a, 0)) {
    }
    while (a->shared_done < units)
        if (!spun(a, &a->done_seq, a->done_seq)) pthread_cond_wait(&a->changed, &a->lock);
    a->shared_active = 0;
    pthread_mutex_unlock(&a->lock);
}

/* From now on a thread out of work spins `microseconds` before it sleeps (0: sleeps at once, the default). */
void ekv_aside_spin(ekv_aside *a, int64_t microseconds) {
    pthread_mutex_lock(&a->lock);
    a->spin_ns = microseconds * 1000;
    pthread_mutex_unlock(&a->lock);
}

/* The jobs posted finish, then the thread ends. */
void ekv_aside_close(ekv_aside *a) {
    pthread_mutex_lock(&a->lock);
    a->stop = 1;
    __atomic_add_fetch(&a->work_seq, 1, __ATOMIC_RELEASE); /* a spinning helper sees it and ends */
    pthread_cond_broadcast(&a->changed);
    pthread_mutex_unlock(&a->lock);
    pthread_join(a->thread, NULL);
    pthread_cond_destroy(&a->changed);
    pthread_mutex_destroy(&a->lock);
    free(a);
}
