/* Decode attention of a disk policy straight from its reuse slots (runtime/record_attention.py, on a CPU).
 *
 * One query token per sequence attends the keys of its picked group records, read where the reader put them (a record
 * is K [H, G, d] then V [H, G, d] in float32 or bfloat16, runtime/quant.py FloatRecord; or int8 / int4 codes with
 * their float16 scales and zeros, QuantRecord), and of dense segments held in memory (the sinks and the ring, each
 * [B, 2, H, S, d] in the model's float32 or bfloat16, with a mask of the positions to attend).
 * The torch path gathers the picked records into a new tensor, permutes them into [2, B, H, S, d], concatenates the
 * segments, then runs a matmul, a softmax and a second matmul over that copy: four passes over ~1 MB a layer, a
 * dozen calls. Here each key and value is widened once, in place, and used by every query head of its KV head.
 *
 * Scores and sums are float32 (the torch path rounds a bfloat16 model's scores to bfloat16), three passes over a
 * KV head's keys: the scores and their maximum, the exponentials and their sum, the values weighed. Built with -O3
 * -march=native and reassociation allowed (runtime/native_build.py), so the dot products vectorise.  A call's units
 * are its (sequence, KV head) pairs, so the decode step's helper thread (ekv_aside.c) can take some of them.
 */
#include <stdint.h>
#include <string.h>

#include "ekv_float.h"

enum { KV_F32, KV_BF16, KV_INT8, KV_INT4 };
enum { MAX_HEAD_DIM = 256, MAX_GROUP_QUERIES = 32, BLOCK = 32 }; /* BLOCK: rows widened at once */

/* One key or value row: its elements, and for codes their scale and zero (float16), one per element (`per_element`,
 * a group's keys scaled per channel) or one for the row (values, and keys of groups too small for channels). */
typedef struct {
    const uint8_t *row;
    const uint16_t *scale, *zero;
    int32_t kind, per_element;
} row_t;

/* The per-channel scales and zeros of the keys last widened, as float: a record's G key rows of a head share them
 * and follow each other, so each is converted once a record, not once a row (SmolLM2's heads, 230 picks, a call in
 * cache: int8 records 103 -> 83 us, int4 273 -> 94 us with the nibbles split a byte at a time; bfloat16 55 us). */
typedef struct {
    const uint16_t *from;
    float scale[MAX_HEAD_DIM], zero[MAX_HEAD_DIM];
} scales_t;

/* one row of d elements as float: codes times their scale plus their zero (runtime/quant.py Quantized.dequantize) */
static inline void widen_row(float *restrict out, const row_t *r, int d, scales_t *restrict cached) {
    if (r->kind == KV_F32) {
        memcpy(out, r->row, (size_t)d * sizeof(float));
        return;
    }
    if (r->kind == KV_BF16) {
        const uint16_t *e = (const uint16_t *)r->row;
        for (int j = 0; j < d; j++) out[j] = bf16_to_float(e[j]);
        return;
    }
    widen_codes(out, r->row, d, r->kind == KV_INT8 ? 8 : 4);
    if (r->per_element) {
        if (cached->from != r->scale) {
            halves_to_floats(cached->scale, r->scale, d);
            halves_to_floats(cached->zero, r->zero, d);
            cached->from = r->scale;
        }
        for (int j = 0; j < d; j++) out[j] = out[j] * cached->scale[j] + cached->zero[j];
    } else {
        const float scale = half_to_float(r->scale[0]), zero = half_to_float(r->zero[0]);
        for (int j = 0; j < d; j++) out[j] = out[j] * scale + zero;
    }
}

static const int64_t element_bits[] = {32, 16, 8, 4};

/* Asked for ahead: a KV head's keys as their pointers are collected, its values a block at a time as the keys are
 * scored, so the value pass finds them in cache.  Picked records are short stretches spread over the slots, fresh
 * from the disk's DMA and in no cache, where the hardware prefetcher cannot guess them.  SmolLM2 8K, batch 1, ~900
 * keys a KV head, records out of cache: 125 -> 111 us a call (in cache: 60 us). */
static inline void prefetch_bytes(const uint8_t *at, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(at + line, 0, 1);
}

