/*
 * Batched positional reads for the KV disk store, called from Python via ctypes.
 *
 * A Python thread pool of preads is GIL-bound at 4-16 KiB and reaches only half of
 * what the disk gives; this keeps the whole batch in C.  Built with -DEKV_URING it
 * submits the batch through io_uring (liburing); otherwise a persistent pthread pool
 * issues the reads.  Both read into caller-owned (O_DIRECT-aligned) buffers.
 *
 * A request is several records consecutive on disk and scattered in memory (readv), so
 * adjacent records cost one I/O.  Every call returns only once no read of its batch is in
 * flight, a failed call included: the caller frees the buffers after.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>

#ifdef EKV_URING
#include <liburing.h>
#endif

/* preadv and io_uring refuse more iovecs than this (UIO_MAXIOV): longer requests are split. */
#define EKV_IOV_MAX 1024

typedef struct {
    int fd;
    int iovcnt;
    int64_t offset;
    struct iovec *iov;
} seg_t;

/* A batch as segments of at most EKV_IOV_MAX records; the iovecs live until every segment completed. */
typedef struct {
    int n;
    seg_t *segs;
    struct iovec *iov;
    int64_t nbytes;
} plan_t;

/* counts NULL: one record per request.  Returns 0 or -errno. */
static int plan_build(plan_t *p, int n, const int32_t *fds, const int64_t *offsets, const int32_t *counts,
                      int64_t nbytes, void *const *dests) {
    int64_t records = 0, segs = 0;
    for (int i = 0; i < n; i++) {
        int64_t c = counts ? counts[i] : 1;
        if (c < 1) return -EINVAL;
        records += c;
        segs += (c + EKV_IOV_MAX - 1) / EKV_IOV_MAX;
    }
    p->iov = malloc((size_t)records * sizeof(struct iovec));
    p->segs = malloc((size_t)segs * sizeof(seg_t));
    if (!p->iov || !p->segs) {
        free(p->iov);
        free(p->segs);
        return -ENOMEM;
    }
    p->nbytes = nbytes;
    p->n = 0;
    int64_t k = 0;
    for (int i = 0; i < n; i++) {
        int c = counts ? counts[i] : 1;
        for (int j = 0; j < c; j++) p->iov[k + j] = (struct iovec){dests[k + j], (size_t)nbytes};
        for (int j = 0; j < c; j += EKV_IOV_MAX) {
            int cnt = c - j < EKV_IOV_MAX ? c - j : EKV_IOV_MAX;
            p->segs[p->n++] = (seg_t){fds[i], cnt, offsets[i] + j * nbytes, &p->iov[k + j]};
        }
        k += c;
    }
    return 0;
}

static void plan_free(plan_t *p) {
    free(p->segs);
    free(p->iov);
}

/* Read a segment synchronously from its byte `done` on (a whole one, or the rest of a short read).
 * Returns 0 or -errno; -EIO on an unexpected end of file. */
static int read_segment(const seg_t *s, int64_t nbytes, int64_t done) {
    int64_t total = s->iovcnt * nbytes;
    while (done < total) {
        int k = (int)(done / nbytes);
        int64_t within = done % nbytes;
        off_t at = (off_t)(s->offset + done);
        ssize_t got = within ? pread(s->fd, (char *)s->iov[k].iov_base + within, (size_t)(nbytes - within), at)
                             : preadv(s->fd, &s->iov[k], s->iovcnt - k, at);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return -EIO;
        done += got;
    }
    return 0;
}

#ifdef EKV_URING

typedef struct {
    struct io_uring ring;
    unsigned depth;
    int broken; /* -errno once the ring holds reads it could not submit: they would go out with a later batch */
} reader_t;

const char *ekv_backend(void) { return "io_uring"; }

void *ekv_open(int depth, int threads) {
    (void)threads;
    reader_t *r = calloc(1, sizeof(reader_t));
    if (!r) return NULL;
    r->depth = depth > 0 ? (unsigned)depth : 64;
    if (io_uring_queue_init(r->depth, &r->ring, 0) < 0) {
        free(r);
        return NULL;
    }
    return r;
}

void ekv_close(void *h) {
    reader_t *r = h;
    if (!r) return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

/* Take every completion there is; short reads are finished synchronously (rare: near end of file). */
static void reap(reader_t *r, const plan_t *p, int *inflight, int *status) {
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&r->ring, head, cqe) {
        const seg_t *s = &p->segs[io_uring_cqe_get_data64(cqe)];
        int res = cqe->res, rc = 0;
        seen++;
        if (res < 0)
            rc = res;
        else if (res < s->iovcnt * p->nbytes)
            rc = read_segment(s, p->nbytes, res);
        if (rc && !*status) *status = rc;
    }
    io_uring_cq_advance(&r->ring, seen);
    *inflight -= (int)seen;
}

