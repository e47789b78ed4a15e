/* A layer's picks to its reads in one call (runtime/fetch_plan.py FetchPlanner, on the decode thread): the reuse
 * buffer's slots assigned (ekv_slots.c ekv_slots_assign), each missed record's host address in its slot, and the
 * misses' reads planned as requests (ekv_requests.c ekv_requests_plan).  Python made these two calls and the glue
 * between them, each dearer inside the decode step than alone; here a layer's job is made once (every table and
 * buffer it points into lives as long as the batch) and a step passes only its picks.  Both are linked in (the
 * "fetch" library is this unit, ekv_slots.c and ekv_requests.c), so their reference behaviour stays where it is
 * tested.
 */
#include <stddef.h>
#include <stdint.h>

#include "ekv_requests.h"
#include "ekv_slots.h"

/* A job: int64 fields in this order (pointers as addresses), FetchPlanner.FIELDS in Python. */
enum {
    /* the slot assignment's tables (ekv_slots_assign's arguments but the picks; no owners: each row its own) */
    F_SEQUENCES, F_BATCH, F_PICKS, F_CAPACITY, F_MAX_GROUPS, F_POOL, F_GROUP_AT, F_OWNER_AT, F_INSERTED_AT,
    F_USED_AT, F_SLOT_OF, F_SCORE_KIND, F_CLOCK, F_HITS, F_LOOKUPS, F_FREQUENCY, F_COST,
    F_SLOTS, F_NEW_OWNER, F_NEW_SLOT, F_NEW_GROUP, /* out: [batch * picks] each */
    F_SLOT_BASE, F_STRIDE, F_ADDRESSES, /* the misses' host addresses: slot_base + slot * stride */
    /* the planning's files and checksums (ekv_requests_plan's arguments) */
    F_N_SEQS, F_FDS, F_FD_SEQ_STRIDE, F_FD_PATH_STRIDE, F_N_PATHS, F_CHECK, F_SUM_TABLES, F_SUM_ROW_BYTES, F_LAYER,
    F_SINK, F_SCRATCH, /* ekv_requests_scratch_bytes(batch * picks) */
    F_REQ_FDS, F_REQ_OFFSETS, F_REQ_COUNTS, F_REQ_PATHS, F_REQ_GAP_COUNTS, /* out, per request: [batch * picks] */
    F_READ_ADDRESSES, F_READ_SEQS, F_READ_GROUPS, F_EXPECTED, F_CHECK_FLAGS, F_CAPACITY_RECORDS, /* per record read */
    F_COUNT
};

#define P(type, field) ((type)(intptr_t)job[field])

int ekv_fetch_fields(void) { return F_COUNT; }

/* One step's picks of the job's layer: groups, valid [batch, picks].  Returns the misses' count n (their owners, slots
 * and groups in the job's new_* rows, the picks' slots in its slots), with counts[0] the requests planned for them
 * and counts[1] the records those read (counts[0] -1: the planning refused, and the caller plans them its way); or a
 * negative code of ekv_slots_assign with nothing changed (the caller's numpy path then says what is wrong). */
int64_t ekv_fetch_run(const int64_t *job, const int64_t *groups, const uint8_t *valid, int64_t max_records,
                      int64_t gap_records, int64_t *counts) {
    int64_t *new_owner = P(int64_t *, F_NEW_OWNER), *new_slot = P(int64_t *, F_NEW_SLOT);
    int64_t *new_group = P(int64_t *, F_NEW_GROUP), *addresses = P(int64_t *, F_ADDRESSES);
    int64_t n = ekv_slots_assign(
        (int)job[F_SEQUENCES], (int)job[F_BATCH], (int)job[F_PICKS], groups, valid, NULL, (int)job[F_CAPACITY],
        job[F_MAX_GROUPS], P(const int64_t *, F_POOL), P(int64_t *, F_GROUP_AT), P(int64_t *, F_OWNER_AT),
        P(int64_t *, F_INSERTED_AT), P(int64_t *, F_USED_AT), P(int64_t *, F_SLOT_OF), (int)job[F_SCORE_KIND],
        P(int64_t *, F_CLOCK), P(int64_t *, F_SLOTS), new_owner, new_slot, new_group, P(int64_t *, F_HITS),
        P(int64_t *, F_LOOKUPS), P(float *, F_FREQUENCY), P(const float *, F_COST));
    counts[0] = counts[1] = 0;
    if (n <= 0) return n;
    for (int64_t i = 0; i < n; i++) addresses[i] = job[F_SLOT_BASE] + new_slot[i] * job[F_STRIDE];
    counts[0] = ekv_requests_plan(
        n, new_owner, new_group, addresses, job[F_N_SEQS], P(const int32_t *, F_FDS), job[F_FD_SEQ_STRIDE],
        job[F_FD_PATH_STRIDE], (int)job[F_N_PATHS], job[F_STRIDE], max_records, gap_records, (int)job[F_CHECK],
        P(const int64_t *, F_SUM_TABLES), P(const int64_t *, F_SUM_ROW_BYTES), (int)job[F_LAYER], job[F_SINK],
        P(void *, F_SCRATCH), P(int32_t *, F_REQ_FDS), P(int64_t *, F_REQ_OFFSETS), P(int32_t *, F_REQ_COUNTS),
        P(int32_t *, F_REQ_PATHS), P(int32_t *, F_REQ_GAP_COUNTS), P(int64_t *, F_READ_ADDRESSES),
        P(int64_t *, F_READ_SEQS), P(int64_t *, F_READ_GROUPS), P(uint32_t *, F_EXPECTED), P(uint8_t *, F_CHECK_FLAGS),
        job[F_CAPACITY_RECORDS], &counts[1]);
    if (counts[0] < 0) counts[0] = -1;
    return n;
}
