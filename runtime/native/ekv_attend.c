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
 * -march=native and reassociation allowed (runtime/native_build.py), so the dot products vectorise; single-threaded:
 * the decode step's compute runs on one core and leaves the other to the reads.
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
            for (int j = 0; j < d; j++) {
                cached->scale[j] = half_to_float(r->scale[j]);
                cached->zero[j] = half_to_float(r->zero[j]);
            }
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
        for (int i = 0; i < group_queries; i++) {
            const float *restrict qi = q + i * d;
            float *restrict s = scores + i * most + first, best = top[i];
            for (int t = 0; t < rows; t++) {
                s[t] = scaling * dot(qi, block + t * d, d);
                best = s[t] > best ? s[t] : best;
            }
            top[i] = best;
        }
    }
    for (int i = 0; i < group_queries; i++) {
        float *restrict s = scores + i * most, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            s[t] = exp_nonpositive(s[t] - top[i]);
            sum += s[t];
        }
        total[i] = sum;
        for (int j = 0; j < d; j++) out[i * d + j] = 0.0f;
    }
    for (int64_t first = 0; first < n; first += BLOCK) {
        int rows = n - first < BLOCK ? (int)(n - first) : BLOCK;
        for (int t = 0; t < rows; t++) widen_row(block + t * d, &values[first + t], d, &cached);
        for (int i = 0; i < group_queries; i++) {
            const float *restrict w = scores + i * most + first;
            float *restrict o = out + i * d;
            if (d % CHUNK) {
                for (int t = 0; t < rows; t++)
                    for (int j = 0; j < d; j++) o[j] += w[t] * block[t * d + j];
                continue;
            }
            vfloat acc[MAX_HEAD_DIM / CHUNK]; /* the output in registers over the block's rows: d / CHUNK chains */
            for (int c = 0; c < d / CHUNK; c++) memcpy(&acc[c], o + c * CHUNK, sizeof(vfloat));
            for (int t = 0; t < rows; t++)
                for (int c = 0; c < d / CHUNK; c++) {
                    vfloat row;
                    memcpy(&row, block + t * d + c * CHUNK, sizeof row);
                    acc[c] += w[t] * row;
                }
            for (int c = 0; c < d / CHUNK; c++) memcpy(o + c * CHUNK, &acc[c], sizeof(vfloat));
        }
    }
    for (int i = 0; i < group_queries; i++)
        for (int j = 0; j < d; j++) out[i * d + j] /= total[i];
}

/* The largest head_dim and query heads per KV head a call takes (the caller attends larger ones through torch). */
int ekv_attend_max_head_dim(void) { return MAX_HEAD_DIM; }
int ekv_attend_max_group_queries(void) { return MAX_GROUP_QUERIES; }

/* q [batch, n_kv_heads * group_queries, d] float32 (a KV head's query heads adjacent); out the same shape.
 * records: the slots, `record_stride` bytes apart, `n_slots` of them, in `record_kind`; codes come with `scales`
 * [4] int64, the byte offsets in a record of the keys' scales and zeros and the values' (float16), the keys' per
 * channel [H, d] where `keys_per_channel`, else per token [H, G].  slots/valid [batch, picks] (an invalid pick is
 * skipped).  segments [n_dense, 2] int64: each dense segment's address and its tokens S, the segment [batch, 2,
 * n_kv_heads, S, d] in `dense_kind` (float32 or bfloat16); dense_mask uint8 [batch, sum of S] (`dense_mask_stride`
 * apart), the segments' positions in order, nonzero = attend.  scratch: (picks * group_tokens + sum of S) * (2 row_t
 * + group_queries floats) bytes.  Returns 0; -1 (nothing computed) when a valid pick's slot is outside the slots, -2
 * when d or group_queries exceed the maxima or a kind is unknown (dense rows are never codes). */
