/* The low-rank predictor's group scores in one call (runtime/selector.py LowRankSelector, on a CPU).
 *
 * For each sequence b: the c low-rank queries q[b] [c, rank] against its K_lr rows, stored in blocks of BLOCK tokens,
 * rank-major within a block (a token's row is a column; block_of), then either
 *   - "sum" (c == 1): the logits as they are, or
 *   - "softmax": each query's softmax over the sequence's own tokens (its seq_groups, never the longest row's
 *     n_tokens), summed over the queries (one vote per head),
 * and the maximum over each group of G tokens -> out[b, n_tokens / G] (a sequence's own groups).  The torch path computes the same in float32
 * through a float copy of the rows, a matmul, a softmax and a reduction: five passes over memory and two large
 * temporaries where this makes one pass over the rows and keeps [c, n_tokens] floats of scratch a sequence.
 *
 * Float rows (float32, bfloat16) are widened to float a block of tokens at a time and reused by every query.  Integer
 * rows (int8, or int4 nibbles offset by 8, the even rank position in the low nibble; each token with its bfloat16
 * scale) meet the queries rounded to int8 with their own float scale (round_queries, as runtime/selector.py
 * integer_queries rounds them): the dot products are integers, exact in any order and on any instruction set, then
 * times the query's scale and the token's.  A block's codes are laid out four rank positions a 32-bit lane, a token a
 * lane, once, and every query runs over them with the int8 dot-product instruction where the target has it (AVX-512
 * VNNI: 64 multiply-adds an instruction against 16 for float), plain integer loops elsewhere, the same integers.
 * SmolLM2 8K, int4 rank 96, 9 queries, one layer after another: 173 -> 92 us a call at batch 1, 695 -> 359 us at
 * batch 4; with the softmax's maxima taken a vector at a time (max_of), 60 and 240 us.
 *
 * Built with -O3 -march=native and reassociation allowed (runtime/native_build.py), so the dot products and sums
 * vectorise; never -ffast-math, whose startup code would flush subnormals to zero in the whole process (torch's
 * numbers included).  expf is a polynomial the compiler vectorises (exp_nonpositive).  A call's work comes in units of
 * a part of a sequence, in two phases (ekv_score_job), so the decode step's helper thread (ekv_aside.c) can take part
 * of it, or all of it while the compute thread goes on.
 *
 * Then each sequence's top-M groups (ekv_top, LowRankSelector._top): the M-th best score by a quickselect, the
 * groups above it and the lowest at it, best first (equal scores to the lower group); a posted select's last phase,
 * so the helper hands over picks, not scores, and the compute thread makes no torch call for them (SmolLM2 8K, the
 * deployed configuration: about 10 a layer).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ekv_float.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define EKV_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define EKV_AVX2 1
/* AVX2 without VNNI: a 4-bit code (0..15) times an int8 query (-127..127) a byte, pairs summed into int16 by
 * vpmaddubsw, never saturating for this many quads (2 x 15 x 127 x 8 = 30480 < 32767), then widened to int32 */
enum { NARROW_QUADS = 8 };
#endif

enum { ROWS_F32, ROWS_BF16, ROWS_I8, ROWS_I4 };
/* tokens scored together; the largest rank (64 KiB of widened floats); the most queries a sequence */
enum { BLOCK = 64, MAX_RANK = 256, MAX_QUERIES = 256 };
_Static_assert(BLOCK % CHUNK == 0 && BLOCK % 32 == 0, "a block is whole vectors, and halves of 32 tokens");
/* queries a pass: 3 keep 12 vectors of sums in AVX-512's 32 registers; with AVX2's 16 registers or NEON's 16-byte
 * ones a query's sums alone take 8 or 16 of them, so one */
#if defined(__AVX512F__)
enum { QUERY_BLOCK = 3 };
#else
enum { QUERY_BLOCK = 1 };
#endif

/* The stored rows of the block holding tokens `first` (a multiple of BLOCK) onwards: K_lr is stored a block of BLOCK
 * tokens at a time, `block_bytes` apart, each block rank-major (stored row i's BLOCK tokens, then row i + 1's), so a
 * block is one contiguous stretch the hardware prefetcher follows.  Rank-major rows a whole context apart were one
 * stream a stored row (48 at int4 rank 96), more than it follows, and a prefetch 1-8 blocks ahead did not cover them:
 * SmolLM2 8K, int4 rank 96, 9 queries, rows out of cache, the first phase 232 -> 120 us a sequence at batch 1 and
 * 256 -> 170 at batch 4 (an AVX-512 VM; an AVX2 build 248 -> 181 us). */
static inline const uint8_t *block_of(const uint8_t *rows, int64_t block_bytes, int64_t first) {
    return rows + first / BLOCK * block_bytes;
}

/* rank row i of a block of `n` float rows' tokens (`block`: block_of) as float, zero past n up to BLOCK */
static inline void widen(float *restrict out, const uint8_t *restrict block, int i, int n, int kind) {
    if (kind == ROWS_F32) {
        const float *r = (const float *)block + (int64_t)i * BLOCK;
        for (int j = 0; j < n; j++) out[j] = r[j];
    } else {
        const uint16_t *r = (const uint16_t *)block + (int64_t)i * BLOCK;
        for (int j = 0; j < n; j++) out[j] = bf16_to_float(r[j]);
    }
    for (int j = n; j < BLOCK; j++) out[j] = 0.0f;
}

