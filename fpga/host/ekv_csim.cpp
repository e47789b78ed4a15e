// C-simulation backend of the SmartSSD scorer: the kernel source compiled by g++, fed the way the
// card's host feeds it.  The pool file (fp16 keys, token-major [n][n_kv_heads][head_dim]) is read
// here, block by block, into a buffer standing in for the card's DRAM, so the caller receives score
// blocks and per-block top-k only, never keys.
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../kernels/ekv_score.cpp"

static_assert(sizeof(ekv_word) == 64, "a keys word is one 512-bit AXI beat");

extern "C" int ekv_csim_score_file(const char *path, int64_t offset, int n_tokens, int n_kv_heads, int head_dim,
                                   const int32_t *positions, const float *query, float scale, int block_tokens,
                                   int top_k, ekv_score_entry *scores_out, ekv_score_entry *topk_out,
                                   int64_t *bytes_from_storage) {
    if (n_kv_heads < 1 || n_kv_heads > EKV_MAX_KV_HEADS || head_dim < 1 || head_dim > EKV_MAX_HEAD_DIM ||
        block_tokens < 1 || block_tokens > EKV_MAX_BLOCK || top_k < 0 || top_k > EKV_MAX_TOPK)
        return -22;  // EINVAL: the kernel's static bounds
    // The host's side of the contract: the scale goes into the query, since the card's call has no float.
    float q[EKV_MAX_KV_HEADS * EKV_MAX_HEAD_DIM];
    for (int i = 0; i < n_kv_heads * head_dim; i++) q[i] = query[i] * scale;
    const int64_t token_bytes = (int64_t)n_kv_heads * head_dim * 2;
    // The kernel reads whole 64-byte words, so the DRAM buffer is rounded up and its tail zeroed.
    const int64_t capacity = (block_tokens * token_bytes + 63) / 64 * 64;
    ekv_word *dram = (ekv_word *)aligned_alloc(64, (size_t)capacity);
    if (!dram) return -12;
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        int rc = -errno;
        free(dram);
        return rc;
    }
    int rc = 0;
    *bytes_from_storage = 0;
    for (int start = 0, b = 0; start < n_tokens; start += block_tokens, b++) {
        int n = n_tokens - start < block_tokens ? n_tokens - start : block_tokens;
        int64_t want = n * token_bytes, got = 0;
        while (got < want) {
            ssize_t r = pread(fd, (char *)dram + got, (size_t)(want - got), offset + start * token_bytes + got);
            if (r <= 0) {
                rc = r == 0 ? -5 : -errno;
                break;
            }
            got += r;
        }
        if (rc) break;
        memset((char *)dram + want, 0, (size_t)((want + 63) / 64 * 64 - want));
        *bytes_from_storage += want;
        ekv_score(dram, positions + start, q, n, n_kv_heads, head_dim, top_k, scores_out + start,
                  topk_out ? topk_out + (int64_t)b * top_k : topk_out);
    }
    free(dram);
    close(fd);
    return rc;
}

// The kernel's fp16 conversion, exported so tests can check the integer routine (built without F16C)
// bit for bit against IEEE half precision.
extern "C" float ekv_csim_half_to_float(uint16_t h) { return ekv_half_to_float(h); }