/* One KV head's attention over its n keys and values (rows), for its group_queries queries: a block of rows is
 * widened once and serves every query; a query's weighed values are summed over the block in registers, d / CHUNK
 * independent chains (d a constant where inlined: one chain waited on its own adds, 61 -> 50 us a call in cache). */
static inline __attribute__((always_inline)) void attend_head(const float *q, int group_queries, int d, float scaling,
        const row_t *keys, const row_t *values, int64_t n, int64_t most, float *scores, float *restrict out) {
    float block[BLOCK * MAX_HEAD_DIM], top[MAX_GROUP_QUERIES], total[MAX_GROUP_QUERIES];
    scales_t cached;
    cached.from = NULL;
    for (int i = 0; i < group_queries; i++) top[i] = -INFINITY;
    for (int64_t first = 0; first < n; first += BLOCK) {
        int rows = n - first < BLOCK ? (int)(n - first) : BLOCK;
        for (int t = 0; t < rows; t++)
            prefetch_bytes(values[first + t].row, d * element_bits[values[first + t].kind] / 8);
        for (int t = 0; t < rows; t++) widen_row(block + t * d, &keys[first + t], d, &cached);
        for (int i = 0; i < group_queries; i++)
            top[i] = scores_of(q + i * d, block, rows, d, scaling, scores + i * most + first, top[i]);
    }
    for (int i = 0; i < group_queries; i++) {
        total[i] = exponentials(scores + i * most, n, top[i]);
        for (int j = 0; j < d; j++) out[i * d + j] = 0.0f;
    }
    for (int64_t first = 0; first < n; first += BLOCK) {
        int rows = n - first < BLOCK ? (int)(n - first) : BLOCK;
        for (int t = 0; t < rows; t++) widen_row(block + t * d, &values[first + t], d, &cached);
        for (int i = 0; i < group_queries; i++) weigh_values(out + i * d, scores + i * most + first, block, rows, d);
    }
    for (int i = 0; i < group_queries; i++)
        for (int j = 0; j < d; j++) out[i * d + j] /= total[i];
}

/* The largest head_dim and query heads per KV head a call takes (the caller attends larger ones through torch). */
int ekv_attend_max_head_dim(void) { return MAX_HEAD_DIM; }
int ekv_attend_max_group_queries(void) { return MAX_GROUP_QUERIES; }

/* One call's arguments and the sizes derived from them (ekv_attend_job), so its (sequence, KV head) units can be
 * shared with the decode step's helper thread (ekv_aside.c). */
typedef struct {
    const float *q;
    int batch, n_kv_heads, group_queries, d;
    float scaling;
    const uint8_t *records;
    int64_t record_stride;
    const int64_t *slots;
    const uint8_t *valid;
    int picks, group_tokens, record_kind;
    const int64_t *scales;
    int keys_per_channel;
    const int64_t *segments;
    int n_dense;
    const uint8_t *dense_mask;
    int64_t dense_mask_stride;
    int dense_kind;
    uint8_t *scratch;
    int64_t worker_bytes, most, row_bytes, head_bytes, dense_row_bytes;
    float *out;
} attend_job;

int ekv_attend_job_bytes(void) { return (int)sizeof(attend_job); }

/* A worker's scratch bytes for a call of `picks` picks of `group_tokens` and `dense_tokens` dense positions. */
int64_t ekv_attend_scratch_bytes(int picks, int group_tokens, int64_t dense_tokens, int group_queries) {
    return ((int64_t)picks * group_tokens + dense_tokens) * (2 * (int64_t)sizeof(row_t) + group_queries * 4);
}

/* ekv_attend's arguments into `job` (a caller's buffer of ekv_attend_job_bytes()), worker w's scratch at scratch +
 * w * worker_bytes (at least ekv_attend_scratch_bytes).  Returns the units (batch * n_kv_heads: run every one of
 * ekv_attend_unit), or ekv_attend's refusals. */