/* The sums of `nq` queries (rank-long, `rank` apart) over one widened block, into sums [nq, BLOCK]: each stretch of
 * the block feeds every query's sums, which stay in registers (one query at a time, each multiply-add waited on its
 * own load: with 3 queries a pass, SmolLM2 8K, 9 queries, rank 96, int8 rows, a call in cache 182 -> 157 us, one
 * layer after another 199 -> 173 us).  Each sum still runs over the rank in order: the scores are the same bits. */
static inline __attribute__((always_inline)) void block_sums(const float *q, int rank, const float *widened, int nq,
                                                             float *restrict sums) {
    vfloat acc[QUERY_BLOCK][BLOCK / CHUNK] = {{{0}}};
    for (int i = 0; i < rank; i++) {
        const vfloat *w = (const vfloat *)(widened + i * BLOCK); /* widened: CHUNK-aligned rows of BLOCK */
        for (int a = 0; a < nq; a++) {
            const float qi = q[(int64_t)a * rank + i];
            for (int c = 0; c < BLOCK / CHUNK; c++) acc[a][c] += qi * w[c];
        }
    }
    memcpy(sums, acc, (size_t)nq * sizeof acc[0]);
}

/* logits[h * stride + t] = q_h . row_t for every query h of one sequence, float rows, its tokens from <= t < to,
 * BLOCK tokens at a time: the block's rank rows are widened once into a buffer on the stack (one the compiler knows
 * no other store aliases: in the caller's scratch, or filled a chunk of rank rows at a time, the same loops ran half
 * as fast), then the queries' sums run along the tokens, QUERY_BLOCK queries a pass (a query element times a stretch
 * of one rank row: whole vectors, no sum across a row) */
static void logits_of(const uint8_t *rows, int64_t block_bytes, const float *q, int queries,
                      int rank, int64_t from, int64_t to, int kind, float *restrict logits, int64_t stride) {
    float widened[MAX_RANK * BLOCK] __attribute__((aligned(sizeof(vfloat)))), sums[QUERY_BLOCK * BLOCK];
    for (int64_t first = from; first < to; first += BLOCK) {
        int n = to - first < BLOCK ? (int)(to - first) : BLOCK;
        const uint8_t *block = block_of(rows, block_bytes, first);
        for (int i = 0; i < rank; i++) widen(widened + i * BLOCK, block, i, n, kind);
        for (int h = 0; h < queries;) {
            int nq = queries - h >= QUERY_BLOCK ? QUERY_BLOCK : 1;
            if (nq == QUERY_BLOCK) /* constant counts, so the sums' loops unroll into registers */
                block_sums(q + (int64_t)h * rank, rank, widened, QUERY_BLOCK, sums);
            else
                block_sums(q + (int64_t)h * rank, rank, widened, 1, sums);
            for (int a = 0; a < nq; a++, h++) {
                const float *s = sums + a * BLOCK;
                float *restrict l = logits + h * stride + first;
                for (int j = 0; j < n; j++) l[j] = s[j];
            }
        }
    }
}

/* A block of integer rows' codes, n tokens from `first`, as packed [quads][BLOCK] 32-bit lanes: lane t of quad k holds
 * rank positions 4k..4k+3 of token t as unsigned bytes, the lowest first (int4: the nibble 0..15, the code plus 8;
 * int8: the code plus 128); zero past n, and past the stored rows (the queries are zero there).  Plain loops the
 * compiler vectorises: a few shifts and masks a lane, once a block, for every query's dot products. */
static void pack_codes(uint32_t *restrict packed, const uint8_t *block, int rank, int n, int kind) {
    const int quads = (rank + 3) / 4;
    for (int k = 0; k < quads; k++) {
        uint32_t *restrict o = packed + (int64_t)k * BLOCK;
        if (kind == ROWS_I4) { /* two stored rows a quad: positions 4k, 4k + 1 in row 2k, 4k + 2, 4k + 3 in 2k + 1 */
            const uint8_t *a = block + (int64_t)(2 * k) * BLOCK;
            if (4 * k + 2 < rank) {
                const uint8_t *b = a + BLOCK;
                for (int t = 0; t < n; t++) {
                    uint32_t y = a[t] | (uint32_t)b[t] << 16;
                    o[t] = (y | y << 4) & 0x0F0F0F0Fu;
                }
            } else {
                for (int t = 0; t < n; t++) o[t] = (a[t] | (uint32_t)a[t] << 4) & 0x0F0Fu;
            }
        } else {
            for (int t = 0; t < n; t++) o[t] = 0;
            for (int i = 4 * k; i < 4 * k + 4 && i < rank; i++) {
                const uint8_t *r = block + (int64_t)i * BLOCK;
                for (int t = 0; t < n; t++) o[t] |= (uint32_t)(r[t] ^ 0x80u) << (8 * (i - 4 * k));
            }
        }
        for (int t = n; t < BLOCK; t++) o[t] = 0;
    }
}

