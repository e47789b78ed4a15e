// Test bench of the scoring kernel: the C simulation / C-RTL co-simulation bench for Vitis HLS
// (hls_config.cfg), and a plain g++ program here (make -C fpga tb).  It calls ekv_score directly
// with buffers of the interface depths and checks scores and the padded top-k against its own
// reference, which converts fp16 with ldexp rather than the kernel's routine.  Returns 0 on success.
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

// The kernel's interface types, as the kernel defines them (its source is compiled on its own).
#if defined(__SYNTHESIS__) || (defined(__has_include) && __has_include(<ap_int.h>) && __has_include(<hls_stream.h>))
#include <ap_int.h>
typedef ap_uint<512> ekv_word;
static void set_lane(ekv_word &w, int j, uint16_t h) { w.range(16 * j + 15, 16 * j) = h; }
static ekv_word zero_word() { return ekv_word(0); }
#else
struct ekv_word {
    uint16_t h[32];
};
static void set_lane(ekv_word &w, int j, uint16_t h) { w.h[j] = h; }
static ekv_word zero_word() { return ekv_word(); }
#endif

struct ekv_score_entry {
    int32_t pos;
    float score;
};

extern "C" void ekv_score(const ekv_word *keys, const int32_t *positions, const float *query, int n_tokens,
                          int n_kv_heads, int head_dim, int top_k, ekv_score_entry *scores_out,
                          ekv_score_entry *topk_out);

// buffers as large as the interface depths, which co-simulation copies whole
static ekv_word keys[32768];
static int32_t positions[1024];
static float query[1024];
static ekv_score_entry scores[1024];
static ekv_score_entry topk[256];

static uint32_t rng = 12345;
static uint32_t next_random() {
    rng = rng * 1664525u + 1013904223u;
    return rng >> 8;
}

// A random normal fp16 in [-2, 2): its bits for the kernel, its value for the reference.
static uint16_t random_half(double *value) {
    uint32_t sign = next_random() & 1, exp = 13 + next_random() % 3, man = next_random() & 0x3ff;
    *value = (sign ? -1.0 : 1.0) * ldexp(1.0 + man / 1024.0, (int)exp - 15);
    return (uint16_t)(sign << 15 | exp << 10 | man);
}

static int run_case(int n_tokens, int n_kv_heads, int head_dim, int top_k) {
    const int row = n_kv_heads * head_dim;
    std::vector<double> want(n_tokens, 0.0), q(row);
    for (int r = 0; r < row; r++) {
        query[r] = (float)((int)(next_random() % 2001) - 1000) / 1000.0f;
        q[r] = query[r];
    }
    for (ekv_word &w : keys) w = zero_word();
    for (int t = 0; t < n_tokens; t++) {
        positions[t] = 7 * t + 3;
        for (int r = 0; r < row; r++) {
            double k;
            const long e = (long)t * row + r;
            set_lane(keys[e / 32], (int)(e % 32), random_half(&k));
            want[t] += q[r] * k;
        }
    }
    for (int j = 0; j < 256; j++) topk[j] = ekv_score_entry{12345, 99.0f};  // stale entries to be overwritten
    ekv_score(keys, positions, query, n_tokens, n_kv_heads, head_dim, top_k, scores, topk);

    int errors = 0;
    for (int t = 0; t < n_tokens; t++) {
        if (scores[t].pos != positions[t] || fabs(scores[t].score - want[t]) > 1e-4 * (1.0 + fabs(want[t]))) {
            if (errors++ < 5) printf("  token %d: got <%d, %g>, want <%d, %g>\n", t, scores[t].pos, scores[t].score,
                                     positions[t], want[t]);
        }
    }
    std::vector<int> order(n_tokens);
    for (int t = 0; t < n_tokens; t++) order[t] = t;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return want[a] > want[b]; });
    for (int j = 0; j < top_k; j++) {
        const int32_t pos = j < n_tokens ? positions[order[j]] : -1;
        const bool pad_ok = j < n_tokens || (isinf(topk[j].score) && topk[j].score < 0);
        if (topk[j].pos != pos || !pad_ok) {
            if (errors++ < 10) printf("  top-k %d: got <%d, %g>, want pos %d\n", j, topk[j].pos, topk[j].score, pos);
        }
    }
    for (int j = top_k; j < 256; j++) {
        if (topk[j].pos != 12345) {
            if (errors++ < 10) printf("  top-k %d: written past top_k\n", j);
        }
    }
    printf("%s: %d tokens x %d heads x %d dims, top-%d\n", errors ? "FAIL" : "ok", n_tokens, n_kv_heads, head_dim,
           top_k);
    return errors;
}

int main() {
    int errors = 0;
    errors += run_case(37, 2, 16, 8);    // a row of exactly one word
    errors += run_case(50, 3, 5, 64);    // rows straddle words; fewer tokens than top_k: padded
    errors += run_case(3, 8, 128, 2);    // the largest row: 32 chunks per token
    errors += run_case(9, 1, 33, 0);     // top_k 0 writes nothing
    errors += run_case(1024, 1, 64, 256);  // the largest block and top-k
    return errors ? 1 : 0;
}
