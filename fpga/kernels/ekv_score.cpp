// Token-importance scoring in storage (HillInfer's SmartSSD kernel), Vitis HLS C++.
//
// One call scores a block of `n_tokens` fp16 keys resident in the card's DRAM against one decode
// query: score[t] = sum_h q[h] . k[t][h], with q[h] the query heads of KV head h summed and the
// softmax scale already folded into q by the host (pyxrt's kernel call cannot pass a float).  It
// writes one score block <token_pos, score> per key block and exactly `top_k` best-first entries
// (padded with <-1, -inf>), so only score blocks (and later the selected KV) cross to the host.
//
// A streaming dataflow (fpga/README.md lists the synthesis rules this follows):
//
//   read_keys ---- 512-bit words ----> dot_chunks -- chunk sums --> sum_tokens --+--> write_scores
//   read_positions ---------------- positions ---------------------^             +--> select_topk
//
// Every process runs unconditionally, every stream has one writer and one reader, every argument
// is touched by one process, and each pipelined loop has an exact trip count and no early exit.
// A token's row (n_kv_heads * head_dim halves) is cut into row-aligned chunks of 32 halves; a
// chunk's dot product is an adder tree, and a token's chunk sums are summed by a second adder tree
// once its last chunk is in, so no pipelined loop carries a floating-point sum (II=1 holds).
//
// The same source builds with v++ and with plain g++ for the C simulation: without the Vitis
// headers, a queue-backed hls::stream and a 32 x uint16_t word stand in (pragmas are ignored).
#include <math.h>
#include <stdint.h>

#if defined(__SYNTHESIS__)
#define EKV_VITIS 1
#elif defined(__has_include)
#if __has_include(<ap_int.h>) && __has_include(<hls_stream.h>)
#define EKV_VITIS 1
#endif
#endif

#ifdef EKV_VITIS
#include <ap_int.h>
#include <hls_stream.h>
typedef ap_uint<512> ekv_word;  // one AXI beat of the keys port: 32 fp16, lane j in bits [16j+15:16j]

static inline uint16_t ekv_lane(const ekv_word &w, int j) {
#pragma HLS INLINE
    return w.range(16 * j + 15, 16 * j);
}

static inline ekv_word ekv_zero_word() { return ekv_word(0); }
#else
#include <queue>
#include <stdio.h>
#include <stdlib.h>

struct ekv_word {  // little-endian bytes, as the DRAM holds them: lane j = bytes 2j, 2j+1
    uint16_t h[32];
};

static inline uint16_t ekv_lane(const ekv_word &w, int j) { return w.h[j]; }

static inline ekv_word ekv_zero_word() { return ekv_word(); }

namespace hls {
// C-simulation stand-in with hls::stream's C semantics (an unbounded FIFO); a read of an empty
// stream or data left over mean producer and consumer counts disagree, which would hang the card.
template <typename T>
class stream {
  public:
    stream() {}
    ~stream() {
        if (!q_.empty()) {
            fprintf(stderr, "ekv_score: a stream holds %zu unread items\n", q_.size());
            abort();
        }
    }
    void write(const T &v) { q_.push(v); }
    T read() {
        if (q_.empty()) {
            fprintf(stderr, "ekv_score: read of an empty stream\n");
            abort();
        }
        T v = q_.front();
        q_.pop();
        return v;
    }
    bool empty() const { return q_.empty(); }
    stream(const stream &) = delete;

  private:
    std::queue<T> q_;
};
}  // namespace hls
#endif

#if !defined(__SYNTHESIS__) && defined(__F16C__)
#include <immintrin.h>
#define EKV_F16C 1
#endif

#define EKV_MAX_HEAD_DIM 128
#define EKV_MAX_KV_HEADS 8
#define EKV_MAX_BLOCK 1024
#define EKV_MAX_TOPK 256
#define EKV_LANES 32                                        // fp16 per 512-bit word
#define EKV_MAX_ROW (EKV_MAX_KV_HEADS * EKV_MAX_HEAD_DIM)   // halves per token
#define EKV_MAX_CHUNKS (EKV_MAX_ROW / EKV_LANES)            // chunks per token
#define EKV_MAX_WORDS (EKV_MAX_BLOCK * EKV_MAX_CHUNKS)      // words (and chunks) per block

