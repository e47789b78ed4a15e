/* The reuse buffer's slot assignment for one layer and step (runtime/slots.py SlotTable.assign), for fifo (oldest
 * insertion first), lru (least recently picked first) and cost (Swarm's lowest activation frequency x refetch cost
 * first, the frequency kept here as CostAware.observe keeps it).  The Python path is the reference; this one keeps the
 * same tables the same way, bit for bit, in one call where the numpy path takes ~40 (SmolLM2 8K, batch 1: ~100 us of a
 * decode layer's ~1.5 ms on the compute thread).
 *
 * Slots are flat: sequence b owns [b * capacity, (b + 1) * capacity); slot_of[o * max_groups + g] is the slot holding
 * record (owner o, group g), or -1.  A step's valid picks are taken row by row; a pick whose record is resident is a
 * hit, a missed record is placed once (its first picker reads it), in a slot of its row's pool: a free one first,
 * then the resident with the lowest (score, insertion, slot), never one a pick of this step holds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ekv_slots.h"

enum { SCORE_INSERTED, SCORE_USED, SCORE_COST }; /* fifo, lru, cost */
enum { POOL_MISMATCH = -1, POOL_TOO_SMALL = -2, NO_MEMORY = -3, OUTSIDE = -4 };

typedef struct {
    int64_t occupied;
    double score; /* numpy's float64 score column: an int64 clock, or a float32 frequency x cost */
    int64_t inserted, slot;
} victim_key;

static int before(const void *a, const void *b) {
    const victim_key *x = a, *y = b;
    if (x->occupied != y->occupied) return x->occupied < y->occupied ? -1 : 1;
    if (x->score != y->score) return x->score < y->score ? -1 : 1;
    if (x->inserted != y->inserted) return x->inserted < y->inserted ? -1 : 1;
    return (x->slot > y->slot) - (x->slot < y->slot);
}

/* groups, valid, owners [batch, picks] (row b is sequence b; owners NULL: each row its own); the layer's tables of
 * the table's `sequences` (>= batch): group_at, owner_at, inserted_at, used_at [sequences * capacity], slot_of
 * [sequences * max_groups]; pool [sequences] (a pool's label is one of its sequences).  Out: slots [batch, picks] (0
 * where not valid), and the new records in the order of their first picker: their owner, slot and group (at most
 * batch * picks).  hits/lookups [sequences] are counted unless NULL; *clock advances as the Python path's does.
 * frequency, cost [sequences * max_groups] (cost only, else NULL): a record's eviction score is their float32 product;
 * after the step each picked record's frequency rises by one and each resident its stepped pool left unpicked falls
 * by one, not below zero.  Returns the new records' count, or a negative code with nothing changed: -1 a row picks a
 * record of a sequence outside its pool, -2 a pool holds fewer slots than the distinct records it misses and keeps,
 * -3 no memory, -4 a group or owner outside the table (the caller's path then says what is wrong). */