int64_t ekv_attend_job(attend_job *job, const float *q, int batch, int n_kv_heads, int group_queries, int d,
                       float scaling, const uint8_t *records, int64_t record_stride, int64_t n_slots,
                       const int64_t *slots, const uint8_t *valid, int picks, int group_tokens, int record_kind,
                       const int64_t *scales, int keys_per_channel, const int64_t *segments, int n_dense,
                       const uint8_t *dense_mask, int64_t dense_mask_stride, int dense_kind, void *scratch,
                       int64_t worker_bytes, float *out) {
    if (d > MAX_HEAD_DIM || group_queries > MAX_GROUP_QUERIES || record_kind < KV_F32 || record_kind > KV_INT4
        || dense_kind < KV_F32 || dense_kind > KV_BF16)
        return -2;
    for (int64_t i = 0; i < (int64_t)batch * picks; i++)
        if (valid[i] && (slots[i] < 0 || slots[i] >= n_slots)) return -1;
    int64_t dense_tokens = 0;
    for (int s = 0; s < n_dense; s++) dense_tokens += segments[2 * s + 1];
    if (worker_bytes < ekv_attend_scratch_bytes(picks, group_tokens, dense_tokens, group_queries)) return -2;
    const int64_t row_bytes = (int64_t)d * element_bits[record_kind] / 8;
    *job = (attend_job){q, batch, n_kv_heads, group_queries, d, scaling, records, record_stride, slots, valid, picks,
                        group_tokens, record_kind, scales, keys_per_channel, segments, n_dense, dense_mask,
                        dense_mask_stride, dense_kind, scratch, worker_bytes, (int64_t)picks * group_tokens
                        + dense_tokens, row_bytes, group_tokens * row_bytes,
                        (int64_t)d * element_bits[dense_kind] / 8, out};
    return (int64_t)batch * n_kv_heads;
}

/* Unit (sequence b, KV head h) of a job: that head's query heads over its keys and values, in order the picks'
 * tokens, then the segments' attended positions. */
void ekv_attend_unit(void *ctx, int64_t unit, int worker) {
    const attend_job *j = ctx;
    const int b = (int)(unit / j->n_kv_heads), h = (int)(unit % j->n_kv_heads), coded = j->record_kind >= KV_INT8;
    row_t *keys = (row_t *)(j->scratch + worker * j->worker_bytes), *values = keys + j->most;
    float *scores = (float *)(values + j->most); /* [group_queries, most] */
    int64_t n = 0;
    for (int m = 0; m < j->picks; m++) {
        int64_t at = (int64_t)b * j->picks + m;
        if (!j->valid[at]) continue;
        const uint8_t *rec = j->records + j->slots[at] * j->record_stride;
        prefetch_bytes(rec + h * j->head_bytes, j->head_bytes);
        if (coded) { /* a record's scales and zeros are lines of their own, each a demand miss when first read
                      * (SmolLM2 8K, 205 int4 records, one layer after another: 233 -> 114 us a call) */
            const int64_t key_scales = (j->keys_per_channel ? j->d : j->group_tokens) * 2;
            prefetch_bytes(rec + j->scales[0] + h * key_scales, key_scales);
            prefetch_bytes(rec + j->scales[1] + h * key_scales, key_scales);
            prefetch_bytes(rec + j->scales[2] + h * j->group_tokens * 2, j->group_tokens * 2);
            prefetch_bytes(rec + j->scales[3] + h * j->group_tokens * 2, j->group_tokens * 2);
        }
        for (int t = 0; t < j->group_tokens; t++, n++) {
            keys[n] = (row_t){rec + h * j->head_bytes + t * j->row_bytes, NULL, NULL, j->record_kind, 0};
            values[n] = (row_t){rec + (j->n_kv_heads + h) * j->head_bytes + t * j->row_bytes, NULL, NULL,
                                j->record_kind, 0};
            if (!coded) continue;
            const int64_t key_at = j->keys_per_channel ? (int64_t)h * j->d : (int64_t)h * j->group_tokens + t;
            const int64_t value_at = (int64_t)h * j->group_tokens + t;
            keys[n].scale = (const uint16_t *)(rec + j->scales[0]) + key_at;
            keys[n].zero = (const uint16_t *)(rec + j->scales[1]) + key_at;
            keys[n].per_element = j->keys_per_channel;
            values[n].scale = (const uint16_t *)(rec + j->scales[2]) + value_at;
            values[n].zero = (const uint16_t *)(rec + j->scales[3]) + value_at;
        }
    }
    const uint8_t *mask = j->dense_mask + b * j->dense_mask_stride;
    for (int s = 0; s < j->n_dense; s++) {
        const int64_t tokens = j->segments[2 * s + 1], kv_bytes = j->n_kv_heads * tokens * j->dense_row_bytes;
        const uint8_t *k = (const uint8_t *)(uintptr_t)j->segments[2 * s] + b * 2 * kv_bytes
                           + h * tokens * j->dense_row_bytes;
        for (int64_t t = 0; t < tokens; t++)
            if (mask[t]) {
                keys[n] = (row_t){k + t * j->dense_row_bytes, NULL, NULL, j->dense_kind, 0};
                values[n++] = (row_t){k + kv_bytes + t * j->dense_row_bytes, NULL, NULL, j->dense_kind, 0};
            }
        mask += tokens;
    }
    const int gq = j->group_queries, d = j->d;
    const float *qh = j->q + ((int64_t)b * j->n_kv_heads + h) * gq * d;
    float *oh = j->out + ((int64_t)b * j->n_kv_heads + h) * gq * d;
    if (n == 0) {
        memset(oh, 0, (size_t)gq * d * sizeof(float));
    } else if (d == 64) { /* the common head sizes (SmolLM2 64, Gemma 3 256), unrolled */
        attend_head(qh, gq, 64, j->scaling, keys, values, n, j->most, scores, oh);
    } else if (d == 128) {
        attend_head(qh, gq, 128, j->scaling, keys, values, n, j->most, scores, oh);
    } else if (d == 256) {
        attend_head(qh, gq, 256, j->scaling, keys, values, n, j->most, scores, oh);
    } else {
        attend_head(qh, gq, d, j->scaling, keys, values, n, j->most, scores, oh);
    }
}