int ekv_attend(const float *q, int batch, int n_kv_heads, int group_queries, int d, float scaling,
               const uint8_t *records, int64_t record_stride, int64_t n_slots, const int64_t *slots,
               const uint8_t *valid, int picks, int group_tokens, int record_kind, const int64_t *scales,
               int keys_per_channel, const int64_t *segments, int n_dense, const uint8_t *dense_mask,
               int64_t dense_mask_stride, int dense_kind, void *scratch, float *out) {
    if (d > MAX_HEAD_DIM || group_queries > MAX_GROUP_QUERIES || record_kind < KV_F32 || record_kind > KV_INT4
        || dense_kind < KV_F32 || dense_kind > KV_BF16)
        return -2;
    for (int64_t i = 0; i < (int64_t)batch * picks; i++)
        if (valid[i] && (slots[i] < 0 || slots[i] >= n_slots)) return -1;
    const int64_t row_bytes = (int64_t)d * element_bits[record_kind] / 8, head_bytes = group_tokens * row_bytes;
    const int64_t dense_row_bytes = (int64_t)d * element_bits[dense_kind] / 8;
    const int coded = record_kind >= KV_INT8;
    int64_t most = (int64_t)picks * group_tokens;
    for (int s = 0; s < n_dense; s++) most += segments[2 * s + 1];
    row_t *keys = scratch, *values = keys + most;
    float *scores = (float *)(values + most); /* [group_queries, most] */
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < n_kv_heads; h++) {
            /* this KV head's keys and values, in order: the picks' tokens, then the segments' attended positions */
            int64_t n = 0;
            for (int m = 0; m < picks; m++) {
                int64_t at = (int64_t)b * picks + m;
                if (!valid[at]) continue;
                const uint8_t *rec = records + slots[at] * record_stride;
                prefetch_bytes(rec + h * head_bytes, head_bytes);
                for (int t = 0; t < group_tokens; t++, n++) {
                    keys[n] = (row_t){rec + h * head_bytes + t * row_bytes, NULL, NULL, record_kind, 0};
                    values[n] = (row_t){rec + (n_kv_heads + h) * head_bytes + t * row_bytes, NULL, NULL, record_kind,
                                        0};
                    if (!coded) continue;
                    const int64_t key_at = keys_per_channel ? (int64_t)h * d : (int64_t)h * group_tokens + t;
                    const int64_t value_at = (int64_t)h * group_tokens + t;
                    keys[n].scale = (const uint16_t *)(rec + scales[0]) + key_at;
                    keys[n].zero = (const uint16_t *)(rec + scales[1]) + key_at;
                    keys[n].per_element = keys_per_channel;
                    values[n].scale = (const uint16_t *)(rec + scales[2]) + value_at;
                    values[n].zero = (const uint16_t *)(rec + scales[3]) + value_at;
                }
            }
            const uint8_t *mask = dense_mask + b * dense_mask_stride;
            for (int s = 0; s < n_dense; s++) {
                const int64_t tokens = segments[2 * s + 1], kv_bytes = n_kv_heads * tokens * dense_row_bytes;
                const uint8_t *k = (const uint8_t *)(uintptr_t)segments[2 * s] + b * 2 * kv_bytes
                                   + h * tokens * dense_row_bytes;
                for (int64_t t = 0; t < tokens; t++)
                    if (mask[t]) {
                        keys[n] = (row_t){k + t * dense_row_bytes, NULL, NULL, dense_kind, 0};
                        values[n++] = (row_t){k + kv_bytes + t * dense_row_bytes, NULL, NULL, dense_kind, 0};
                    }
                mask += tokens;
            }
            const float *qh = q + ((int64_t)b * n_kv_heads + h) * group_queries * d;
            float *oh = out + ((int64_t)b * n_kv_heads + h) * group_queries * d;
            if (n == 0) {
                memset(oh, 0, (size_t)group_queries * d * sizeof(float));
            } else if (d == 64) { /* the common head sizes (SmolLM2 64, Gemma 3 256), unrolled */
                attend_head(qh, group_queries, 64, scaling, keys, values, n, most, scores, oh);
            } else if (d == 128) {
                attend_head(qh, group_queries, 128, scaling, keys, values, n, most, scores, oh);
            } else if (d == 256) {
                attend_head(qh, group_queries, 256, scaling, keys, values, n, most, scores, oh);
            } else {
                attend_head(qh, group_queries, d, scaling, keys, values, n, most, scores, oh);
            }
        }
    }
    return 0;
}
