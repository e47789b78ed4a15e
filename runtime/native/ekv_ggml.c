/* Linear layers on a GGUF's own block types, computed by ggml's CPU dot products (runtime/ggml_weights.py).
 *
 * ggml (llama.cpp's tensor library) quantizes a row of activations to the weight type's partner (Q8_1 for Q4_1, Q8_0
 * for Q8_0: ggml_type_traits_cpu.vec_dot_type) and takes the dot product of a weight row's blocks with it in integer
 * instructions.  This file holds no arithmetic of its own: it is handed the library's from_float and vec_dot (their
 * signatures are ggml-cpu.h's ggml_from_float_t and ggml_vec_dot_t) and splits a layer's output rows into units, so
 * the decode step's helper thread (ekv_aside.c) computes half of them.  A unit is a run of output rows for every
 * token: the run's weights stay in cache while the tokens' activations pass by them.
 *
 * Its one piece of arithmetic is the RMS norm a layer's input may take on its way to the quantizer (a Llama or Gemma 3
 * block's input and MLP norms feed nothing else): in torch it is five or six dispatched calls a norm, some 90 a
 * decode step of SmolLM2, where here it is a loop over the row already being read.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef void (*ggml_from_float)(const float *x, void *y, int64_t k);
typedef void (*ggml_vec_dot)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by,
                             int nrc);

enum { UNITS = 8, MIN_UNIT_ROWS = 32 }; /* a layer's rows in about UNITS units, none under MIN_UNIT_ROWS rows */

typedef struct {
    ggml_from_float from_float;
    ggml_vec_dot dot;
    const uint8_t *weight;  /* [rows, row_bytes]: each output row's blocks */
    int64_t row_bytes, rows, unit_rows;
    const uint8_t *xq;      /* [tokens, xq_bytes]: each token's activations in vec_dot's type (the call's) */
    int64_t xq_bytes, tokens;
    float *out;             /* [tokens, rows] (the call's) */
    int inputs;
} ggml_job;

int ekv_ggml_job_bytes(void) { return (int)sizeof(ggml_job); }

/* A layer's job, once: out[t, r] = weight[r] . x[t] for `rows` rows of `inputs` inputs, each row's blocks `row_bytes`
 * long, each token's quantized activations `xq_bytes`.  Returns -1 for a shape it cannot take, else 0. */
int ekv_ggml_layer(void *job_buffer, ggml_from_float from_float, ggml_vec_dot dot, const uint8_t *weight,
                   int64_t row_bytes, int64_t rows, int inputs, int64_t xq_bytes) {
    if (rows < 1 || inputs < 1 || row_bytes < 1 || xq_bytes < 1) return -1;
    ggml_job *job = job_buffer;
    int64_t unit_rows = (rows + UNITS - 1) / UNITS;
    if (unit_rows < MIN_UNIT_ROWS) unit_rows = MIN_UNIT_ROWS;
    *job = (ggml_job){from_float, dot, weight, row_bytes, rows, unit_rows, NULL, xq_bytes, 0, NULL, inputs};
    return 0;
}

void ekv_ggml_unit(void *job_buffer, int64_t unit, int worker) {
    (void)worker;
    const ggml_job *job = job_buffer;
    const int64_t first = unit * job->unit_rows;
    const int64_t last = first + job->unit_rows < job->rows ? first + job->unit_rows : job->rows;
    for (int64_t t = 0; t < job->tokens; t++) {
        const uint8_t *xq = job->xq + t * job->xq_bytes;
        float *out = job->out + t * job->rows;
        for (int64_t r = first; r < last; r++)
            job->dot(job->inputs, out + r, 0, job->weight + r * job->row_bytes, 0, xq, 0, 1);
    }
}

/* x's row normed as Llama's and Gemma 3's RMS norms do in float32, (x * 1/sqrt(mean(x^2) + eps)) * scale (scale:
 * Llama's weight, Gemma 3's 1 + weight); the sum of squares in double, so its order barely shows. */
static void rms_normed(const float *x, const float *scale, float eps, int inputs, float *out) {
    double squares = 0.0;
    for (int i = 0; i < inputs; i++) squares += (double)x[i] * x[i];
    const float inverse = 1.0f / sqrtf((float)(squares / inputs) + eps);
    for (int i = 0; i < inputs; i++) out[i] = x[i] * inverse * scale[i];
}

/* One call of the layer: the `tokens` rows of x (float32, contiguous) quantized into xq now, on the caller, each
 * first RMS-normed by `norm_scale` and `eps` where norm_scale is not NULL; then with `run` every unit computed here
 * (returns 0), else the units left for the caller to share (ekv_aside_share). */
int64_t ekv_ggml_call(void *job_buffer, const float *x, int64_t tokens, uint8_t *xq, float *out, int run,
                      const float *norm_scale, float eps) {
    ggml_job *job = job_buffer;
    float normed[norm_scale ? job->inputs : 1];
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = x + t * job->inputs;
        if (norm_scale) {
            rms_normed(row, norm_scale, eps, job->inputs, normed);
            row = normed;
        }
        job->from_float(row, xq + t * job->xq_bytes, job->inputs);
    }
    job->xq = xq;
    job->tokens = tokens;
    job->out = out;
    const int64_t units = (job->rows + job->unit_rows - 1) / job->unit_rows;
    if (!run) return units;
    for (int64_t unit = 0; unit < units; unit++) ekv_ggml_unit(job, unit, 0);
    return 0;
}

