// Token-importance scoring in storage (HillInfer's SmartSSD kernel), Vitis HLS style.
//
// One call scores a block of `n_tokens` keys resident in the card's DRAM against one decode
// query: score[t] = scale * sum_h q[h] . k[t][h], with q[h] the query heads of KV head h summed
// (scores summed over heads commute with the dot product).  The kernel emits one score block
// <token_pos, score> per key block, and optionally its own top-k, so only score blocks (and later
// the selected KV) cross to the host.
//
// Plain C++ types only: the same source builds with v++ (pragmas honoured) and with g++ for the
// C-simulation backend (pragmas ignored, -Wno-unknown-pragmas).  fp16 keys are converted with F16C
// in an x86 g++ build (-mf16c) and with a bit-exact integer routine under __SYNTHESIS__ or elsewhere.
#include <stdint.h>

#if !defined(__SYNTHESIS__) && defined(__F16C__)
#include <immintrin.h>
#define EKV_F16C 1
#endif

#define EKV_MAX_HEAD_DIM 128
#define EKV_MAX_KV_HEADS 8
#define EKV_MAX_BLOCK 1024
#define EKV_MAX_TOPK 256

struct ekv_score_entry {
    int32_t pos;
    float score;
};

static float ekv_half_to_float(uint16_t h) {
#ifdef EKV_F16C
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise (at most 10 shifts)
            exp = 113;
            for (int i = 0; i < 10; i++) {
#pragma HLS UNROLL
                if (man & 0x400u) break;
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    union { uint32_t u; float f; } cvt;
    cvt.u = bits;
    return cvt.f;
#endif
}

static void load_query(const float *query, float q_local[EKV_MAX_KV_HEADS][EKV_MAX_HEAD_DIM], int n_kv_heads, int head_dim) {
    for (int h = 0; h < EKV_MAX_KV_HEADS; h++) {
        for (int d = 0; d < EKV_MAX_HEAD_DIM; d++) {
#pragma HLS PIPELINE II = 1
            q_local[h][d] = (h < n_kv_heads && d < head_dim) ? query[h * head_dim + d] : 0.0f;
        }
    }
}

static void score_block(const uint16_t *keys, const int32_t *positions, float q_local[EKV_MAX_KV_HEADS][EKV_MAX_HEAD_DIM],
                        int n_tokens, int n_kv_heads, int head_dim, float scale, ekv_score_entry *block_out) {
token_loop:
    for (int t = 0; t < EKV_MAX_BLOCK; t++) {
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 1024
        if (t >= n_tokens) break;
        float acc = 0.0f;
    head_loop:
        for (int h = 0; h < EKV_MAX_KV_HEADS; h++) {
            if (h >= n_kv_heads) break;
        dim_loop:
            for (int d = 0; d < EKV_MAX_HEAD_DIM; d++) {
#pragma HLS PIPELINE II = 1
                if (d >= head_dim) break;
                acc += q_local[h][d] * ekv_half_to_float(keys[((int64_t)t * n_kv_heads + h) * head_dim + d]);
            }
        }
        block_out[t].pos = positions[t];
        block_out[t].score = acc * scale;
    }
}

static void emit_topk(const ekv_score_entry *block, int n_tokens, int top_k, ekv_score_entry *topk_out) {
    ekv_score_entry best[EKV_MAX_TOPK];
#pragma HLS ARRAY_PARTITION variable = best complete
    int kept = 0;
    for (int t = 0; t < EKV_MAX_BLOCK; t++) {
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 1024
        if (t >= n_tokens) break;
        ekv_score_entry e = block[t];
        int at;
        if (kept < top_k) {
            at = kept++;
        } else if (e.score > best[top_k - 1].score) {
            at = top_k - 1;
        } else {
            continue;
        }
    insert:  // move smaller entries one place down (static bound; sorted best-first)
        for (int j = EKV_MAX_TOPK - 1; j > 0; j--) {
#pragma HLS UNROLL
            if (j == at && best[j - 1].score < e.score) {
                best[j] = best[j - 1];
                at = j - 1;
            }
        }
        best[at] = e;
    }
    for (int j = 0; j < EKV_MAX_TOPK; j++) {
#pragma HLS PIPELINE II = 1
        if (j >= kept) break;
        topk_out[j] = best[j];
    }
}

extern "C" {
// keys fp16 [n_tokens][n_kv_heads][head_dim]; positions int32 [n_tokens]; query fp32 [n_kv_heads][head_dim]
// scores_out [n_tokens]: the score block; topk_out [top_k] best first (top_k 0: none).
void ekv_score(const uint16_t *keys, const int32_t *positions, const float *query, int n_tokens, int n_kv_heads,
               int head_dim, float scale, int top_k, ekv_score_entry *scores_out, ekv_score_entry *topk_out) {
#pragma HLS INTERFACE m_axi port = keys offset = slave bundle = gmem0 max_read_burst_length = 256
#pragma HLS INTERFACE m_axi port = positions offset = slave bundle = gmem1
#pragma HLS INTERFACE m_axi port = query offset = slave bundle = gmem2
#pragma HLS INTERFACE m_axi port = scores_out offset = slave bundle = gmem3
#pragma HLS INTERFACE m_axi port = topk_out offset = slave bundle = gmem4
#pragma HLS INTERFACE s_axilite port = keys bundle = control
#pragma HLS INTERFACE s_axilite port = positions bundle = control
#pragma HLS INTERFACE s_axilite port = query bundle = control
#pragma HLS INTERFACE s_axilite port = n_tokens bundle = control
#pragma HLS INTERFACE s_axilite port = n_kv_heads bundle = control
#pragma HLS INTERFACE s_axilite port = head_dim bundle = control
#pragma HLS INTERFACE s_axilite port = scale bundle = control
#pragma HLS INTERFACE s_axilite port = top_k bundle = control
#pragma HLS INTERFACE s_axilite port = scores_out bundle = control
#pragma HLS INTERFACE s_axilite port = topk_out bundle = control
#pragma HLS INTERFACE s_axilite port = return bundle = control
#pragma HLS DATAFLOW
    float q_local[EKV_MAX_KV_HEADS][EKV_MAX_HEAD_DIM];
#pragma HLS ARRAY_PARTITION variable = q_local dim = 1 complete
    load_query(query, q_local, n_kv_heads, head_dim);
    score_block(keys, positions, q_local, n_tokens, n_kv_heads, head_dim, scale, scores_out);
    if (top_k > 0) emit_topk(scores_out, n_tokens, top_k, topk_out);
}
}
