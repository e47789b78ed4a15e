"""Reuse buffer bookkeeping on a scripted sequence of predictions."""
import numpy as np
import pytest

from edgekv.runtime.slots import PreloadSlots, SlotTable


def step(table, groups, layer=0):
    g = np.array([groups])
    slots, misses = table.assign(layer, g, np.ones_like(g, dtype=bool))
    return slots[0].tolist(), misses.group.tolist()


def test_hits_misses_and_fifo_replacement():
    table = SlotTable(n_layers=2, batch=1, capacity=4, max_groups=64)
    slots, missed = step(table, [10, 11, 12])
    assert missed == [10, 11, 12] and slots == [0, 1, 2]
    slots, missed = step(table, [11, 13, 10])  # two hits, one miss into the free slot
    assert missed == [13] and slots == [1, 3, 0]
    # full now: 10@0 (oldest), 11@1, 12@2, 13@3; a miss evicts the oldest unprotected slot.
    slots, missed = step(table, [14, 12])
    assert missed == [14] and slots == [0, 2]  # 10 was oldest -> evicted
    slots, missed = step(table, [15, 16])
    assert missed == [15, 16] and slots == [1, 2]  # then 11 and 12: FIFO, a hit does not refresh age
    assert table.hits[0] == 3 and table.lookups[0] == 10


def test_current_hits_are_never_evicted():
    table = SlotTable(n_layers=1, batch=1, capacity=3, max_groups=64)
    step(table, [1, 2, 3])  # 1 is oldest
    slots, missed = step(table, [1, 4, 5])  # 1 hits; 4 and 5 must evict 2 and 3, not 1
    assert missed == [4, 5]
    assert table.group[0, 0, slots[0]] == 1 and set(table.group[0, 0]) == {1, 4, 5}


def test_layers_and_sequences_are_independent_and_padding_is_skipped():
    table = SlotTable(n_layers=2, batch=2, capacity=2, max_groups=64)
    groups = np.array([[5, 6], [5, 0]])
    valid = np.array([[True, True], [True, False]])
    _, misses = table.assign(1, groups, valid)
    assert sorted(zip(*misses)) == [(0, 0, 5), (0, 1, 6), (1, 2, 5)]  # flat slots: sequence 1 owns 2 and 3
    _, misses = table.assign(0, groups, valid)
    assert len(misses.group) == 3  # layer 0 has its own table
    table.reset(0)
    assert (table.group[:, 0] == -1).all() and table.lookups[0] == 0 and table.lookups[1] == 2


def test_preload_slots_read_everything():
    slots = PreloadSlots(batch=1, capacity=3)
    assert [slots.buffer_index(i) for i in range(4)] == [0, 1, 0, 1]
    idx, misses = slots.assign(0, np.array([[4, 2, 9]]), np.array([[True, True, False]]))
    assert idx.tolist() == [[0, 1, 2]] and [tuple(map(int, m)) for m in zip(*misses)] == [(0, 0, 4), (0, 1, 2)]


@pytest.mark.parametrize("n_layers", [1, 2, 3, 5])
def test_every_layer_has_a_buffer_of_its_own_while_the_next_one_loads(n_layers):
    """Layer i+1 is read while layer i attends, so the two never share a buffer."""
    for slots in (SlotTable(n_layers, batch=1, capacity=2, max_groups=8), PreloadSlots(batch=1, capacity=2)):
        buffers = [slots.buffer_index(layer) for layer in range(n_layers)]
        assert max(buffers) < slots.n_buffers(n_layers)
        assert all(a != b for a, b in zip(buffers, buffers[1:]))


def test_reverse_map_tracks_evictions():
    table = SlotTable(n_layers=1, batch=1, capacity=2, max_groups=16)
    step(table, [3, 4])
    step(table, [5, 6])  # evicts 3 and 4
    assert table.slot_of[0, 0, 3] == -1 and table.slot_of[0, 0, 4] == -1
    assert {int(table.slot_of[0, 0, g]) for g in (5, 6)} == {0, 1}
    _, missed = step(table, [3])
    assert missed == [3]


