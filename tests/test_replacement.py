"""Reuse buffer replacement policies, shared-prefix pools and read deduplication, on scripted and random traces."""
import numpy as np
import pytest

from edgekv.runtime.slots import CostAware, Fifo, Lru, PreloadSlots, Replacement, SlotTable, replay_hit_rate


class KVSwapReference:
    """The per-sequence FIFO table as it was before pools and policies (local slots), kept as an oracle."""

    def __init__(self, n_layers, batch, capacity, max_groups):
        self.group = np.full((n_layers, batch, capacity), -1, dtype=np.int64)
        self.inserted = np.full((n_layers, batch, capacity), -1, dtype=np.int64)
        self.slot_of = np.full((n_layers, batch, max_groups), -1, dtype=np.int64)
        self._clock = 0
        self.hits = np.zeros(batch, dtype=np.int64)
        self.lookups = np.zeros(batch, dtype=np.int64)

    def assign(self, layer, groups, valid):
        slots = np.zeros(groups.shape, dtype=np.int64)
        missed = []
        for b in range(groups.shape[0]):
            cols = np.flatnonzero(valid[b])
            where = self.slot_of[layer, b, groups[b, cols]]
            hit = where >= 0
            slots[b, cols[hit]] = where[hit]
            self.lookups[b] += len(cols)
            self.hits[b] += int(hit.sum())
            need = cols[~hit]
            if len(need):
                slots[b, need] = self._replace(layer, b, where[hit], groups[b, need])
                missed += [(b, int(s), int(g)) for s, g in zip(slots[b, need], groups[b, need])]
        return slots, missed

    def _replace(self, layer, b, protected, new_groups):
        age = self.inserted[layer, b].copy()
        age[protected] = np.iinfo(np.int64).max
        victims = np.argsort(age, kind="stable")[: len(new_groups)]
        evicted = self.group[layer, b, victims]
        self.slot_of[layer, b, evicted[evicted >= 0]] = -1
        self.group[layer, b, victims] = new_groups
        self.slot_of[layer, b, new_groups] = victims
        self.inserted[layer, b, victims] = self._clock + np.arange(len(new_groups))
        self._clock += len(new_groups)
        return victims

    def reset(self, seq):
        self.group[:, seq] = -1
        self.inserted[:, seq] = -1
        self.slot_of[:, seq] = -1
        self.hits[seq] = 0
        self.lookups[seq] = 0


def random_trace(seed, n_layers=2, batch=3, m=4, max_groups=24, steps=60):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for layer in range(n_layers):
            groups = np.stack([rng.choice(max_groups, m, replace=False) for _ in range(batch)])
            yield layer, groups, rng.random((batch, m)) < 0.85


def step(table, groups, layer=0, owners=None):
    """One step of a batch given as lists of picks (all valid); returns (flat slots, missed (owner, group))."""
    g = np.array(groups)
    slots, misses = table.assign(layer, g, np.ones_like(g, dtype=bool), None if owners is None else np.array(owners))
    return slots.tolist(), list(zip(misses.seq.tolist(), misses.group.tolist()))


def resident(table, layer=0, seq=0):
    return sorted(int(g) for g in np.flatnonzero(table.slot_of[layer, seq] >= 0))


@pytest.mark.parametrize("seed", range(6))
def test_fifo_is_kvswaps_per_sequence_buffer_bit_for_bit(seed):
    capacity, batch = 6, 3
    old, new = KVSwapReference(2, batch, capacity, 24), SlotTable(2, batch, capacity, 24)
    base = np.arange(batch)[:, None] * capacity
    for i, (layer, groups, valid) in enumerate(random_trace(seed, batch=batch)):
        if i % 37 == 36:
            old.reset(i % batch)
            new.reset(i % batch)
        old_slots, old_missed = old.assign(layer, groups, valid)
        slots, misses = new.assign(layer, groups, valid)
        assert (slots[valid] == (old_slots + base)[valid]).all()
        assert list(zip(*(m.tolist() for m in misses))) == [(b, s + b * capacity, g) for b, s, g in old_missed]
        assert (new.group == old.group).all()
        assert (new.hits == old.hits).all() and (new.lookups == old.lookups).all()
    assert new.hits.sum() > 0


def test_no_owners_means_each_row_owns_its_picks():
    a, b = SlotTable(2, 3, 6, 24), SlotTable(2, 3, 6, 24)
    for layer, groups, valid in random_trace(7):
        slots_a, misses_a = a.assign(layer, groups, valid)
        slots_b, misses_b = b.assign(layer, groups, valid, np.broadcast_to(np.arange(3)[:, None], groups.shape))
        assert (slots_a == slots_b).all() and all((x == y).all() for x, y in zip(misses_a, misses_b))