int64_t ekv_slots_assign(int sequences, int batch, int picks, const int64_t *groups, const uint8_t *valid, const int64_t *owners,
                         int capacity, int64_t max_groups, const int64_t *pool, int64_t *group_at, int64_t *owner_at,
                         int64_t *inserted_at, int64_t *used_at, int64_t *slot_of, int score_kind, int64_t *clock,
                         int64_t *slots, int64_t *new_owner, int64_t *new_slot, int64_t *new_group, int64_t *hits,
                         int64_t *lookups, float *frequency, const float *cost) {
    const int64_t n_slots = (int64_t)sequences * capacity, entries = (int64_t)batch * picks;
    if (batch > sequences || (score_kind == SCORE_COST && (!frequency || !cost))) return OUTSIDE;
    for (int64_t e = 0; e < entries; e++) {
        if (!valid[e]) continue;
        if (groups[e] < 0 || groups[e] >= max_groups || (owners && (owners[e] < 0 || owners[e] >= sequences)))
            return OUTSIDE;
        if (owners && pool[owners[e]] != pool[e / picks]) return POOL_MISMATCH;
    }
    int64_t *new_pool = malloc(sizeof(int64_t) * (2 * entries + sequences + 1)); /* and its first picker's row */
    uint8_t *kept = calloc((size_t)n_slots + 1, 1);
    victim_key *keys = malloc(sizeof(victim_key) * (n_slots + 1));
    if (!new_pool || !kept || !keys) {
        free(new_pool), free(kept), free(keys);
        return NO_MEMORY;
    }
    int64_t *new_row = new_pool + entries, *wanted = new_row + entries, n_new = 0;
    memset(wanted, 0, sizeof(int64_t) * sequences);
    /* look up every pick; a missed record is new at its first picker, marked -2 - k in slot_of until placed */
    for (int64_t e = 0; e < entries; e++) {
        if (!valid[e]) continue;
        const int64_t o = owners ? owners[e] : e / picks, g = groups[e], at = o * max_groups + g;
        int64_t f = slot_of[at];
        if (f >= 0) {
            kept[f] = 1;
        } else if (f == -1) {
            new_owner[n_new] = o, new_group[n_new] = g, new_pool[n_new] = pool[e / picks], new_row[n_new] = e / picks;
            wanted[pool[e / picks]]++;
            f = slot_of[at] = -2 - n_new++;
        }
        slots[e] = f;
    }
    /* each pool's victims, in the replacement's order, for its new records in their order */
    int64_t code = n_new;
    for (int p = 0; p < sequences && code >= 0; p++) {
        if (!wanted[p]) continue;
        int64_t n = 0;
        for (int64_t s = 0; s < n_slots; s++) {
            if (kept[s] || pool[s / capacity] != p) continue;
            const int64_t occupied = group_at[s] >= 0;
            double score = 0;
            if (occupied && score_kind == SCORE_COST) {
                const int64_t at = owner_at[s] * max_groups + group_at[s];
                score = (float)(frequency[at] * cost[at]);
            } else if (occupied) {
                score = (double)(score_kind == SCORE_USED ? used_at[s] : inserted_at[s]);
            }
            keys[n++] = (victim_key){occupied, score, inserted_at[s], s};
        }
        if (n < wanted[p]) {
            code = POOL_TOO_SMALL;
            break;
        }
        qsort(keys, (size_t)n, sizeof *keys, before);
        for (int64_t k = 0, taken = 0; k < n_new; k++)
            if (new_pool[k] == p) new_slot[k] = keys[taken++].slot;
    }
    if (code < 0) { /* nothing placed: the marks come off */
        for (int64_t k = 0; k < n_new; k++) slot_of[new_owner[k] * max_groups + new_group[k]] = -1;
        free(new_pool), free(kept), free(keys);
        return code;
    }
    /* evict, then place (SlotTable._place), then resolve each pick's slot */
    for (int64_t k = 0; k < n_new; k++) {
        const int64_t s = new_slot[k];
        if (group_at[s] >= 0) slot_of[owner_at[s] * max_groups + group_at[s]] = -1;
    }
    for (int64_t k = 0; k < n_new; k++) {
        const int64_t s = new_slot[k];
        owner_at[s] = new_owner[k], group_at[s] = new_group[k], inserted_at[s] = *clock + k;
        slot_of[new_owner[k] * max_groups + new_group[k]] = s;
    }
    *clock += n_new;
    for (int64_t e = 0; e < entries; e++) {
        if (!valid[e]) {
            slots[e] = 0;
            continue;
        }
        if (slots[e] < 0) slots[e] = new_slot[-2 - slots[e]];
        used_at[slots[e]] = *clock; /* SlotTable._observe: the picked slots' last use */
    }
    *clock += 1;
    if (score_kind == SCORE_COST) { /* CostAware.observe: picked slots up, the stepped pools' other residents down */
        int64_t *stepped = wanted; /* reused: [sequences] the pool has a valid pick this step */
        memset(stepped, 0, sizeof(int64_t) * sequences);
        for (int64_t e = 0; e < entries; e++)
            if (valid[e]) stepped[pool[e / picks]] = 1;
        for (int64_t s = 0; s < n_slots; s++) {
            if (group_at[s] < 0 || !stepped[pool[s / capacity]]) continue;
            float *f = &frequency[owner_at[s] * max_groups + group_at[s]];
            const int picked = used_at[s] == *clock - 1; /* this step's picks alone carry its clock (set above) */
            *f = picked ? *f + 1.0f : (*f - 1.0f > 0.0f ? *f - 1.0f : 0.0f);
        }
    }
    if (hits) { /* a record read once for several rows is a hit for all but its first picker */
        for (int64_t e = 0; e < entries; e++)
            if (valid[e]) lookups[e / picks]++, hits[e / picks]++;
        for (int64_t k = 0; k < n_new; k++) hits[new_row[k]]--;
    }
    free(new_pool), free(kept), free(keys);
    return n_new;
}