@pytest.mark.parametrize("replacement", ["fifo", "lru", "cost"])
@pytest.mark.parametrize("seed", range(6))
def test_the_native_assignment_keeps_the_tables_as_the_numpy_path_does(replacement, seed):
    """runtime/native/ekv_slots.c against the numpy path on random steps: odd capacities, two sequences pooled by a
    shared prefix (one picks the other's records), rows without picks, repeated picks, corrections (not counted), steps
    a pool cannot hold and a pick outside its pool (the same error, nothing changed): the same slots, misses, hits and
    tables after every step; with cost, refetch costs and priors set now and then (fractional, with ties) and the same
    frequencies after every step (a table on the native backend beside one on the torch backend, numpy's)."""
    from edgekv.runtime.kernels import resolve_backend
    from edgekv.runtime.slots import record_owners
    rng = np.random.default_rng(seed)
    n_layers, batch, capacity, max_groups = 3, 4, int(rng.integers(5, 12)), 40
    tables = [SlotTable(n_layers, batch, capacity, max_groups, replacement, resolve_backend("cpu", name))
              for name in ("native", "torch")]
    assert tables[0]._assign == tables[0]._assign_native and tables[1]._assign == tables[1]._assign_numpy
    owner, shared = np.arange(batch), np.zeros(batch, dtype=np.int64)
    if seed % 2:
        owner[2], shared[2] = 0, 10
        for table in tables:
            table.share([0, 2])
    errors = 0
    for step in range(80):
        picks = capacity + (3 if step % 7 == 6 else 0)  # past a lone sequence's slots now and then
        groups = rng.integers(0, max_groups if step % 3 else 12, (batch, picks))  # every third step: many repeats
        valid = rng.random((batch, picks)) < 0.8
        valid[1] &= step % 5 != 0
        owners = record_owners(groups, owner, shared)
        if replacement == "cost" and step % 9 == 0:  # what clustering tells the replacement (runtime/offload/recluster.py)
            layer, seq, chosen = step % n_layers, int(rng.integers(batch)), rng.choice(max_groups, 8, replace=False)
            cost, prior = rng.choice([0.5, 1.0, 1.5, 2.25], 8), rng.integers(0, 3, 8)
            for table in tables:
                table.replacement.set_cost(layer, seq, chosen, cost)
                table.replacement.set_prior(layer, seq, chosen[:4], prior[:4])
        if step % 11 == 10:
            owners[1, 0], valid[1, 0] = 3, True  # a record of a sequence outside row 1's pool
        results = []
        for table in tables:
            try:
                results.append(table.assign(step % n_layers, groups, valid, owners, count=step % 4 != 3))
            except ValueError as exc:
                results.append(str(exc))
        if isinstance(results[1], str):
            errors += 1
            assert results[0] == results[1]
        else:
            (slots_0, misses_0), (slots_1, misses_1) = results
            assert np.array_equal(slots_0, slots_1) and all(map(np.array_equal, misses_0, misses_1))
        for name in ("group", "owner", "inserted", "used", "slot_of", "hits", "lookups", "_clocks"):
            assert np.array_equal(getattr(tables[0], name), getattr(tables[1], name)), (step, name)
        if replacement == "cost":
            assert np.array_equal(tables[0].replacement.frequency, tables[1].replacement.frequency), step
    assert errors > 0


def test_a_pick_outside_the_table_is_refused_by_the_native_call_and_named_by_numpy():
    """A group past ``max_groups`` (or an owner past the batch) would index past the native call's tables: it refuses
    them, changes nothing, and the numpy path raises its IndexError."""
    table = SlotTable(1, 2, 4, 10)
    before = table.slot_of.copy()
    for groups, owners in ((np.array([[3, 10]]), None), (np.array([[3, 4]]), np.array([[0, 5]]))):
        with pytest.raises(IndexError):
            table.assign(0, groups, np.ones_like(groups, dtype=bool), owners)
        assert np.array_equal(table.slot_of, before) and table.lookups.sum() == 0
