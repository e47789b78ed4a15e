/* Decode attention over an in-memory KV cache (runtime/dense_attention.py): full's cache, on a CPU.
 *
 * One query token per sequence attends its keys [start, stop) of a cache laid out [B, H_kv, S, d] per K and per V
 * (float32, bfloat16 or float16).  torch's path is two grouped matmuls and a softmax: at SmolLM2's shapes (3 query
 * heads a KV head, d 64) the matmul of K [S, d] by the queries [d, 3] is far from the memory's speed (this 2-core
 * Zen 3, 8K tokens, 30 layers: 48 ms for the 180 MiB of K, against 7.7 ms to sum them).  Here a block of keys is read
 * once, in cache, for every query head of its KV head.
 *
 * A unit is one KV head of one sequence over DENSE_TOKENS positions (flash-decoding's split), so a batch of one is
 * shared with the decode step's helper thread (ekv_aside.c): it leaves the part's maximum score, its sum of
 * exponentials and its unnormalised output, and ekv_dense_merge weighs the parts into the whole.
 */
#include <stdint.h>
#include <string.h>

#include "ekv_float.h"

enum { KV_F32, KV_BF16, KV_F16 };
enum { MAX_HEAD_DIM = 256, MAX_GROUP_QUERIES = 32, BLOCK = 32, DENSE_TOKENS = 256 };

int ekv_dense_max_head_dim(void) { return MAX_HEAD_DIM; }
int ekv_dense_max_group_queries(void) { return MAX_GROUP_QUERIES; }

typedef struct {
    const float *q;                /* [B, H_kv, g, d] */
    const uint8_t *k, *v;          /* [B, H_kv, S, d] each, in `kind`, rows of d contiguous */
    const int64_t *start, *stop;   /* [B]: the positions each sequence attends */
    int batch, n_kv_heads, group_queries, d, kind, parts;
    int64_t head_rows, batch_rows; /* rows of d between a sequence's KV heads, and between sequences */
    float scaling;
    float *partial;                /* [B, H_kv, parts, g, d + 2]: output, maximum, sum */
} dense_job;

int ekv_dense_job_bytes(void) { return (int)sizeof(dense_job); }

/* `rows` rows of d elements from `at` as float32 rows d apart: in place for float32, else widened into `block` */
static inline const float *rows_as_floats(float *restrict block, const uint8_t *at, int rows, int d, int kind) {
    if (kind == KV_F32) return (const float *)at;
    const uint16_t *e = (const uint16_t *)at;
    if (kind == KV_F16) {
        halves_to_floats(block, e, rows * d);
    } else {
        for (int i = 0; i < rows * d; i++) block[i] = bf16_to_float(e[i]);
    }
    return block;
}

/* One part: keys and values [n, d] from k and v; part [g, d + 2] gets each query's unnormalised output, its maximum
 * score and its sum of exponentials (maximum -inf, sum 0, output 0 for n = 0). */
static inline __attribute__((always_inline)) void dense_part(const float *q, int gq, int d, float scaling,
        const uint8_t *k, const uint8_t *v, int64_t row_bytes, int kind, int n, float *restrict part) {
    float block[BLOCK * MAX_HEAD_DIM], scores[MAX_GROUP_QUERIES * DENSE_TOKENS], top[MAX_GROUP_QUERIES];
    for (int i = 0; i < gq; i++) top[i] = -INFINITY;
    for (int first = 0; first < n; first += BLOCK) {
        const int rows = n - first < BLOCK ? n - first : BLOCK;
        const float *keys = rows_as_floats(block, k + first * row_bytes, rows, d, kind);
        for (int i = 0; i < gq; i++)
            top[i] = scores_of(q + i * d, keys, rows, d, scaling, scores + i * DENSE_TOKENS + first, top[i]);
    }
    for (int i = 0; i < gq; i++) {
        float *o = part + i * (d + 2);
        memset(o, 0, (size_t)d * sizeof(float));
        o[d] = top[i];
        o[d + 1] = exponentials(scores + i * DENSE_TOKENS, n, top[i]);
    }
    for (int first = 0; first < n; first += BLOCK) {
        const int rows = n - first < BLOCK ? n - first : BLOCK;
        const float *values = rows_as_floats(block, v + first * row_bytes, rows, d, kind);
        for (int i = 0; i < gq; i++)
            weigh_values(part + i * (d + 2), scores + i * DENSE_TOKENS + first, values, rows, d);
    }
}

