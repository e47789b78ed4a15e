/* The low-rank predictor's group scores in one call (runtime/selector.py LowRankSelector, on a CPU).
 *
 * For each sequence b: the c low-rank queries q[b] [c, rank] against its K_lr rows [n_tokens, rank], each row
 * widened to float once and reused by every query (float32, bfloat16, int8, or int4 nibbles offset by 8, low nibble
 * first; integer rows times their bfloat16 per-token scale), then either
 *   - "sum" (c == 1): the logits as they are, or
 *   - "softmax": each query's softmax over the tokens, summed over the queries (one vote per head),
 * and the maximum over each group of G tokens -> out[b, n_tokens / G].  The torch path computes the same in float32
 * through a float copy of the rows, a matmul, a softmax and a reduction: five passes over memory and two large
 * temporaries where this makes one pass over the rows and keeps [c, n_tokens] floats of scratch.
 *
 * Built with -O3 -march=native and reassociation allowed (runtime/native_build.py), so the dot products and sums
 * vectorise; never -ffast-math, whose startup code would flush subnormals to zero in the whole process (torch's
 * numbers included).  expf is a polynomial the compiler vectorises (exp_nonpositive).  Single-threaded: a disk
 * policy's decode step runs torch on one core and leaves the other to the reads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { ROWS_F32, ROWS_BF16, ROWS_I8, ROWS_I4 };

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^x for x <= 0, within ~2 ulp of expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so n ln2 is exact),
 * e^r by its Taylor series to r^7 / 7!, times 2^n built in the exponent bits.  Below -87 (e^x < 2^-125, nothing
 * beside the row's maximum, whose term is 1) it returns e^-87 rather than a subnormal. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720
              + r * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* one token's row as float [rank], integer rows unscaled */
static inline void widen(float *restrict out, const uint8_t *restrict row, int rank, int kind) {
    if (kind == ROWS_F32) {
        memcpy(out, row, (size_t)rank * sizeof(float));
    } else if (kind == ROWS_BF16) {
        const uint16_t *r = (const uint16_t *)row;
        for (int i = 0; i < rank; i++) out[i] = bf16_to_float(r[i]);
    } else if (kind == ROWS_I8) {
        const int8_t *r = (const int8_t *)row;
        for (int i = 0; i < rank; i++) out[i] = (float)r[i];
    } else {
        for (int i = 0; i < rank / 2; i++) {
            out[2 * i] = (float)(row[i] & 15) - 8.0f;
            out[2 * i + 1] = (float)(row[i] >> 4) - 8.0f;
        }
        if (rank % 2) out[rank - 1] = (float)(row[rank / 2] & 15) - 8.0f;
    }
}

/* logits[h, t] = scale_t * (q_h . row_t) for every query h of one sequence */
static void logits_of(const uint8_t *rows, int64_t row_bytes, const uint16_t *scales, const float *q, int queries,
                      int rank, int n_tokens, int kind, float *restrict widened, float *restrict logits) {
    for (int t = 0; t < n_tokens; t++) {
        widen(widened, rows + t * row_bytes, rank, kind);
        float scale = scales ? bf16_to_float(scales[t]) : 1.0f;
        for (int h = 0; h < queries; h++) {
            const float *restrict qh = q + (int64_t)h * rank;
            float acc = 0.0f;
            for (int i = 0; i < rank; i++) acc += qh[i] * widened[i];
            logits[(int64_t)h * n_tokens + t] = acc * scale;
        }
    }
}

/* each query's softmax over the tokens, summed into row 0 */
static void softmax_votes(float *restrict logits, int queries, int n_tokens) {
    for (int h = 0; h < queries; h++) {
        float *restrict l = logits + (int64_t)h * n_tokens;
        float top = l[0], total = 0.0f;
        for (int t = 1; t < n_tokens; t++) top = l[t] > top ? l[t] : top;
        for (int t = 0; t < n_tokens; t++) {
            l[t] = exp_nonpositive(l[t] - top);
            total += l[t];
        }
        float inv = 1.0f / total;
        if (h == 0) {
            for (int t = 0; t < n_tokens; t++) l[t] *= inv;
        } else {
            for (int t = 0; t < n_tokens; t++) logits[t] += l[t] * inv;
        }
    }
}

/* Returns 0, or -1 when rank exceeds the widened row's room (the caller takes the torch path). */
int ekv_group_scores(const uint8_t *rows, int64_t row_bytes, int64_t seq_stride_bytes, const uint16_t *scales,
                     int64_t scale_seq_stride, const float *q, int batch, int queries, int rank, int n_tokens,
                     int group_tokens, int kind, int softmax, float *scratch, float *out, int64_t out_seq_stride) {
    float widened[4096];
    if (rank > 4096 || n_tokens % group_tokens) return -1;
    for (int b = 0; b < batch; b++) {
        logits_of(rows + b * seq_stride_bytes, row_bytes, scales ? scales + b * scale_seq_stride : NULL,
                  q + (int64_t)b * queries * rank, queries, rank, n_tokens, kind, widened, scratch);
        if (softmax) softmax_votes(scratch, queries, n_tokens);
        float *o = out + b * out_seq_stride;
        for (int g = 0; g < n_tokens / group_tokens; g++) {
            const float *s = scratch + (int64_t)g * group_tokens;
            float top = s[0];
            for (int j = 1; j < group_tokens; j++) top = s[j] > top ? s[j] : top;
            o[g] = top;
        }
    }
    return 0;
}