/* sums [nq, BLOCK] int32 of `nq` int8 queries (`quad_stride` quads apart) over a packed block: each lane's four
 * unsigned codes times the query's four signed ones, summed over the quads.  Integers: the same sums whatever the
 * instructions and their order.  `narrow`: every code below 16 (int4 rows), which AVX2 multiplies a byte at a time
 * (SmolLM2 8K, int4 rank 96, 9 queries, on this 2-core Zen 3: 754 us a layer through the plain loops). */
static inline __attribute__((always_inline)) void block_dots(const uint32_t *packed, int quads, const int8_t *q,
                                                             int quad_stride, int nq, int32_t *restrict sums,
                                                             int narrow) {
#ifdef EKV_AVX2
    if (narrow) {
        const __m256i ones = _mm256_set1_epi16(1);
        for (int a = 0; a < nq; a++)
            for (int half = 0; half < BLOCK / 32; half++) { /* 4 + 4 of the 16 registers */
                __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                  _mm256_setzero_si256()};
                for (int k0 = 0; k0 < quads; k0 += NARROW_QUADS) {
                    __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                        _mm256_setzero_si256()};
                    const int k1 = quads - k0 < NARROW_QUADS ? quads : k0 + NARROW_QUADS;
                    for (int k = k0; k < k1; k++) {
                        int32_t four;
                        memcpy(&four, q + ((int64_t)a * quad_stride + k) * 4, sizeof four);
                        const __m256i query = _mm256_set1_epi32(four);
                        const uint32_t *lane = packed + (int64_t)k * BLOCK + half * 32;
                        for (int c = 0; c < 4; c++)
                            pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(
                                _mm256_load_si256((const __m256i *)(lane + c * 8)), query));
                    }
                    for (int c = 0; c < 4; c++) acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(pairs[c], ones));
                }
                for (int c = 0; c < 4; c++)
                    _mm256_storeu_si256((__m256i *)(sums + a * BLOCK + half * 32 + c * 8), acc[c]);
            }
        return;
    }
#else
    (void)narrow;
#endif
#ifdef EKV_VNNI
    __m512i acc[QUERY_BLOCK][BLOCK / 16];
    for (int a = 0; a < nq; a++)
        for (int c = 0; c < BLOCK / 16; c++) acc[a][c] = _mm512_setzero_si512();
    for (int k = 0; k < quads; k++) {
        __m512i lanes[BLOCK / 16];
        for (int c = 0; c < BLOCK / 16; c++) lanes[c] = _mm512_load_si512(packed + (int64_t)k * BLOCK + c * 16);
        for (int a = 0; a < nq; a++) {
            int32_t four;
            memcpy(&four, q + ((int64_t)a * quad_stride + k) * 4, sizeof four);
            const __m512i query = _mm512_set1_epi32(four);
            for (int c = 0; c < BLOCK / 16; c++) acc[a][c] = _mm512_dpbusd_epi32(acc[a][c], lanes[c], query);
        }
    }
    for (int a = 0; a < nq; a++)
        for (int c = 0; c < BLOCK / 16; c++) _mm512_storeu_si512(sums + a * BLOCK + c * 16, acc[a][c]);
#else
    for (int a = 0; a < nq; a++) {
        int32_t *restrict s = sums + a * BLOCK;
        for (int t = 0; t < BLOCK; t++) s[t] = 0;
        for (int k = 0; k < quads; k++) {
            const int8_t *four = q + ((int64_t)a * quad_stride + k) * 4;
            const int32_t q0 = four[0], q1 = four[1], q2 = four[2], q3 = four[3];
            const uint32_t *restrict lane = packed + (int64_t)k * BLOCK;
            for (int t = 0; t < BLOCK; t++)
                s[t] += (int32_t)(lane[t] & 255) * q0 + (int32_t)(lane[t] >> 8 & 255) * q1
                        + (int32_t)(lane[t] >> 16 & 255) * q2 + (int32_t)(lane[t] >> 24) * q3;
        }
    }
#endif
}

/* The integer rows' logits, as logits_of computes the float rows': logits[h * stride + t] = (q_h . codes_t) times
 * (the query's scale times the token's), each product rounded once, as the torch path rounds them (an integer dot
 * product is exact in float32 below 2^24: at most 127 * 128 * MAX_RANK). */
