/* A layer's picks to its reads in one call (runtime/fetch_plan.py NativePlanner, on the thread that takes the picks):
 * the reuse buffer's slots assigned (ekv_slots.c ekv_slots_assign), each missed record's host address in its slot,
 * and the misses' reads planned as requests (ekv_requests.c ekv_requests_plan).  A layer's job is made once (every
 * table and buffer it points into lives as long as the batch) and a step passes only its picks.  The "fetch" library
 * links this unit with ekv_slots.c and ekv_requests.c, so their reference behaviour stays where it is tested.
 */
#include <stddef.h>
#include <stdint.h>

#include "ekv_fetch.h"
#include "ekv_requests.h"
#include "ekv_slots.h"

#define FIELD(name) offsetof(struct ekv_fetch_job, name)
static const int64_t JOB_OFFSETS[] = {
    FIELD(sequences), FIELD(batch), FIELD(picks), FIELD(capacity), FIELD(max_groups), FIELD(pool), FIELD(group_at),
    FIELD(owner_at), FIELD(inserted_at), FIELD(used_at), FIELD(slot_of), FIELD(score_kind), FIELD(clock), FIELD(hits),
    FIELD(lookups), FIELD(frequency), FIELD(cost), FIELD(slots), FIELD(new_owner), FIELD(new_slot), FIELD(new_group),
    FIELD(slot_base), FIELD(stride), FIELD(addresses), FIELD(n_seqs), FIELD(fds), FIELD(fd_seq_stride),
    FIELD(fd_path_stride), FIELD(n_paths), FIELD(check), FIELD(sum_tables), FIELD(sum_row_bytes), FIELD(layer),
    FIELD(sink), FIELD(scratch), FIELD(req_fds), FIELD(req_offsets), FIELD(req_counts), FIELD(req_paths),
    FIELD(req_gap_counts), FIELD(read_addresses), FIELD(read_seqs), FIELD(read_groups), FIELD(expected),
    FIELD(check_flags), FIELD(capacity_records)};

int64_t ekv_fetch_job_bytes(void) { return sizeof(struct ekv_fetch_job); }

int ekv_fetch_job_fields(void) { return (int)(sizeof JOB_OFFSETS / sizeof JOB_OFFSETS[0]); }

void ekv_fetch_job_offsets(int64_t *out) {
    for (int i = 0; i < ekv_fetch_job_fields(); i++) out[i] = JOB_OFFSETS[i];
}

/* One step's picks of the job's layer: groups, valid, owners [batch, picks] (owners NULL: each row's own records).
 * Returns the misses' count n (their owners, slots and groups in the job's new_* rows, the picks' slots in its slots),
 * with counts[0] the requests planned for them and counts[1] the records those read (counts[0] -1: the planning
 * refused); or a negative code of ekv_slots_assign with nothing changed. */
int64_t ekv_fetch_run(const struct ekv_fetch_job *job, const int64_t *groups, const uint8_t *valid,
                      const int64_t *owners, int64_t max_records, int64_t gap_records, int64_t *counts) {
    int64_t n = ekv_slots_assign(
        (int)job->sequences, (int)job->batch, (int)job->picks, groups, valid, owners, (int)job->capacity,
        job->max_groups, job->pool, job->group_at, job->owner_at, job->inserted_at, job->used_at, job->slot_of,
        (int)job->score_kind, job->clock, job->slots, job->new_owner, job->new_slot, job->new_group, job->hits,
        job->lookups, job->frequency, job->cost);
    counts[0] = counts[1] = 0;
    if (n <= 0) return n;
    for (int64_t i = 0; i < n; i++) job->addresses[i] = job->slot_base + job->new_slot[i] * job->stride;
    counts[0] = ekv_requests_plan(
        n, job->new_owner, job->new_group, job->addresses, job->n_seqs, job->fds, job->fd_seq_stride,
        job->fd_path_stride, (int)job->n_paths, job->stride, max_records, gap_records, (int)job->check,
        job->sum_tables, job->sum_row_bytes, (int)job->layer, job->sink, job->scratch, job->req_fds,
        job->req_offsets, job->req_counts, job->req_paths, job->req_gap_counts, job->read_addresses, job->read_seqs,
        job->read_groups, job->expected, job->check_flags, job->capacity_records, &counts[1]);
    if (counts[0] < 0) counts[0] = -1;
    return n;
}