def test_lru_evicts_the_least_recently_picked():
    table = SlotTable(1, 1, 3, 16, replacement="lru")
    assert isinstance(table.replacement, Lru)
    step(table, [[1, 2, 3]])
    assert step(table, [[4]])[1] == [(0, 4)] and resident(table) == [2, 3, 4]  # a tie in recency: oldest insertion
    step(table, [[2]])  # a hit refreshes 2
    step(table, [[5]])
    assert resident(table) == [2, 4, 5]  # 3 goes, though 2 was inserted before it
    step(table, [[6, 7]])
    assert resident(table) == [5, 6, 7]


def test_cost_aware_evicts_the_least_frequently_picked():
    table = SlotTable(1, 1, 3, 16, replacement="cost")
    policy = table.replacement
    assert isinstance(policy, CostAware)
    step(table, [[1, 2, 3]])
    step(table, [[1, 2]])  # picked: +1; resident but unpicked: -1
    assert policy.frequency[0, 0, [1, 2, 3]].tolist() == [2, 2, 0]
    step(table, [[1]])
    step(table, [[1]])  # 3 stays at 0
    assert policy.frequency[0, 0, [1, 2, 3]].tolist() == [4, 0, 0]
    step(table, [[4, 5]])  # 2 and 3 go; 1 stays though inserted first
    assert resident(table) == [1, 4, 5]
    step(table, [[6]])  # 4 and 5 tie at 1: the older insertion goes
    assert resident(table) == [1, 5, 6]


@pytest.mark.parametrize("cost, kept", [(None, [1, 3]), (10.0, [2, 3])])
def test_cost_aware_weighs_frequency_by_refetch_cost(cost, kept):
    table = SlotTable(1, 1, 2, 16, replacement="cost")
    step(table, [[1, 2]])
    table.replacement.set_prior(0, 0, [1, 2], [3, 2])
    if cost is not None:
        table.replacement.set_cost(0, 0, [2], cost)  # 2 is ten times dearer to read back
    step(table, [[3]])
    assert resident(table) == kept


def test_cost_aware_history_survives_eviction_until_reset():
    table = SlotTable(1, 2, 2, 16, replacement="cost")
    table.replacement.set_prior(0, 0, [9], 4)  # the prompt's window saw group 9 often
    step(table, [[9, 1], [0, 1]])
    step(table, [[2, 3], [0, 1]])  # both of sequence 0's residents go
    assert table.replacement.frequency[0, 0, 9] == 5
    step(table, [[9], [0]])  # read back with its history; 2 goes (tied with 3, older)
    step(table, [[8], [0]])  # 3 (frequency 0) goes, 9 (6) stays
    step(table, [[7], [0]])  # 8 (1) goes, not the older 9 (5) that FIFO would evict
    assert resident(table) == [7, 9]
    table.reset(0)
    assert (table.replacement.frequency[:, 0] == 0).all() and (table.replacement.cost[:, 0] == 1).all()
    assert table.replacement.frequency[0, 1, 0] > 0


def test_lru_beats_fifo_on_a_key_recurring_among_scans():
    trace = [(0, np.array([[0, 1000 + 2 * i]] if i % 2 == 0 else [[1000 + 2 * i, 1001 + 2 * i]]),
              np.ones((1, 2), dtype=bool)) for i in range(60)]
    fifo, lru = (replay_hit_rate(trace, 1, 1, 4, 1200, name) for name in ("fifo", "lru"))
    assert lru > fifo + 0.1


def test_cost_aware_keeps_a_hot_set_that_scans_flush_from_fifo_and_lru():
    """Each step picks 2 of 4 hot groups and 2 groups never seen again, into 6 slots."""
    rng = np.random.default_rng(0)
    scan = iter(range(100, 10_000))
    trace = [(0, np.array([[*rng.choice(4, 2, replace=False), next(scan), next(scan)]]), np.ones((1, 4), dtype=bool))
             for _ in range(200)]
    rates = {name: replay_hit_rate(trace, 1, 1, 6, 10_000, name) for name in ("fifo", "lru", "cost")}
    assert rates["cost"] > 0.45  # hot picks are half of all: it hits nearly every one
    assert rates["fifo"] < 0.3 and rates["lru"] < 0.3


def test_a_pool_reads_a_shared_record_once_and_every_row_hits_it():
    table = SlotTable(1, 4, 2, 16)
    table.share([0, 1, 2, 3])
    shared = [[3, 5]] * 4
    slots, missed = step(table, shared, owners=[[0, 0]] * 4)
    assert missed == [(0, 3), (0, 5)]
    assert all(row == slots[0] for row in slots)
    assert table.hits.tolist() == [0, 2, 2, 2] and table.lookups.tolist() == [2, 2, 2, 2]
    again, missed = step(table, shared, owners=[[0, 0]] * 4)
    assert missed == [] and again == slots
    _, missed = step(table, [[7], [7], [7], [7]], owners=[[0], [1], [2], [3]])  # own records: one each
    assert sorted(missed) == [(0, 7), (1, 7), (2, 7), (3, 7)]