static void integer_logits_of(const uint8_t *rows, int64_t block_bytes, const uint16_t *scales, const int8_t *q,
                              const float *q_scales, int queries, int rank, int64_t from, int64_t to, int kind,
                              float *restrict logits, int64_t stride) {
    enum { MAX_QUADS = MAX_RANK / 4 };
    uint32_t packed[MAX_QUADS * BLOCK] __attribute__((aligned(64)));
    int32_t sums[QUERY_BLOCK * BLOCK] __attribute__((aligned(64)));
    float token_scale[BLOCK], factor[BLOCK];
    const int quads = (rank + 3) / 4, offset = kind == ROWS_I4 ? 8 : 128;
    int32_t bias[MAX_QUERIES]; /* the codes' offset times each query's sum: the lanes hold codes plus `offset` */
    for (int h = 0; h < queries; h++) {
        bias[h] = 0;
        for (int i = 0; i < quads * 4; i++) bias[h] += offset * q[(int64_t)h * quads * 4 + i];
    }
    for (int64_t first = from; first < to; first += BLOCK) {
        int n = to - first < BLOCK ? (int)(to - first) : BLOCK;
        pack_codes(packed, block_of(rows, block_bytes, first), rank, n, kind);
        for (int j = 0; j < n; j++) token_scale[j] = bf16_to_float(scales[first + j]);
        for (int h = 0; h < queries;) {
            int nq = queries - h >= QUERY_BLOCK ? QUERY_BLOCK : 1;
            if (nq == QUERY_BLOCK)
                block_dots(packed, quads, q + (int64_t)h * quads * 4, quads, QUERY_BLOCK, sums, kind == ROWS_I4);
            else
                block_dots(packed, quads, q + (int64_t)h * quads * 4, quads, 1, sums, kind == ROWS_I4);
            for (int a = 0; a < nq; a++, h++) {
                /* the scales' product, then the dot product times it, in two loops: within one expression the
                 * reassociation the library is built with could reorder the two multiplies */
                for (int j = 0; j < n; j++) factor[j] = q_scales[h] * token_scale[j];
                const int32_t *s = sums + a * BLOCK;
                float *restrict l = logits + h * stride + first;
                for (int j = 0; j < n; j++) l[j] = (float)(s[j] - bias[h]) * factor[j];
            }
        }
    }
}

/* The queries q [batch, heads, d] (a KV head's query heads adjacent) projected to rank r by their KV head's block of
 * `adapter` [kv_heads, d, rank] (runtime/selector.py LowRankSelector._low_rank_queries): "softmax", each head's
 * query times its KV head's projection, times `scaling` -> out [batch, heads, rank]; "sum" (`summed`), each KV head's
 * queries summed first (summing commutes with the projection) and the KV heads' products summed, unscaled -> out
 * [batch, rank].  One call where torch dispatched a reshape, a cast, a broadcast matmul and a multiply, each dearer
 * inside the decode step than alone; the native and the torch scoring paths of a CPU both take these queries, so
 * they round the same numbers.  Returns 0, or -1 (nothing written) for a rank above MAX_RANK or heads that are not
 * a whole number of groups.  `adapter_seq_stride`: floats from one sequence's adapter to the next (0: one adapter
 * for the batch; a prompt's own projection, config 'prompt_adapter', is a sequence's own). */
int ekv_low_rank_queries(const float *q, int batch, int heads, int kv_heads, int d, const float *adapter,
                         int64_t adapter_seq_stride, int rank, float scaling, int summed, float *out) {
    if (rank > MAX_RANK || rank < 1 || kv_heads < 1 || heads % kv_heads || adapter_seq_stride < 0) return -1;
    const int group_queries = heads / kv_heads;
    float sums[MAX_RANK];
    const float *shared = adapter;
    for (int b = 0; b < batch; b++) {
        const float *qb = q + (int64_t)b * heads * d;
        adapter = shared + b * adapter_seq_stride;
        if (summed) {
            for (int j = 0; j < rank; j++) sums[j] = 0.0f;
            for (int g = 0; g < kv_heads; g++)
                for (int i = 0; i < d; i++) {
                    float x = 0.0f;
                    for (int k = 0; k < group_queries; k++) x += qb[(g * group_queries + k) * d + i];
                    const float *row = adapter + ((int64_t)g * d + i) * rank;
                    for (int j = 0; j < rank; j++) sums[j] += x * row[j];
                }
            for (int j = 0; j < rank; j++) out[(int64_t)b * rank + j] = sums[j];
            continue;
        }
        for (int h = 0; h < heads; h++) {
            const float *x = qb + (int64_t)h * d, *block = adapter + (int64_t)(h / group_queries) * d * rank;
            for (int j = 0; j < rank; j++) sums[j] = 0.0f;
            for (int i = 0; i < d; i++)
                for (int j = 0; j < rank; j++) sums[j] += x[i] * block[(int64_t)i * rank + j];
            float *o = out + ((int64_t)b * heads + h) * rank;
            for (int j = 0; j < rank; j++) o[j] = sums[j] * scaling;
        }
    }
    return 0;
}

/* The largest rank and the most queries a sequence a call takes: a selector built for more scores through torch. */
int ekv_score_max_rank(void) { return MAX_RANK; }
int ekv_score_max_queries(void) { return MAX_QUERIES; }

/* The tokens of a stored block: the caller lays K_lr out in blocks of this many (runtime/selector.py KLR_BLOCK_TOKENS
 * checks it). */
int ekv_score_block_tokens(void) { return BLOCK; }

/* A unit's stretch of one sequence's tokens, PART_TOKENS rounded up to whole groups and whole stored blocks: a batch
 * of one scores in parts the caller and the helper thread share (SmolLM2 8K: 8 parts).  Each part keeps its own
 * softmax maximum and sum, and the parts' sums add in order, so the scores are the same bits whichever worker runs
 * which part. */