struct ekv_score_entry {
    int32_t pos;
    float score;
};

static float ekv_half_to_float(uint16_t h) {
#pragma HLS INLINE
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
        } else {  // subnormal: shift the leading 1 up to bit 10 (found without an early exit)
            int top = 0;
            for (int i = 0; i < 10; i++) {
#pragma HLS UNROLL
                if ((man >> i) & 1u) top = i;
            }
            int shift = 10 - top;
            bits = sign | ((uint32_t)(113 - shift) << 23) | (((man << shift) & 0x3ffu) << 13);
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

// Sum of 32 floats as a 5-level adder tree: no value depends on a previous loop iteration.
static float ekv_sum32(const float v[EKV_LANES]) {
#pragma HLS INLINE
    float s[EKV_LANES];
#pragma HLS ARRAY_PARTITION variable = s complete
    for (int j = 0; j < EKV_LANES; j++) {
#pragma HLS UNROLL
        s[j] = v[j];
    }
    for (int w = EKV_LANES / 2; w > 0; w /= 2) {
#pragma HLS UNROLL
        for (int j = 0; j < EKV_LANES / 2; j++) {
#pragma HLS UNROLL
            if (j < w) s[j] = s[j] + s[j + w];
        }
    }
    return s[0];
}

// Chunks per token; at least one, so a zero-sized row still yields one (zero) score per token.
static int ekv_chunks_per_token(int n_kv_heads, int head_dim) {
#pragma HLS INLINE
    int row = n_kv_heads * head_dim;
    return row > EKV_LANES ? (row + EKV_LANES - 1) / EKV_LANES : 1;
}

// Score order as an unsigned key (one integer compare on the insertion path); NaN ranks below all.
static uint32_t ekv_order_key(float score) {
#pragma HLS INLINE
    union { float f; uint32_t u; } cvt;
    cvt.f = score;
    uint32_t b = cvt.u;
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static void read_keys(const ekv_word *keys, int n_tokens, int n_kv_heads, int head_dim, hls::stream<ekv_word> &words) {
    const int n_words = (n_tokens * n_kv_heads * head_dim + EKV_LANES - 1) / EKV_LANES;
read_words:
    for (int w = 0; w < n_words; w++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 32768
        words.write(keys[w]);
    }
}

static void read_positions(const int32_t *positions, int n_tokens, hls::stream<int32_t> &pos) {
read_pos:
    for (int t = 0; t < n_tokens; t++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 1024
        pos.write(positions[t]);
    }
}

// Realigns the word stream into row-aligned chunks of up to 32 halves (a token row need not start
// on a word) and emits each chunk's dot product with the matching 32 query values.  The query is
// flattened [n_kv_heads][head_dim] exactly like a key row, so chunk c of any token meets q[c][*].
static void dot_chunks(const float *query, hls::stream<ekv_word> &words, int n_tokens, int n_kv_heads, int head_dim,
                       hls::stream<float> &chunk_sums) {
    float q[EKV_MAX_CHUNKS][EKV_LANES];
#pragma HLS ARRAY_PARTITION variable = q dim = 2 complete
    const int row = n_kv_heads * head_dim;
    const int per_token = ekv_chunks_per_token(n_kv_heads, head_dim);
    const int n_chunks = n_tokens * per_token;
load_query:  // entries past the row are never read: their lanes are masked below
    for (int r = 0; r < row; r++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 1024
        q[r / EKV_LANES][r % EKV_LANES] = query[r];
    }
    ekv_word prev = ekv_zero_word(), cur = ekv_zero_word();  // the two newest words: a chunk spans at most two
    int have = 0;   // words read so far
    int start = 0;  // the chunk's first half, counted from the block's start
    int c = 0;      // the chunk's index within its token
chunks:
    for (int k = 0; k < n_chunks; k++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 32768
        int len = row - c * EKV_LANES;
        if (len > EKV_LANES) len = EKV_LANES;
        // The chunk ends in word (start + len - 1) / 32, at most one past the newest word read.
        if (len > 0 && (start + len - 1) / EKV_LANES >= have) {
            prev = cur;
            cur = words.read();
            have++;
        }
        const int first = start % EKV_LANES;
        const bool first_is_cur = start / EKV_LANES == have - 1;
        float prod[EKV_LANES];
#pragma HLS ARRAY_PARTITION variable = prod complete
    lanes:
        for (int j = 0; j < EKV_LANES; j++) {
#pragma HLS UNROLL
            const int e = first + j;
            uint16_t h = e < EKV_LANES ? ekv_lane(first_is_cur ? cur : prev, e) : ekv_lane(cur, e - EKV_LANES);
            // masked, not multiplied by a zero query: 0 * inf would be NaN
            prod[j] = j < len ? q[c][j] * ekv_half_to_float(h) : 0.0f;
        }
        chunk_sums.write(ekv_sum32(prod));
        start += len > 0 ? len : 0;
        c = c == per_token - 1 ? 0 : c + 1;
    }
}

// Collects a token's chunk sums (at most 32, one per cycle) and adds them with a second tree once
// the last one is in: the running values are stored, never accumulated, across iterations.
static void sum_tokens(hls::stream<float> &chunk_sums, hls::stream<int32_t> &pos, int n_tokens, int n_kv_heads,
                       int head_dim, hls::stream<ekv_score_entry> &to_write, hls::stream<ekv_score_entry> &to_topk) {
    float part[EKV_MAX_CHUNKS];
#pragma HLS ARRAY_PARTITION variable = part complete
    const int per_token = ekv_chunks_per_token(n_kv_heads, head_dim);
    const int n_chunks = n_tokens * per_token;
    int c = 0;
tokens:
    for (int k = 0; k < n_chunks; k++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 32768
        const float v = chunk_sums.read();
        if (c == per_token - 1) {
            float lanes[EKV_MAX_CHUNKS];
#pragma HLS ARRAY_PARTITION variable = lanes complete
            for (int j = 0; j < EKV_MAX_CHUNKS; j++) {
#pragma HLS UNROLL
                lanes[j] = j < c ? part[j] : (j == c ? v : 0.0f);
            }
            ekv_score_entry e;
            e.pos = pos.read();
            e.score = ekv_sum32(lanes);
            to_write.write(e);
            to_topk.write(e);
            c = 0;
        } else {
            part[c] = v;
            c++;
        }
    }
}

static void write_scores(hls::stream<ekv_score_entry> &entries, int n_tokens, ekv_score_entry *scores_out) {
write_block:
    for (int t = 0; t < n_tokens; t++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 1024
        scores_out[t] = entries.read();
    }
}

// Keeps the block's best EKV_MAX_TOPK sorted best-first in registers (a parallel insertion: every
// slot compares with the newcomer at once) and writes exactly top_k of them, padding included:
// empty slots hold <-1, -inf>, so a block shorter than top_k never leaves stale entries behind.
// Ties keep the earlier token first, as the numpy reference's stable sort does.
static void select_topk(hls::stream<ekv_score_entry> &entries, int n_tokens, int top_k, ekv_score_entry *topk_out) {
    ekv_score_entry empty;
    empty.pos = -1;
    empty.score = -INFINITY;
    const uint32_t empty_key = ekv_order_key(empty.score);
    ekv_score_entry best[EKV_MAX_TOPK];
    uint32_t best_key[EKV_MAX_TOPK];
#pragma HLS ARRAY_PARTITION variable = best complete
#pragma HLS ARRAY_PARTITION variable = best_key complete
    for (int j = 0; j < EKV_MAX_TOPK; j++) {
#pragma HLS UNROLL
        best[j] = empty;
        best_key[j] = empty_key;
    }
insert:
    for (int t = 0; t < n_tokens; t++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 1 max = 1024
        const ekv_score_entry e = entries.read();
        const uint32_t key = ekv_order_key(e.score);
        for (int j = EKV_MAX_TOPK - 1; j >= 0; j--) {  // descending: slot j - 1 is read before it changes
#pragma HLS UNROLL
            if (j > 0 && key > best_key[j - 1]) {
                best[j] = best[j - 1];
                best_key[j] = best_key[j - 1];
            } else if (key > best_key[j]) {
                best[j] = e;
                best_key[j] = key;
            }
        }
    }
emit:  // shift out best-first: a register shift, no 256-way read mux
    for (int j = 0; j < top_k; j++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT min = 0 max = 256
        topk_out[j] = best[0];
        for (int i = 0; i < EKV_MAX_TOPK - 1; i++) {
#pragma HLS UNROLL
            best[i] = best[i + 1];
        }
        best[EKV_MAX_TOPK - 1] = empty;
    }
}

extern "C" {
// keys: the block's fp16 keys [n_tokens][n_kv_heads][head_dim], contiguous, in a buffer rounded up to
// 64 bytes (the last 512-bit word may run past the keys); positions int32 [n_tokens]; query fp32
// [n_kv_heads][head_dim], scale folded in; scores_out [n_tokens]; topk_out [top_k] best first.
// The host checks the bounds: head_dim <= 128, n_kv_heads <= 8, n_tokens <= 1024, top_k <= 256.
void ekv_score(const ekv_word *keys, const int32_t *positions, const float *query, int n_tokens, int n_kv_heads,
               int head_dim, int top_k, ekv_score_entry *scores_out, ekv_score_entry *topk_out) {
// 64 beats x 64 bytes = 4 KB, the longest AXI4 burst; depths size the C/RTL co-simulation buffers.
#pragma HLS INTERFACE m_axi port = keys offset = slave bundle = gmem0 max_read_burst_length = 64 depth = 32768
#pragma HLS INTERFACE m_axi port = positions offset = slave bundle = gmem1 depth = 1024
#pragma HLS INTERFACE m_axi port = query offset = slave bundle = gmem2 depth = 1024
#pragma HLS INTERFACE m_axi port = scores_out offset = slave bundle = gmem3 depth = 1024
#pragma HLS INTERFACE m_axi port = topk_out offset = slave bundle = gmem4 depth = 256
#pragma HLS INTERFACE s_axilite port = keys bundle = control
#pragma HLS INTERFACE s_axilite port = positions bundle = control
#pragma HLS INTERFACE s_axilite port = query bundle = control
#pragma HLS INTERFACE s_axilite port = n_tokens bundle = control
#pragma HLS INTERFACE s_axilite port = n_kv_heads bundle = control
#pragma HLS INTERFACE s_axilite port = head_dim bundle = control
#pragma HLS INTERFACE s_axilite port = top_k bundle = control
#pragma HLS INTERFACE s_axilite port = scores_out bundle = control
#pragma HLS INTERFACE s_axilite port = topk_out bundle = control
#pragma HLS INTERFACE s_axilite port = return bundle = control
#pragma HLS DATAFLOW
    hls::stream<ekv_word> words;
    hls::stream<int32_t> pos;
    hls::stream<float> chunk_sums;
    hls::stream<ekv_score_entry> to_write;
    hls::stream<ekv_score_entry> to_topk;
#pragma HLS STREAM variable = words depth = 64
#pragma HLS STREAM variable = pos depth = 32
#pragma HLS STREAM variable = chunk_sums depth = 32
    read_keys(keys, n_tokens, n_kv_heads, head_dim, words);
    read_positions(positions, n_tokens, pos);
    dot_chunks(query, words, n_tokens, n_kv_heads, head_dim, chunk_sums);
    sum_tokens(chunk_sums, pos, n_tokens, n_kv_heads, head_dim, to_write, to_topk);
    write_scores(to_write, n_tokens, scores_out);
    select_topk(to_topk, n_tokens, top_k, topk_out);
}
}
