/* A decode layer's reads planned as requests (ekv_requests.c), declared for its callers.
 *
 * Called from Python: runtime/disk_store.py DiskKVStore._native_requests, through the "requests" library
 * (ekv_requests.c alone); runtime/fetch_plan.py sizes a job's scratch with ekv_requests_scratch_bytes of the "fetch"
 * library.
 * Called from C: ekv_fetch.c ekv_fetch_run, in the "fetch" library (ekv_fetch.c, ekv_slots.c and ekv_requests.c
 * compiled apart and linked as one).
 */
#ifndef EKV_REQUESTS_H
#define EKV_REQUESTS_H

#include <stdint.h>

/* The scratch bytes a plan of n reads needs. */
int64_t ekv_requests_scratch_bytes(int64_t n);

/* n reads into requests and the records they read; a negative code where it refuses (its definition says which). */
int64_t ekv_requests_plan(int64_t n, const int64_t *seqs, const int64_t *groups, const int64_t *addresses,
                          int64_t n_seqs, const int32_t *fds, int64_t fd_seq_stride, int64_t fd_path_stride,
                          int n_paths, int64_t stride, int64_t max_records, int64_t gap_records, int check,
                          const int64_t *sum_tables, const int64_t *sum_row_bytes, int layer, int64_t sink,
                          void *scratch, int32_t *req_fds, int64_t *req_offsets, int32_t *req_counts,
                          int32_t *req_paths, int32_t *req_gap_counts, int64_t *out_addresses, int64_t *out_seqs,
                          int64_t *out_groups, uint32_t *out_expected, uint8_t *out_check, int64_t capacity,
                          int64_t *records_read);

#endif