enum { PART_TOKENS = 1024 };

static int64_t part_tokens(int group_tokens) {
    int64_t a = group_tokens, b = BLOCK;
    while (b) {
        int64_t r = a % b;
        a = b;
        b = r;
    }
    const int64_t whole = (int64_t)group_tokens / a * BLOCK; /* the least multiple of both */
    return (PART_TOKENS + whole - 1) / whole * whole;
}

/* One call's arguments (ekv_score_job), so its (sequence, part) units can run on a helper thread (ekv_aside.c). */
typedef struct {
    const uint8_t *rows;
    int64_t block_bytes, seq_stride_bytes;
    const uint16_t *scales;
    int64_t scale_seq_stride;
    const float *q;
    const int8_t *q_codes;  /* integer rows: the queries rounded to int8 [batch, queries, rank rounded up to 4] */
    const float *q_scales;  /* and their scales [batch, queries] */
    int batch, queries, rank, n_tokens, group_tokens, kind, softmax, parts;
    int64_t part_tokens;
    const int64_t *seq_groups; /* [batch]: a sequence's groups; its softmax spans its own tokens only (NULL: n_tokens) */
    float *logits; /* [batch, queries, n_tokens]: the logits, then each part's e^(logit - the part's maximum) */
    float *stats;  /* [batch, queries, parts, 2]: each part's maximum logit and sum of its e^ */
    float *out;
    int64_t out_seq_stride;
} score_job;

int ekv_score_job_bytes(void) { return (int)sizeof(score_job); }

/* The scratch floats a job of these sizes needs: the logits, each part's two statistics, and for integer rows each
 * query's scale and int8 codes (MAX_RANK bytes, a quarter of as many floats). */
int64_t ekv_score_scratch_floats(int batch, int queries, int n_tokens, int group_tokens) {
    int64_t parts = (n_tokens + part_tokens(group_tokens) - 1) / part_tokens(group_tokens);
    return (int64_t)batch * queries * (n_tokens + 2 * parts + 1 + MAX_RANK / 4);
}

/* Each query of `count` (rank floats) rounded to int8 with its own scale, as runtime/selector.py integer_queries rounds
 * it: the scale is the largest magnitude over 127 (at least the smallest normal float), each element divided by it,
 * rounded half to even and kept within +-127; codes zero past the rank up to `quad_rank`.  Division and rounding are
 * exact IEEE operations, so the two give the same codes and scales. */