/* Unit u of a job: sequence u / (H_kv * parts), its KV head, and its part's DENSE_TOKENS positions from `start`. */
void ekv_dense_unit(void *ctx, int64_t unit, int worker) {
    (void)worker;
    const dense_job *j = ctx;
    const int per_sequence = j->n_kv_heads * j->parts, b = (int)(unit / per_sequence);
    const int h = (int)(unit % per_sequence) / j->parts, p = (int)(unit % j->parts), gq = j->group_queries, d = j->d;
    const int64_t row_bytes = (int64_t)d * (j->kind == KV_F32 ? 4 : 2);
    const int64_t from = j->start[b] + (int64_t)p * DENSE_TOKENS, to = j->stop[b];
    const int n = from >= to ? 0 : (int)(to - from < DENSE_TOKENS ? to - from : DENSE_TOKENS);
    const int64_t head = ((int64_t)b * j->batch_rows + h * j->head_rows + from) * row_bytes;
    const float *q = j->q + ((int64_t)b * j->n_kv_heads + h) * gq * d;
    float *part = j->partial + unit * gq * (d + 2);
    if (d == 64) { /* the common head sizes (SmolLM2 64, Gemma 3 256), unrolled */
        dense_part(q, gq, 64, j->scaling, j->k + head, j->v + head, row_bytes, j->kind, n, part);
    } else if (d == 128) {
        dense_part(q, gq, 128, j->scaling, j->k + head, j->v + head, row_bytes, j->kind, n, part);
    } else if (d == 256) {
        dense_part(q, gq, 256, j->scaling, j->k + head, j->v + head, row_bytes, j->kind, n, part);
    } else {
        dense_part(q, gq, d, j->scaling, j->k + head, j->v + head, row_bytes, j->kind, n, part);
    }
}

/* The parts a sequence's head is split into for a longest span of `span` positions. */
int ekv_dense_parts(int64_t span) { return span <= 0 ? 1 : (int)((span + DENSE_TOKENS - 1) / DENSE_TOKENS); }

/* A call's arguments into `job` (a caller's buffer of ekv_dense_job_bytes()): q [B, H_kv * g, d] float32 (a KV head's
 * query heads adjacent); k, v [B, H_kv, S, d] in `kind` (float32, bfloat16, float16), a head's rows of d contiguous,
 * `head_rows` rows from one KV head to the next (S at least), `batch_rows` from one sequence to the next (the same
 * for K and V); start/stop [B] int64, the positions each sequence attends (within the head's rows); partial: scratch of partial_floats >= B * H_kv * ekv_dense_parts(longest span) *
 * g * (d + 2).  Returns its units (run every one of ekv_dense_unit, then ekv_dense_merge into out [B, H_kv * g, d];
 * or ekv_dense_run), or -2 (nothing computed) when d, the query heads, the kind or the scratch are outside what the
 * kernel takes, -1 when a sequence's positions lie outside the cache. */
int64_t ekv_dense_job(dense_job *job, const float *q, int batch, int n_kv_heads, int group_queries, int d,
                      float scaling, const uint8_t *k, const uint8_t *v, int64_t head_rows, int64_t batch_rows,
                      int kind, const int64_t *start, const int64_t *stop, float *partial, int64_t partial_floats) {
    if (d > MAX_HEAD_DIM || group_queries > MAX_GROUP_QUERIES || kind < KV_F32 || kind > KV_F16) return -2;
    int64_t span = 0;
    for (int b = 0; b < batch; b++) {
        if (start[b] < 0 || stop[b] > head_rows || start[b] > stop[b]) return -1;
        span = stop[b] - start[b] > span ? stop[b] - start[b] : span;
    }
    const int parts = ekv_dense_parts(span);
    const int64_t units = (int64_t)batch * n_kv_heads * parts;
    if (partial_floats < units * group_queries * (d + 2)) return -2;
    *job = (dense_job){q, k, v, start, stop, batch, n_kv_heads, group_queries, d, kind, parts, head_rows, batch_rows,
                       scaling, partial};
    return units;
}

/* out [B, H_kv, g, d]: each query's parts weighed by their share of the softmax mass (0 where it attends nothing). */
void ekv_dense_merge(const dense_job *j, float *restrict out) {
    const int gq = j->group_queries, d = j->d, parts = j->parts;
    for (int64_t head = 0; head < (int64_t)j->batch * j->n_kv_heads; head++)
        for (int i = 0; i < gq; i++) {
            const float *first = j->partial + (head * parts * gq + i) * (d + 2);
            const int64_t part_floats = (int64_t)gq * (d + 2);
            float top = -INFINITY, total = 0.0f, *o = out + (head * gq + i) * d;
            for (int p = 0; p < parts; p++) top = first[p * part_floats + d] > top ? first[p * part_floats + d] : top;
            memset(o, 0, (size_t)d * sizeof(float));
            if (top == -INFINITY) continue;
            for (int p = 0; p < parts; p++) {
                const float *part = first + p * part_floats;
                if (part[d + 1] == 0.0f) continue;
                const float weight = exp_nonpositive(part[d] - top);
                total += weight * part[d + 1];
                for (int c = 0; c < d; c++) o[c] += weight * part[c];
            }
            for (int c = 0; c < d; c++) o[c] /= total;
        }
}

/* Every unit of a job, then the merge, on the caller's thread (no helper). */
void ekv_dense_run(const dense_job *j, float *out) {
    const int64_t units = (int64_t)j->batch * j->n_kv_heads * j->parts;
    for (int64_t u = 0; u < units; u++) ekv_dense_unit((void *)j, u, 0);
    ekv_dense_merge(j, out);
}