def test_a_miss_never_evicts_what_any_row_of_its_pool_picked():
    table = SlotTable(1, 2, 2, 16)
    table.share([0, 1])
    step(table, [[1, 2], [3, 4]])  # inserted in this order: 1 is the oldest
    slots, missed = step(table, [[1, 7], [3, 8]])
    assert missed == [(0, 7), (1, 8)]
    assert resident(table, seq=0) == [1, 7] and resident(table, seq=1) == [3, 8]  # 2 and 4 went, not 1 and 3
    assert table.slot_of[0, 0, 1] == slots[0][0] and table.slot_of[0, 1, 3] == slots[1][0]


def test_a_pool_must_hold_its_distinct_picks():
    table = SlotTable(1, 2, 2, 16)
    table.share([0, 1])
    step(table, [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="pick 5 distinct records"):
        step(table, [[1, 2, 5], [3, 4, 1]], owners=[[0, 0, 0], [1, 1, 0]])  # both rows pick sequence 0's 1
    with pytest.raises(ValueError, match="pick 3 distinct records"):
        step(SlotTable(1, 1, 2, 16), [[1, 2, 3]])


def test_a_record_of_another_pool_is_refused():
    with pytest.raises(ValueError, match="outside its pool"):
        step(SlotTable(1, 2, 2, 16), [[1], [1]], owners=[[0], [0]])


def test_reset_of_a_pool_member_leaves_the_others_records():
    table = SlotTable(1, 3, 2, 16)
    table.share([0, 1, 2])
    step(table, [[1, 2], [5, 6], [1, 2]], owners=[[0, 0], [1, 1], [0, 0]])  # slots 0-3
    step(table, [[1], [8], [7]], owners=[[0], [1], [2]])  # 8 and 7 take slots 4 and 5 (sequence 2's)
    assert table.slot_of[0, 1, 8] == 4
    table.reset(1)
    assert (table.slot_of[0, 1] == -1).all() and (table.group[0, 1] == -1).all()
    assert table.pool.tolist() == [0, 1, 0]
    assert resident(table, seq=0) == [1, 2] and resident(table, seq=2) == [7]
    slots, missed = step(table, [[1, 2], [5, 6], [1, 7]], owners=[[0, 0], [1, 1], [0, 2]])
    assert missed == [(1, 5), (1, 6)] and slots[1] == [2, 3]  # alone again: its own two slots
    with pytest.raises(ValueError, match="outside its pool"):
        step(table, [[1], [1], [1]], owners=[[0], [0], [0]])


def test_preload_reads_a_record_several_rows_pick_once():
    slots = PreloadSlots(batch=3, capacity=3)
    idx, misses = slots.assign(0, np.array([[4, 2, 9], [4, 2, 9], [4, 1, 9]]),
                               np.array([[True, True, False], [True, True, True], [True, True, True]]),
                               np.array([[0, 1, 1], [0, 1, 1], [0, 2, 2]]))
    assert [tuple(map(int, m)) for m in zip(*misses)] == [(0, 0, 4), (1, 1, 2), (1, 5, 9), (2, 7, 1), (2, 8, 9)]
    assert idx.tolist() == [[0, 1, 2], [0, 1, 5], [0, 7, 8]]
    assert slots.hits.tolist() == [0, 2, 1] and slots.lookups.tolist() == [2, 3, 3]


def test_replay_pools_rows_that_share_a_prefix():
    trace = [(0, np.array([[1, 2, 9], [1, 2, 10], [1, 2, 11]]), np.ones((3, 3), dtype=bool))] * 2
    alone = replay_hit_rate(trace, 1, 3, 3, 16, "fifo")
    shared = replay_hit_rate(trace, 1, 3, 3, 16, "fifo", owners=[None, (0, 4), (0, 4)])
    assert alone == pytest.approx(9 / 18) and shared == pytest.approx(13 / 18)


class Newest(Replacement):
    """Evicts the newest insertion: a policy is its ``score``."""

    def score(self, layer, slots):
        return -self.table.inserted_at[layer, slots]


def test_a_policy_is_one_hook_and_free_slots_go_first_whatever_it_scores():
    table = SlotTable(1, 1, 3, 16)
    table.replacement = Newest(table)
    step(table, [[1, 2]])
    step(table, [[3]])
    assert resident(table) == [1, 2, 3]
    step(table, [[4]])
    assert resident(table) == [1, 2, 4]


def test_unknown_replacement_is_refused():
    assert isinstance(SlotTable(1, 1, 1, 1).replacement, Fifo)
    with pytest.raises(ValueError, match="replacement must be one of"):
        SlotTable(1, 1, 1, 1, replacement="random")