/* ---- a Llama-style block's end in one call (runtime/ggml_weights.py GgmlBlockEnd) ----------------------------- */

typedef void (*ekv_share_fn)(void *aside, void (*fn)(void *, int64_t, int), void *ctx, int64_t units);

/* One layer of a block's end: units run here, or shared with the helper thread (`share` and `aside` given) */
static void layer_call(void *job, const float *x, int64_t tokens, uint8_t *xq, float *out, const float *norm_scale,
                       float eps, ekv_share_fn share, void *aside) {
    const int64_t units = ekv_ggml_call(job, x, tokens, xq, out, share == NULL, norm_scale, eps);
    if (share != NULL) share(aside, ekv_ggml_unit, job, units);
}

/* x + o(attn), then that plus down(silu(gate) * up) of its RMS norm, into `out` [tokens, hidden] (float32): the
 * output projection, the residual, the MLP's norm (in the gate/up layer's quantizer), the packed gate/up layer (its
 * first `ff` outputs the gate's, the next `ff` the up's), SiLU times up, the down projection and the residual again;
 * each layer's bias (`biases[i]`, float32, or NULL) added to its output as torch adds it.  In torch the glue between
 * the three calls was ten dispatched ops a layer (a transpose, adds, a split, SiLU, a product, ...), each dearer inside
 * the decode step than its work.  `shares` bit i: layer i (o, gate/up, down) shares its units through `share(aside,
 * ...)` (ekv_aside.c ekv_aside_share), as its own call would.  `xq` holds one token batch's quantized activations of
 * the widest layer input; `scratch` tokens * (hidden + 3 ff) floats. */
void ekv_ggml_block_end(void *const jobs[3], const float *const biases[3], const float *x, const float *attn,
                        int64_t tokens, const float *norm_scale, float eps, uint8_t *xq, float *scratch, float *out,
                        ekv_share_fn share, void *aside, int shares) {
    const ggml_job *o = jobs[0], *down = jobs[2];
    const int64_t hidden = o->rows, ff = down->inputs;
    const float *o_bias = biases[0], *gate_up_bias = biases[1], *down_bias = biases[2];
    float *projected = scratch, *gate_up = scratch + tokens * hidden, *act = gate_up + tokens * 2 * ff;
    layer_call(jobs[0], attn, tokens, xq, projected, NULL, 0.0f, shares & 1 ? share : NULL, aside);
    for (int64_t i = 0; i < tokens * hidden; i++)
        out[i] = x[i] + (o_bias ? projected[i] + o_bias[i % hidden] : projected[i]);
    layer_call(jobs[1], out, tokens, xq, gate_up, norm_scale, eps, shares & 2 ? share : NULL, aside);
    for (int64_t t = 0; t < tokens; t++) {
        float *gate = gate_up + t * 2 * ff, *up = gate + ff;
        if (gate_up_bias)
            for (int64_t i = 0; i < 2 * ff; i++) gate[i] += gate_up_bias[i];
        for (int64_t i = 0; i < ff; i++) act[t * ff + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    layer_call(jobs[2], act, tokens, xq, projected, NULL, 0.0f, shares & 4 ? share : NULL, aside);
    for (int64_t i = 0; i < tokens * hidden; i++)
        out[i] += down_bias ? projected[i] + down_bias[i % hidden] : projected[i];
}

/* ---- a block's projections into rotated heads in one call (runtime/ggml_weights.py GgmlHeads) ------------------- */

/* x's rows through the layer (normed first where `norm_scale`; `bias` float32 or NULL added as torch adds it), each
 * row cut into heads of `d`: its first `q_heads` into q [tokens, q_heads, d] and the next `k_heads` into k, both
 * rotated by RoPE as runtime/model.py _rotate does (y * cos + roll(y, d / 2) * signed_sin, the products rounded apart
 * as torch's separate calls round them: this file is built without FMA), and the rest of the row into v unrotated.
 * cos and signed_sin: [tokens, d].  A packed q/k/v layer is 1 + 13 dispatched torch calls a layer (the split, the
 * views, the transposes, the rotation's four), the next layer's query 1 + 6. */
void ekv_ggml_heads(void *job_buffer, const float *bias, const float *x, int64_t tokens, const float *norm_scale,
                    float eps, uint8_t *xq, float *scratch, const float *cos, const float *signed_sin, int d,
                    int q_heads, int k_heads, float *q, float *k, float *v, ekv_share_fn share, void *aside) {
    const ggml_job *job = job_buffer;
    const int64_t rows = job->rows, rotated = (int64_t)(q_heads + k_heads) * d, half = d / 2;
    layer_call(job_buffer, x, tokens, xq, scratch, norm_scale, eps, share, aside);
    for (int64_t t = 0; t < tokens; t++) {
        float *y = scratch + t * rows;
        if (bias)
            for (int64_t i = 0; i < rows; i++) y[i] += bias[i];
        const float *c = cos + t * d, *s = signed_sin + t * d;
        for (int h = 0; h < q_heads + k_heads; h++) {
            const float *head = y + (int64_t)h * d;
            float *o = h < q_heads ? q + (t * q_heads + h) * d : k + (t * k_heads + h - q_heads) * d;
            for (int64_t i = 0; i < d; i++) {
                const float turned = head[i < half ? i + half : i - half] * s[i];
                o[i] = head[i] * c[i] + turned;
            }
        }
        for (int64_t i = rotated; i < rows; i++) v[t * (rows - rotated) + i - rotated] = y[i];
    }
}
