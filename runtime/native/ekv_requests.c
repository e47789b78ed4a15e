/* One decode layer's reads as sorted requests, for the common store (runtime/disk_store.py DiskKVStore._requests).
 *
 * The store's numpy path serves every store: stored contexts' blobs, clustered layouts and their replicas, checksums
 * verified on a random share of the records.  Most stores have none of those: each group sits in the stripe
 * (path g % N, record g / N of its sequence's file for the layer), and every record is checked or none is.  For them
 * this makes the same requests in one call where numpy took ~40 (SmolLM2 8K: ~87 us a layer at batch 1, ~220 us at
 * batch 4, on the compute thread): each read's file and offset, a stable sort by (file, record), the requests (a
 * request goes on while the next record is in the same file at most `gap_records` records on, cut on a grid of
 * `max_records` from a run's first record), and, where a request reads through a gap, the gap's records laid out
 * among the wanted ones, landing in the sink and checked against nothing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ekv_requests.h"

typedef struct {
    int64_t key; /* file << 40 | record index: the order DiskKVStore._requests sorts by */
    int64_t at;  /* the read's place in the caller's arrays: equal keys keep their order (a stable sort) */
} read_t;

static int read_before(const read_t *a, const read_t *b) {
    return a->key < b->key || (a->key == b->key && a->at < b->at);
}

/* a stable merge sort of n reads (a few hundred a call: a bottom-up merge through `spare`) */
static void sort_reads(read_t *reads, read_t *spare, int64_t n) {
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi) spare[k++] = read_before(&reads[b], &reads[a]) ? reads[b++] : reads[a++];
            while (a < mid) spare[k++] = reads[a++];
            while (b < hi) spare[k++] = reads[b++];
        }
        memcpy(reads, spare, (size_t)n * sizeof *reads);
    }
}

/* The scratch bytes a call of n reads needs. */
int64_t ekv_requests_scratch_bytes(int64_t n) { return 2 * n * (int64_t)sizeof(read_t); }

/* n reads of (seqs[i], groups[i]) of `n_seqs` sequences into host addresses[i].  fds: this layer's files,
 * fds[seq * fd_seq_stride + path * fd_path_stride] (int32, -1 closed); n_paths; stride: bytes a record.  With `check`
 * (every record checked): sum_tables[seq], the address of seq's checksums (uint32 [layer, group], 0: none), a layer's
 * row sum_row_bytes[seq] long; unused without.
 * Out, per request (at most n): fds, offsets, counts (records read, gaps included), paths, gap_counts (records read
 * only to bridge a gap).  Per record read, in request order (at most `capacity`): addresses (the sink's for a gap's),
 * seqs and groups (-1 for a gap's), expected checksums, check flags.  Returns the requests and sets *records_read;
 * -1 when a sequence is outside the store, a group is negative, a file is closed, or a checked sequence has no
 * checksums (or none that far): the numpy path then raises the error; -2 when the records read pass `capacity`. */
int64_t ekv_requests_plan(int64_t n, const int64_t *seqs, const int64_t *groups, const int64_t *addresses,
                          int64_t n_seqs, const int32_t *fds, int64_t fd_seq_stride, int64_t fd_path_stride,
                          int n_paths, int64_t stride, int64_t max_records, int64_t gap_records, int check,
                          const int64_t *sum_tables, const int64_t *sum_row_bytes, int layer, int64_t sink,
                          void *scratch, int32_t *req_fds, int64_t *req_offsets, int32_t *req_counts,
                          int32_t *req_paths, int32_t *req_gap_counts, int64_t *out_addresses, int64_t *out_seqs,
                          int64_t *out_groups, uint32_t *out_expected, uint8_t *out_check, int64_t capacity,
                          int64_t *records_read) {
    read_t *reads = scratch, *spare = reads + n;
    for (int64_t i = 0; i < n; i++) {
        if (seqs[i] < 0 || seqs[i] >= n_seqs || groups[i] < 0) return -1;
        if (check && (sum_tables[seqs[i]] == 0 || groups[i] >= sum_row_bytes[seqs[i]] / 4)) return -1;
        const int64_t path = groups[i] % n_paths, index = groups[i] / n_paths;
        const int64_t fd = fds[seqs[i] * fd_seq_stride + path * fd_path_stride];
        if (fd < 0) return -1;
        reads[i] = (read_t){fd << 40 | index, i};
    }
    sort_reads(reads, spare, n);
    int64_t requests = 0, total = 0, run_first = 0; /* a run: reads no file change or long gap parts */
    for (int64_t k = 0; k < n; k++) {
        const int64_t i = reads[k].at, fd = reads[k].key >> 40, index = reads[k].key & (((int64_t)1 << 40) - 1);
        int64_t gap = 0;
        int starts = k == 0;
        if (!starts) {
            const int64_t last_fd = reads[k - 1].key >> 40, last = reads[k - 1].key & (((int64_t)1 << 40) - 1);
            gap = index - last - 1;
            if (fd != last_fd || gap < 0 || gap > gap_records) {
                starts = 1;
                run_first = index;
            } else { /* the grid of max_records from the run's first record */
                starts = (index - run_first) / max_records != (last - run_first) / max_records;
            }
        } else {
            run_first = index;
        }
        if (starts) {
            if (requests == n) return -1;
            req_fds[requests] = (int32_t)fd;
            req_offsets[requests] = index * stride;
            req_counts[requests] = 0;
            req_paths[requests] = (int32_t)(groups[i] % n_paths);
            req_gap_counts[requests] = 0;
            requests++;
            gap = 0;
        }
        if (total + gap + 1 > capacity) return -2;
        for (int64_t g = 0; g < gap; g++, total++) {
            out_addresses[total] = sink;
            out_seqs[total] = out_groups[total] = -1;
            out_expected[total] = 0;
            out_check[total] = 0;
        }
        out_addresses[total] = addresses[i];
        out_seqs[total] = seqs[i];
        out_groups[total] = groups[i];
        const int64_t row = check ? sum_tables[seqs[i]] + layer * sum_row_bytes[seqs[i]] : 0;
        out_expected[total] = check ? ((const uint32_t *)(uintptr_t)row)[groups[i]] : 0;
        out_check[total] = (uint8_t)(check != 0);
        total++;
        req_counts[requests - 1] += (int32_t)(gap + 1);
        req_gap_counts[requests - 1] += (int32_t)gap;
    }
    *records_read = total;
    return requests;
}
