/*
 * Batched positional reads for the KV disk store, called from Python via ctypes.
 *
 * A Python thread pool of preads is GIL-bound at 4-16 KiB and reaches only half of
 * what the disk gives; this keeps the whole batch in C.  Built with -DEKV_URING it
 * submits the batch through io_uring (liburing); otherwise a persistent pthread pool
 * issues the preads.  Both read into caller-owned (O_DIRECT-aligned) buffers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef EKV_URING
#include <liburing.h>
#endif

typedef struct {
    int n;
    const int32_t *fds;
    const int64_t *offsets;
    int64_t nbytes;
    void *const *dests;
} batch_t;

/* Read one request fully; returns 0 or -errno (-EIO on an unexpected end of file). */
static int read_full(int fd, char *dest, int64_t offset, int64_t nbytes) {
    while (nbytes > 0) {
        ssize_t got = pread(fd, dest, (size_t)nbytes, (off_t)offset);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return -EIO;
        dest += got;
        offset += got;
        nbytes -= got;
    }
    return 0;
}

#ifdef EKV_URING

typedef struct {
    struct io_uring ring;
    unsigned depth;
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

int ekv_read(void *h, int n, const int32_t *fds, const int64_t *offsets, int64_t nbytes, void *const *dests) {
    reader_t *r = h;
    int next = 0, inflight = 0, status = 0;
    while (next < n || inflight > 0) {
        while (next < n && inflight < (int)r->depth) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
            if (!sqe) break;
            io_uring_prep_read(sqe, fds[next], dests[next], (unsigned)nbytes, (uint64_t)offsets[next]);
            io_uring_sqe_set_data64(sqe, (uint64_t)next);
            next++;
            inflight++;
        }
        int rc = io_uring_submit_and_wait(&r->ring, 1);
        if (rc < 0 && rc != -EINTR) return rc;
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&r->ring, head, cqe) {
            int i = (int)io_uring_cqe_get_data64(cqe);
            int res = cqe->res;
            seen++;
            inflight--;
            if (res < 0) {
                status = status ? status : res;
            } else if (res < nbytes) {
                /* Short read: finish it synchronously (rare; only near end of file). */
                int rest = read_full(fds[i], (char *)dests[i] + res, offsets[i] + res, nbytes - res);
                status = status ? status : rest;
            }
        }
        io_uring_cq_advance(&r->ring, seen);
    }
    return status;
}

#else /* pthread pool */

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work_ready;
    pthread_cond_t work_done;
    pthread_t *threads;
    int nthreads;
    batch_t batch;
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
        while (!r->stopping && (r->generation == seen_generation || r->next >= r->batch.n))
            pthread_cond_wait(&r->work_ready, &r->lock);
        if (r->stopping) break;
        seen_generation = r->generation;
        while (r->next < r->batch.n) {
            int i = r->next++;
            batch_t b = r->batch;
            pthread_mutex_unlock(&r->lock);
            int rc = read_full(b.fds[i], b.dests[i], b.offsets[i], b.nbytes);
            pthread_mutex_lock(&r->lock);
            if (rc && !r->status) r->status = rc;
            if (++r->done == r->batch.n) pthread_cond_signal(&r->work_done);
        }
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

void *ekv_open(int depth, int threads) {
    (void)depth;
    reader_t *r = calloc(1, sizeof(reader_t));
    if (!r) return NULL;
    r->nthreads = threads > 0 ? threads : 16;
    r->threads = calloc((size_t)r->nthreads, sizeof(pthread_t));
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->work_ready, NULL);
    pthread_cond_init(&r->work_done, NULL);
    for (int t = 0; t < r->nthreads; t++) pthread_create(&r->threads[t], NULL, worker, r);
    return r;
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

int ekv_read(void *h, int n, const int32_t *fds, const int64_t *offsets, int64_t nbytes, void *const *dests) {
    reader_t *r = h;
    if (n <= 0) return 0;
    pthread_mutex_lock(&r->lock);
    r->batch = (batch_t){n, fds, offsets, nbytes, dests};
    r->next = 0;
    r->done = 0;
    r->status = 0;
    r->generation++;
    pthread_cond_broadcast(&r->work_ready);
    while (r->done < n) pthread_cond_wait(&r->work_done, &r->lock);
    int status = r->status;
    r->batch.n = 0;
    pthread_mutex_unlock(&r->lock);
    return status;
}

#endif