static void round_queries(const float *q, int64_t count, int rank, int quad_rank, int8_t *codes, float *scales) {
    for (int64_t a = 0; a < count; a++) {
        const float *x = q + a * rank;
        float top = 0.0f;
        for (int i = 0; i < rank; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
        float scale = top / 127.0f;
        scale = scale < 1.17549435e-38f ? 1.17549435e-38f : scale;
        for (int i = 0; i < quad_rank; i++) {
            float code = i < rank ? nearbyintf(x[i] / scale) : 0.0f;
            codes[a * quad_rank + i] = (int8_t)(code > 127.0f ? 127.0f : code < -127.0f ? -127.0f : code);
        }
        scales[a] = scale;
    }
}

/* ekv_group_scores's arguments into `job` (a caller's buffer of ekv_score_job_bytes()) over `scratch` (at least
 * ekv_score_scratch_floats; one job's alone until it is done).  Returns the units of each of its phases (a sequence
 * times its parts: run every unit of ekv_score_unit, then, with softmax, every unit of ekv_score_vote_unit), or -1
 * for arguments it refuses (see ekv_group_scores). */
int64_t ekv_score_job(score_job *job, const uint8_t *rows, int64_t block_bytes, int64_t seq_stride_bytes,
                      const uint16_t *scales, int64_t scale_seq_stride, const float *q, int batch, int queries,
                      int rank, int n_tokens, int group_tokens, int kind, int softmax, const int64_t *seq_groups,
                      float *scratch, int64_t scratch_floats, float *out, int64_t out_seq_stride) {
    static const int token_bytes[] = {4, 2, 1, 1}; /* of a stored row (an int4 byte holds two rank positions) */
    if (rank > MAX_RANK || queries > MAX_QUERIES || n_tokens % group_tokens || kind < ROWS_F32 || kind > ROWS_I4 ||
        (kind >= ROWS_I8 && scales == NULL) ||
        block_bytes < (int64_t)(kind == ROWS_I4 ? (rank + 1) / 2 : rank) * BLOCK * token_bytes[kind] ||
        scratch_floats < ekv_score_scratch_floats(batch, queries, n_tokens, group_tokens))
        return -1;
    int64_t part = part_tokens(group_tokens);
    int parts = (int)((n_tokens + part - 1) / part);
    const int64_t count = (int64_t)batch * queries;
    float *stats = scratch + count * n_tokens, *q_scales = stats + count * parts * 2;
    int8_t *q_codes = (int8_t *)(q_scales + count);
    if (kind >= ROWS_I8) round_queries(q, count, rank, (rank + 3) / 4 * 4, q_codes, q_scales);
    *job = (score_job){rows, block_bytes, seq_stride_bytes, scales, scale_seq_stride, q, q_codes, q_scales, batch,
                       queries, rank, n_tokens, group_tokens, kind, softmax, parts, part, seq_groups, scratch, stats,
                       out, out_seq_stride};
    return (int64_t)batch * parts;
}

/* The tokens sequence b scores: its own groups' (the rows past them are another length's, or a row's earlier
 * sequence's), so a softmax vote never depends on the sequences beside it. */
static int64_t seq_tokens(const score_job *j, int64_t b) {
    if (j->seq_groups == NULL) return j->n_tokens;
    const int64_t tokens = j->seq_groups[b] * j->group_tokens;
    return tokens < 0 ? 0 : tokens < j->n_tokens ? tokens : j->n_tokens;
}

/* each group's maximum of `scores` [to - from] into o[from / G ...] */
static void group_maxima(const float *scores, int64_t from, int64_t to, int group_tokens, float *o) {
    for (int64_t g = from / group_tokens; g < to / group_tokens; g++) {
        const float *s = scores + g * group_tokens - from;
        float top = s[0];
        for (int t = 1; t < group_tokens; t++) top = s[t] > top ? s[t] : top;
        o[g] = top;
    }
}

/* Phase 1, unit (sequence b, part p): the part's logits; "sum", their group maxima (the scores); "softmax", each
 * query's e^(logit - the part's maximum) in place and the part's maximum and sum. */
void ekv_score_unit(void *ctx, int64_t unit, int worker) {
    (void)worker; /* a job's scratch is its own: no worker keeps state between units */
    const score_job *j = ctx;
    int64_t b = unit / j->parts, p = unit % j->parts, from = p * j->part_tokens, end = seq_tokens(j, b);
    int64_t to = from + j->part_tokens < end ? from + j->part_tokens : end;
    if (from >= to) return; /* past the sequence's tokens */
    float *logits = j->logits + b * j->queries * j->n_tokens;
    const uint8_t *rows = j->rows + b * j->seq_stride_bytes;
    if (j->kind >= ROWS_I8)
        integer_logits_of(rows, j->block_bytes, j->scales + b * j->scale_seq_stride,
                          j->q_codes + b * j->queries * ((j->rank + 3) / 4 * 4), j->q_scales + b * j->queries,
                          j->queries, j->rank, from, to, j->kind, logits, j->n_tokens);
    else
        logits_of(rows, j->block_bytes, j->q + b * j->queries * j->rank, j->queries, j->rank,
                  from, to, j->kind, logits, j->n_tokens);
    if (!j->softmax) {
        group_maxima(logits + from, from, to, j->group_tokens, j->out + b * j->out_seq_stride);
        return;
    }
    for (int h = 0; h < j->queries; h++) {
        float *restrict l = logits + (int64_t)h * j->n_tokens;
        float top = max_of(l + from, to - from, l[from]), total = 0.0f;
        for (int64_t t = from; t < to; t++) {
            l[t] = exp_nonpositive(l[t] - top);
            total += l[t];
        }
        float *stat = j->stats + ((b * j->queries + h) * j->parts + p) * 2;
        stat[0] = top;
        stat[1] = total;
    }
}

/* Phase 2 of "softmax", unit (b, p): each query's softmax over all the sequence's tokens (its parts' sums rescaled to
 * the largest maximum, added in part order), summed over the queries (one vote per head), and the group maxima. */
void ekv_score_vote_unit(void *ctx, int64_t unit, int worker) {
    (void)worker;
    const score_job *j = ctx;
    int64_t b = unit / j->parts, p = unit % j->parts, from = p * j->part_tokens, end = seq_tokens(j, b);
    int64_t to = from + j->part_tokens < end ? from + j->part_tokens : end;
    if (from >= to) return;
    const int parts = (int)((end + j->part_tokens - 1) / j->part_tokens); /* the sequence's own */
    float *votes = j->logits + b * j->queries * j->n_tokens; /* query 0's row: this part's tokens are this unit's */
    for (int h = 0; h < j->queries; h++) {
        const float *stat = j->stats + (b * j->queries + h) * j->parts * 2;
        float top = stat[0], total = 0.0f;
        for (int i = 1; i < parts; i++) top = stat[2 * i] > top ? stat[2 * i] : top;
        for (int i = 0; i < parts; i++) total += stat[2 * i + 1] * exp_nonpositive(stat[2 * i] - top);
        float weight = exp_nonpositive(stat[2 * p] - top) / total;
        const float *restrict e = votes + (int64_t)h * j->n_tokens;
        if (h == 0) {
            for (int64_t t = from; t < to; t++) votes[t] = e[t] * weight;
        } else {
            for (int64_t t = from; t < to; t++) votes[t] += e[t] * weight;
        }
    }
    group_maxima(votes + from, from, to, j->group_tokens, j->out + b * j->out_seq_stride);
}

/* scratch: ekv_score_scratch_floats.  rows: K_lr in blocks of BLOCK tokens (block_of), rank-major within one: token
 * t's rank row i of sequence b at rows + b * seq_stride_bytes + t / BLOCK * block_bytes + (i * BLOCK + t % BLOCK)
 * times the row format's bytes (int4: stored row i / 2, nibble i % 2); scales: bfloat16 [n] a sequence, or NULL for
 * float rows.  seq_groups: int64 [batch], each sequence's groups (its tokens: seq_groups[b] * G, at most n_tokens),
 * or NULL where every sequence has n_tokens.
 * q: float [batch, queries, rank] (rounded to int8 here for integer rows).  Returns 0, or -1 (nothing computed: the
 * caller takes the torch path) when the rank or the queries exceed their maxima, n_tokens is not a whole number of
 * groups, the kind is unknown, integer rows come without their scales, a block is shorter than its rows, or the
 * scratch is short. */
int ekv_group_scores(const uint8_t *rows, int64_t block_bytes, int64_t seq_stride_bytes, const uint16_t *scales,
                     int64_t scale_seq_stride, const float *q, int batch, int queries, int rank, int n_tokens,
                     int group_tokens, int kind, int softmax, const int64_t *seq_groups, float *scratch,
                     int64_t scratch_floats, float *out, int64_t out_seq_stride) {
    score_job job;
    int64_t units = ekv_score_job(&job, rows, block_bytes, seq_stride_bytes, scales, scale_seq_stride, q, batch,
                                  queries, rank, n_tokens, group_tokens, kind, softmax, seq_groups, scratch,
                                  scratch_floats, out, out_seq_stride);
    if (units < 0) return -1;
    for (int64_t u = 0; u < units; u++) ekv_score_unit(&job, u, 0);
    for (int64_t u = 0; softmax && u < units; u++) ekv_score_vote_unit(&job, u, 0);
    return 0;
}

/* The top-M's arguments (ekv_top_job), so its units, a sequence each, can run on the helper thread after a posted
 * job's scores.  A sequence's candidates are the groups first <= g < min(counts[b], max_groups) scoring above -inf
 * (as the torch path's topk keeps values > -inf; a NaN is none either); the M best, ties to the lower group, sorted
 * best first in the sequence's own row of picks. */
typedef struct {
    const float *scores; /* [batch, scores_stride]: each group's score */
    int64_t scores_stride;
    const int64_t *counts; /* [batch]: a sequence's groups past its last candidate */
    int64_t *picks;        /* [batch, M]: the picks, best first; -1 past the candidates */
    int first, M, max_groups;
} top_job;

int ekv_top_job_bytes(void) { return (int)sizeof(top_job); }

/* whether group a is worse than group b: a lower score, or the same score and a higher group */
static inline int worse(const float *s, int64_t a, int64_t b) { return s[a] < s[b] || (s[a] == s[b] && a > b); }

/* heap[0 .. n) a min-heap by `worse` (the worst at the root); sift heap[at] down */
static void sift_down(const float *s, int64_t *heap, int n, int at) {
    for (;;) {
        int child = 2 * at + 1;
        if (child >= n) return;
        if (child + 1 < n && worse(s, heap[child + 1], heap[child])) child++;
        if (!worse(s, heap[child], heap[at])) return;
        int64_t t = heap[at];
        heap[at] = heap[child];
        heap[child] = t;
        at = child;
    }
}

/* The k-th largest (k >= 1) of v[0 .. n), v reordered: a quickselect (Hoare's partition about a median of three),
 * linear in n where a heap of M costs a sift for every candidate that beats its root, and K_lr's scores rising with
 * the position (recent groups score higher) beat it at almost every one (4 rows of 2048 groups, M 205, this VM:
 * the heap 173-295 us, this 66-76). */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return v[want]; /* between the two runs: the pivot's value */
    }
    return v[want];
}