/* After a refused submit: wait for every read the kernel took; the rest never leave the ring. */
static void drain(reader_t *r, const plan_t *p, int *inflight, int *status) {
    while (*inflight > (int)io_uring_sq_ready(&r->ring)) {
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(&r->ring, &cqe);
        if (rc == -EINTR) continue;
        if (rc < 0) {
            r->broken = rc;
            return;
        }
        reap(r, p, inflight, status);
    }
    if (*inflight > 0) r->broken = *status;
}

int ekv_readv(void *h, int n, const int32_t *fds, const int64_t *offsets, const int32_t *counts, int64_t nbytes,
              void *const *dests) {
    reader_t *r = h;
    if (r->broken) return r->broken;
    if (n <= 0) return 0;
    plan_t p;
    int status = plan_build(&p, n, fds, offsets, counts, nbytes, dests);
    if (status) return status;
    int next = 0, inflight = 0;
    while (next < p.n || inflight > 0) {
        while (next < p.n && inflight < (int)r->depth) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
            if (!sqe) break;
            const seg_t *s = &p.segs[next];
            if (s->iovcnt == 1)
                io_uring_prep_read(sqe, s->fd, s->iov[0].iov_base, (unsigned)nbytes, (uint64_t)s->offset);
            else
                io_uring_prep_readv(sqe, s->fd, s->iov, (unsigned)s->iovcnt, (uint64_t)s->offset);
            io_uring_sqe_set_data64(sqe, (uint64_t)next);
            next++;
            inflight++;
        }
        int rc = io_uring_submit_and_wait(&r->ring, 1);
        if (rc < 0 && rc != -EINTR) {
            status = status ? status : rc;
            drain(r, &p, &inflight, &status);
            break;
        }
        reap(r, &p, &inflight, &status);
    }
    plan_free(&p);
    return status;
}

#else /* pthread pool */

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work_ready;
    pthread_cond_t work_done;
    pthread_t *threads;
    int nthreads;
    plan_t plan;
    int next, done, status;
    unsigned long generation;
    int stopping;
} reader_t;

const char *ekv_backend(void) { return "pthread"; }

static void *worker(void *arg) {
    reader_t *r = arg;
    unsigned long seen_generation = 0;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        while (!r->stopping && (r->generation == seen_generation || r->next >= r->plan.n))
            pthread_cond_wait(&r->work_ready, &r->lock);
        if (r->stopping) break;
        seen_generation = r->generation;
        while (r->next < r->plan.n) {
            int i = r->next++;
            plan_t p = r->plan;
            pthread_mutex_unlock(&r->lock);
            int rc = read_segment(&p.segs[i], p.nbytes, 0);
            pthread_mutex_lock(&r->lock);
            if (rc && !r->status) r->status = rc;
            if (++r->done == r->plan.n) pthread_cond_signal(&r->work_done);
        }
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

void ekv_close(void *h) {
    reader_t *r = h;
    if (!r) return;
    pthread_mutex_lock(&r->lock);
    r->stopping = 1;
    pthread_cond_broadcast(&r->work_ready);
    pthread_mutex_unlock(&r->lock);
    for (int t = 0; t < r->nthreads; t++) pthread_join(r->threads[t], NULL);
    free(r->threads);
    free(r);
}

/* One read per thread at a time: min(threads, depth) threads keep at most `depth` reads in flight. */
void *ekv_open(int depth, int threads) {
    reader_t *r = calloc(1, sizeof(reader_t));
    if (!r) return NULL;
    int want = threads > 0 ? threads : 16;
    if (depth > 0 && depth < want) want = depth;
    r->threads = calloc((size_t)want, sizeof(pthread_t));
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->work_ready, NULL);
    pthread_cond_init(&r->work_done, NULL);
    while (r->threads && r->nthreads < want && pthread_create(&r->threads[r->nthreads], NULL, worker, r) == 0)
        r->nthreads++;
    if (r->nthreads == 0) {
        ekv_close(r);
        return NULL;
    }
    return r;
}

int ekv_readv(void *h, int n, const int32_t *fds, const int64_t *offsets, const int32_t *counts, int64_t nbytes,
              void *const *dests) {
    reader_t *r = h;
    if (n <= 0) return 0;
    plan_t p;
    int status = plan_build(&p, n, fds, offsets, counts, nbytes, dests);
    if (status) return status;
    pthread_mutex_lock(&r->lock);
    r->plan = p;
    r->next = 0;
    r->done = 0;
    r->status = 0;
    r->generation++;
    pthread_cond_broadcast(&r->work_ready);
    while (r->done < p.n) pthread_cond_wait(&r->work_done, &r->lock);
    status = r->status;
    r->plan.n = 0;
    pthread_mutex_unlock(&r->lock);
    plan_free(&p);
    return status;
}

#endif

/* One record per request. */
int ekv_read(void *h, int n, const int32_t *fds, const int64_t *offsets, int64_t nbytes, void *const *dests) {
    return ekv_readv(h, n, fds, offsets, NULL, nbytes, dests);
}
