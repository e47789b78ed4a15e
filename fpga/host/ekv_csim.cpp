// C-simulation backend of the SmartSSD scorer: the kernel source compiled by g++, fed the way the
// card feeds it.  The pool file (fp16 keys, token-major [n][n_kv_heads][head_dim]) is read here,
// block by block, into a buffer standing in for the card's DRAM, so the caller receives score
// blocks and per-block top-k only, never keys.
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../kernels/ekv_score.cpp"

extern "C" int ekv_csim_score_file(const char *path, int64_t offset, int n_tokens, int n_kv_heads, int head_dim,
                                   const int32_t *positions, const float *query, float scale, int block_tokens,
                                   int top_k, ekv_score_entry *scores_out, ekv_score_entry *topk_out,
                                   int64_t *bytes_from_storage) {
    if (n_kv_heads > EKV_MAX_KV_HEADS || head_dim > EKV_MAX_HEAD_DIM || block_tokens > EKV_MAX_BLOCK ||
        top_k > EKV_MAX_TOPK || block_tokens < 1)
        return -22;  // EINVAL: the kernel's static bounds
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -2;
    const int64_t token_bytes = (int64_t)n_kv_heads * head_dim * 2;
    uint16_t *dram = (uint16_t *)malloc((size_t)(block_tokens * token_bytes));
    if (!dram) {
        close(fd);
        return -12;
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
        *bytes_from_storage += want;
        ekv_score(dram, positions + start, query, n, n_kv_heads, head_dim, scale, top_k, scores_out + start,
                  topk_out + (int64_t)b * (top_k > 0 ? top_k : 0));
    }
    free(dram);
    close(fd);
    return rc;
}

// The kernel's fp16 conversion, exported so tests can check the integer routine (built without F16C)
// bit for bit against IEEE half precision.
extern "C" float ekv_csim_half_to_float(uint16_t h) { return ekv_half_to_float(h); }
