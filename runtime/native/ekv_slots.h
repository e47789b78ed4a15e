/* The reuse buffer's slot assignment (ekv_slots.c), declared for its callers.
 *
 * Called from Python: runtime/slots.py SlotTable._assign_native, through the "slots" library (ekv_slots.c alone).
 * Called from C: ekv_fetch.c ekv_fetch_run, in the "fetch" library (ekv_fetch.c, ekv_slots.c and ekv_requests.c
 * compiled apart and linked as one).
 */
#ifndef EKV_SLOTS_H
#define EKV_SLOTS_H

#include <stdint.h>

/* One layer's step of picks into slots, the new records named; nothing changed where it returns a negative code (its
 * definition says which). */
int64_t ekv_slots_assign(int sequences, int batch, int picks, const int64_t *groups, const uint8_t *valid,
                         const int64_t *owners, int capacity, int64_t max_groups, const int64_t *pool,
                         int64_t *group_at, int64_t *owner_at, int64_t *inserted_at, int64_t *used_at,
                         int64_t *slot_of, int score_kind, int64_t *clock, int64_t *slots, int64_t *new_owner,
                         int64_t *new_slot, int64_t *new_group, int64_t *hits, int64_t *lookups, float *frequency,
                         const float *cost);

#endif