/* The candidates of s[first .. end) in picks[0 .. M), the M best where there are more (a heap of M, the worst at its
 * root: where the quickselect's copy cannot be had); their count. */
static int heap_of_best(const float *s, int64_t first, int64_t end, int M, int64_t *picks) {
    int n = 0;
    for (int64_t g = first; g < end; g++) {
        if (!(s[g] > -__builtin_inff())) continue; /* -inf (and NaN): never a pick, as topk's values > -inf */
        if (n < M) {
            picks[n++] = g;
        } else {
            if (n == M) { /* full: a heap from here on */
                for (int at = M / 2 - 1; at >= 0; at--) sift_down(s, picks, M, at);
                n++;
            }
            if (worse(s, picks[0], g)) {
                picks[0] = g;
                sift_down(s, picks, M, 0);
            }
        }
    }
    return n < M ? n : M;
}

void ekv_top_unit(void *ctx, int64_t unit, int worker) {
    (void)worker;
    const top_job *j = ctx;
    const float *s = j->scores + unit * j->scores_stride;
    int64_t *picks = j->picks + unit * j->M;
    const int64_t end = j->counts[unit] < j->max_groups ? j->counts[unit] : j->max_groups;
    const int64_t span = end > j->first ? end - j->first : 0;
    float *scores = span > j->M ? malloc(span * sizeof(float)) : NULL;
    int64_t valid = 0;
    for (int64_t g = j->first; scores && g < end; g++)
        if (s[g] > -__builtin_inff()) scores[valid++] = s[g]; /* -inf and NaN: never a pick */
    int n = 0;
    if (valid > j->M) { /* the M-th best score, then the groups above it and the lowest at it */
        const float at = kth_largest(scores, valid, j->M);
        int64_t ties = j->M;
        for (int64_t g = j->first; g < end; g++) ties -= s[g] > at;
        for (int64_t g = j->first; g < end && n < j->M; g++)
            if (s[g] > at || (s[g] == at && ties-- > 0)) picks[n++] = g;
    } else {
        n = heap_of_best(s, j->first, end, j->M, picks);
    }
    free(scores);
    for (int k = n; k < j->M; k++) picks[k] = -1;
    for (int at = n / 2 - 1; at >= 0; at--) sift_down(s, picks, n, at); /* the worst at the root */
    for (int k = n - 1; k > 0; k--) { /* the worst to the end, one at a time: best first */
        int64_t t = picks[0];
        picks[0] = picks[k];
        picks[k] = t;
        sift_down(s, picks, k, 0);
    }
}