/* q [batch, n_kv_heads * group_queries, d] float32 (a KV head's query heads adjacent); out the same shape.
 * records: the slots, `record_stride` bytes apart, `n_slots` of them, in `record_kind`; codes come with `scales`
 * [4] int64, the byte offsets in a record of the keys' scales and zeros and the values' (float16), the keys' per
 * channel [H, d] where `keys_per_channel`, else per token [H, G].  slots/valid [batch, picks] (an invalid pick is
 * skipped).  segments [n_dense, 2] int64: each dense segment's address and its tokens S, the segment [batch, 2,
 * n_kv_heads, S, d] in `dense_kind` (float32 or bfloat16); dense_mask uint8 [batch, sum of S] (`dense_mask_stride`
 * apart), the segments' positions in order, nonzero = attend.  scratch: ekv_attend_scratch_bytes.  Returns 0; -1
 * (nothing computed) when a valid pick's slot is outside the slots, -2 when d or group_queries exceed the maxima, a
 * kind is unknown (dense rows are never codes) or the scratch is short. */
int ekv_attend(const float *q, int batch, int n_kv_heads, int group_queries, int d, float scaling,
               const uint8_t *records, int64_t record_stride, int64_t n_slots, const int64_t *slots,
               const uint8_t *valid, int picks, int group_tokens, int record_kind, const int64_t *scales,
               int keys_per_channel, const int64_t *segments, int n_dense, const uint8_t *dense_mask,
               int64_t dense_mask_stride, int dense_kind, void *scratch, int64_t scratch_bytes, float *out) {
    attend_job job;
    int64_t units = ekv_attend_job(&job, q, batch, n_kv_heads, group_queries, d, scaling, records, record_stride,
                                   n_slots, slots, valid, picks, group_tokens, record_kind, scales, keys_per_channel,
                                   segments, n_dense, dense_mask, dense_mask_stride, dense_kind, scratch,
                                   scratch_bytes, out);
    if (units < 0) return (int)units;
    for (int64_t u = 0; u < units; u++) ekv_attend_unit(&job, u, 0);
    return 0;
}

/* The step's own K and V into their window ring (runtime/offload/window.py Window._write_native): `rows` rows of
 * `row_bytes` from k, then as many from v (each contiguous, [batch, H_kv] rows of one token's head), to rows
 * `at[i] + offset` of `dst` (`at`: K's rows, then V's).  One call where torch's two index_put calls cost ~70 us a
 * layer inside a decode step. */
void ekv_put_rows(uint8_t *dst, int64_t row_bytes, const int64_t *at, int64_t offset, const uint8_t *k,
                  const uint8_t *v, int64_t rows) {
    for (int64_t i = 0; i < 2 * rows; i++)
        memcpy(dst + (at[i] + offset) * row_bytes, (i < rows ? k + i * row_bytes : v + (i - rows) * row_bytes),
               row_bytes);
}
