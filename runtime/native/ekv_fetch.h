/* A layer's picks to its reads in one call: the job a caller builds once per (layer, pick shape), and the call a
 * decode step makes with its picks.  runtime/fetch_plan.py's FetchJob mirrors struct ekv_fetch_job field for field
 * and checks its size and offsets against ekv_fetch_job_bytes and ekv_fetch_job_offsets when the library loads.
 * Every field is 8 bytes, an int64_t or a pointer (c_int64 or c_void_p there): keep it so, or that check cannot see a
 * field's type change. */
#ifndef EKV_FETCH_H
#define EKV_FETCH_H
#include <stdint.h>

struct ekv_fetch_job {
    /* the slot assignment's tables (ekv_slots_assign's arguments but the picks) */
    int64_t sequences, batch, picks, capacity, max_groups;
    const int64_t *pool;
    int64_t *group_at, *owner_at, *inserted_at, *used_at, *slot_of;
    int64_t score_kind;
    int64_t *clock, *hits, *lookups;
    float *frequency;
    const float *cost;
    /* out, [batch * picks] each: the picks' slots, each miss's owner, slot and group */
    int64_t *slots, *new_owner, *new_slot, *new_group;
    /* the misses' host addresses: slot_base + slot * stride */
    int64_t slot_base, stride;
    int64_t *addresses;
    /* the planning's files and checksums (ekv_requests_plan's arguments) */
    int64_t n_seqs;
    const int32_t *fds;
    int64_t fd_seq_stride, fd_path_stride, n_paths, check;
    const int64_t *sum_tables, *sum_row_bytes;
    int64_t layer, sink;
    void *scratch; /* ekv_requests_scratch_bytes(batch * picks) */
    /* out, per request [batch * picks] */
    int32_t *req_fds;
    int64_t *req_offsets;
    int32_t *req_counts, *req_paths, *req_gap_counts;
    /* out, per record read [capacity_records] */
    int64_t *read_addresses, *read_seqs, *read_groups;
    uint32_t *expected;
    uint8_t *check_flags;
    int64_t capacity_records;
};

/* ---- called by runtime/fetch_plan.py when it loads the library ---- */
int64_t ekv_fetch_job_bytes(void);
int ekv_fetch_job_fields(void);
void ekv_fetch_job_offsets(int64_t *out); /* offsetof each field, in declaration order */

/* ---- called once a layer and step ---- */
int64_t ekv_fetch_run(const struct ekv_fetch_job *job, const int64_t *groups, const uint8_t *valid,
                      const int64_t *owners, int64_t max_records, int64_t gap_records, int64_t *counts);
#endif