/* The job for `batch` sequences (its units: one a sequence); -1 for a size it cannot take. */
int64_t ekv_top_job(top_job *job, const float *scores, int64_t scores_stride, int batch, const int64_t *counts,
                    int first, int M, int max_groups, int64_t *picks) {
    if (batch < 0 || M < 1 || first < 0 || max_groups > scores_stride) return -1;
    *job = (top_job){scores, scores_stride, counts, picks, first, M, max_groups};
    return batch;
}

/* The job run at once on the caller. */
int ekv_top(const float *scores, int64_t scores_stride, int batch, const int64_t *counts, int first, int M,
            int max_groups, int64_t *picks) {
    top_job job;
    int64_t units = ekv_top_job(&job, scores, scores_stride, batch, counts, first, M, max_groups, picks);
    if (units < 0) return -1;
    for (int64_t u = 0; u < units; u++) ekv_top_unit(&job, u, 0);
    return 0;
}

/* ---- a posted select in one call (LowRankSelector._launch_posted) ------------------------------------------------ */

typedef int64_t (*ekv_post_chain_fn)(void *aside, void (*const *fns)(void *, int64_t, int), void *const *ctxs,
                                     const int64_t *units, int n);

typedef struct { /* a posted select's jobs: its scores' and its top-M's, alive until the helper has run them */
    score_job score;
    top_job top;
} launch_jobs;

int ekv_launch_bytes(void) { return (int)sizeof(launch_jobs); }

/* The low-rank queries of q (ekv_low_rank_queries, into `queries`; "sum" unless `softmax`), their scores' job over the
 * rows (ekv_score_job), the top-M's over those scores (ekv_top_job), and the three posted to the helper thread by
 * `post_chain` (ekv_aside.c ekv_aside_post_chain, passed by address with its handle `aside`): one call from Python
 * where the launch took six, each dearer inside the decode step than alone.  Returns the posted chain's ticket, or -1
 * (nothing posted) for arguments a part refuses: the caller, which checked the shapes when it was built, raises. */
int64_t ekv_score_launch(launch_jobs *jobs, ekv_post_chain_fn post_chain, void *aside, const float *q, int batch,
                         int heads, int kv_heads, int d, const float *adapter, int64_t adapter_seq_stride, int rank,
                         float scaling, float *queries,
                         const uint8_t *rows, int64_t block_bytes, int64_t seq_stride_bytes, const uint16_t *scales,
                         int64_t scale_seq_stride, int kind, int n_tokens, int group_tokens, int softmax,
                         float *scratch, int64_t scratch_floats, float *out, int64_t out_stride,
                         const int64_t *counts, int first, int M, int max_groups, int64_t *picks) {
    if (ekv_low_rank_queries(q, batch, heads, kv_heads, d, adapter, adapter_seq_stride, rank, scaling, !softmax,
                             queries))
        return -1;
    int64_t units = ekv_score_job(&jobs->score, rows, block_bytes, seq_stride_bytes, scales, scale_seq_stride,
                                  queries, batch, softmax ? heads : 1, rank, n_tokens, group_tokens, kind, softmax,
                                  counts, scratch, scratch_floats, out, out_stride);
    int64_t top_units = ekv_top_job(&jobs->top, out, out_stride, batch, counts, first, M, max_groups, picks);
    if (units < 0 || top_units < 0) return -1;
    void (*fns[3])(void *, int64_t, int) = {ekv_score_unit, ekv_score_vote_unit, ekv_top_unit};
    void *ctxs[3] = {&jobs->score, &jobs->score, &jobs->top};
    int64_t phase_units[3] = {units, units, top_units};
    if (!softmax) { /* "sum": the scores' one phase, then the top-M */
        fns[1] = ekv_top_unit;
        ctxs[1] = &jobs->top;
        phase_units[1] = top_units;
    }
    return post_chain(aside, fns, ctxs, phase_units, softmax ? 3 : 2);
}
