/* Decode attention over quantized KV groups, straight from the uint8 codes (arkv's quantized state).
 *
 * One record per group of `gt` tokens (runtime/qattn.py GroupLayout gives the byte offsets):
 * key codes [H, gt, db], value codes [H, gt, db], key scale and zero [H, d] (float16, one per channel
 * over the group), value scale and zero [H, gt] (float16, one per token), positions [gt] (int32, < 0:
 * a hole).  db = d * bits / 8; int4 keeps the even channel in the low nibble.
 *
 * Scores fold the scales into the query, so no key is ever dequantized:
 *   q . k_t = sum_c (q_c * s_c) * code_tc + sum_c q_c * z_c            (one q' and bias per group and head)
 * and values fold the weights into the scales:
 *   sum_t w_t v_t = sum_t (w_t * s_t) * code_t + sum_t w_t * z_t
 * Built with -O3 -march=native -fopenmp (runtime/qattn.py) so gcc vectorises the inner loops over d; groups
 * split across threads (the caller passes torch's thread count).
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ekv_float.h"

enum { KC, VC, KS, KZ, VS, VZ, POS, N_FIELDS };

/* q [n_kv, rep, d] float32; out [n_kv, rep, n_groups * gt]: scaling * q . k, -inf at holes.  Groups split
 * across `threads` OpenMP threads. */
void ekv_qscores(const float *q, int n_kv, int rep, int d, int bits, const uint8_t *rows, int64_t row_bytes,
                 int n_groups, int gt, const int64_t *off, float scaling, float *out, int threads) {
    const int64_t n_tok = (int64_t)n_groups * gt;
    const int db = d * bits / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < n_groups; g++) {
        float qs[rep * d], bias[rep], cf[d];
        const uint8_t *rec = rows + g * row_bytes;
        const int32_t *pos = (const int32_t *)(rec + off[POS]);
        for (int h = 0; h < n_kv; h++) {
            const uint16_t *ks = (const uint16_t *)(rec + off[KS]) + (int64_t)h * d;
            const uint16_t *kz = (const uint16_t *)(rec + off[KZ]) + (int64_t)h * d;
            for (int j = 0; j < rep; j++) bias[j] = 0.0f;
            for (int c = 0; c < d; c++) {
                const float s = half_to_float(ks[c]) * scaling, z = half_to_float(kz[c]) * scaling;
                for (int j = 0; j < rep; j++) {
                    const float qc = q[((int64_t)h * rep + j) * d + c];
                    qs[j * d + c] = qc * s;
                    bias[j] += qc * z;
                }
            }
            const uint8_t *codes = rec + off[KC] + (int64_t)h * gt * db;
            float *o = out + (int64_t)h * rep * n_tok + (int64_t)g * gt;
            for (int t = 0; t < gt; t++) {
                if (pos[t] < 0) {
                    for (int j = 0; j < rep; j++) o[j * n_tok + t] = -INFINITY;
                    continue;
                }
                widen_codes(cf, codes + t * db, d, bits);
                for (int j = 0; j < rep; j++) o[j * n_tok + t] = dot(qs + j * d, cf, d) + bias[j];
            }
        }
    }
}

/* w [n_kv, rep, n_groups * gt] float32 (0 at holes); out [n_kv, rep, d] = sum_t w_t v_t (overwritten).
 * Each thread sums its groups into its own partial, added up at the end.  Returns 0, or -1 out of memory. */
int ekv_qvalues(const float *w, int n_kv, int rep, int d, int bits, const uint8_t *rows, int64_t row_bytes,
                 int n_groups, int gt, const int64_t *off, float *out, int threads) {
    const int64_t n_tok = (int64_t)n_groups * gt;
    const int db = d * bits / 8, n_out = n_kv * rep * d;
    if (threads > n_groups) threads = n_groups > 0 ? n_groups : 1;
    const int64_t stride = n_out + n_kv * rep;  /* a thread's partial output, then its bias sums */
    float *partial = calloc((size_t)threads * stride, sizeof(float));
    if (!partial) return -1;
#pragma omp parallel num_threads(threads)
    {
        int tid = 0, n_threads = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        n_threads = omp_get_num_threads();
#endif
        float *acc = partial + tid * stride, *bias = acc + n_out, cf[d];
        for (int g = tid; g < n_groups; g += n_threads) {
            const uint8_t *rec = rows + g * row_bytes;
            const int32_t *pos = (const int32_t *)(rec + off[POS]);
            for (int h = 0; h < n_kv; h++) {
                const uint16_t *vs = (const uint16_t *)(rec + off[VS]) + (int64_t)h * gt;
                const uint16_t *vz = (const uint16_t *)(rec + off[VZ]) + (int64_t)h * gt;
                const uint8_t *codes = rec + off[VC] + (int64_t)h * gt * db;
                for (int t = 0; t < gt; t++) {
                    if (pos[t] < 0) continue;
                    const float s = half_to_float(vs[t]), z = half_to_float(vz[t]);
                    widen_codes(cf, codes + t * db, d, bits);
                    for (int j = 0; j < rep; j++) {
                        const float wt = w[((int64_t)h * rep + j) * n_tok + (int64_t)g * gt + t];
                        float *o = acc + ((int64_t)h * rep + j) * d;
                        const float a = wt * s;
                        for (int c = 0; c < d; c++) o[c] += a * cf[c];
                        bias[h * rep + j] += wt * z;
                    }
                }
            }
        }
    }
    for (int i = 0; i < n_kv * rep; i++)
        for (int c = 0; c < d; c++) {
            float sum = 0.0f;
            for (int t = 0; t < threads; t++) sum += partial[t * stride + (int64_t)i * d + c] + partial[t * stride + n_out + i];
            out[(int64_t)i * d + c] = sum;
        }
    free(partial);
    return 0;
}
