"""A layer's picks to its reads in one native call (runtime/fetch_plan.py, runtime/native/ekv_fetch.c) against the
calls it stands in for (``SlotTable.assign``, the slot memory's addresses, ``DiskKVStore.batch``): twin tables, slot
memories and stores fed the same picks step after step give the same slots, misses, batches, tables and counters."""
import dataclasses

import numpy as np
import pytest
import torch

from edgekv.runtime.fetch_plan import FetchPlanner, native_fetch
from edgekv.runtime.slot_memory import HostSlots
from edgekv.runtime.slots import SlotTable
from tests.test_native_requests import assert_same, store_of

pytestmark = pytest.mark.skipif(native_fetch() is None, reason="no C compiler for the native fetch planning")

LAYERS, CAPACITY, GROUPS = 2, 9, 60


def twin(root, replacement, batch, **store_options):
    """(slot table, host slots, store) of ``batch`` sequences whose records are written (the same records each call)."""
    torch.manual_seed(0)
    store = store_of(root, seqs=batch, **store_options)
    table = SlotTable(LAYERS, batch, CAPACITY, 256, replacement)
    return table, HostSlots(LAYERS, batch, CAPACITY, store.layout, torch.device("cpu")), store


def counters(table, store):
    return (table.hits.tolist(), table.lookups.tolist(), table._clocks.tolist(), store.requests, store.records_read,
            store.gap_records_read, store.records_by_path.tolist())


@pytest.mark.parametrize("replacement", ["fifo", "lru", "cost"])
@pytest.mark.parametrize("trial", range(4))
def test_the_planner_gives_what_the_calls_one_by_one_give(tmp_path, replacement, trial):
    """Batches of 1 to 3, one and two KV paths, gaps bridged or not, every record checked or none, picks that
    overlap the step before's (hits, misses and evictions) with rows shorter than M."""
    rng = np.random.default_rng(trial)
    batch, picks = 1 + trial % 3, 7
    options = {"n_paths": 1 + trial % 2, "verify_fraction": float(trial != 3), "gap_bytes": 512 * (trial % 3)}
    (table, memory, store), (table_b, memory_b, store_b) = (
        twin(tmp_path / name, replacement, batch, **options) for name in ("planned", "by calls"))
    planner = FetchPlanner.for_policy(table, memory, store)
    assert planner is not None
    try:
        for _ in range(10):
            layer = int(rng.integers(LAYERS))
            groups = np.stack([rng.choice(GROUPS, picks, replace=False) for _ in range(batch)])
            valid = rng.random((batch, picks)) < 0.85
            slots, misses, reads = planner.plan(layer, groups, valid)
            slots_b, misses_b = table_b.assign(layer, groups, valid)
            assert np.array_equal(slots[valid], slots_b[valid])
            assert all(np.array_equal(a, b) for a, b in zip(misses, misses_b))
            if len(misses_b.seq):
                addresses = memory_b.read_addresses(layer, layer, misses_b) - memory_b.slot_base(layer) + \
                    memory.slot_base(layer)
                reference = store_b.batch(layer, misses_b.seq, misses_b.group, addresses)
                sink, sink_b = store._gap_sink().ctypes.data, store_b._gap_sink().ctypes.data
                fds = dict(zip(store_b._fds.ravel().tolist(), store._fds.ravel().tolist()))  # the twin's files
                assert_same(reads, dataclasses.replace(
                    reference, addresses=np.where(reference.addresses == sink_b, sink, reference.addresses),
                    fds=np.array([fds[fd] for fd in reference.fds.tolist()], dtype=np.int32)))
            else:
                assert reads is None
            assert counters(table, store) == counters(table_b, store_b)
        for name in ("group", "owner", "inserted", "used", "slot_of"):
            assert np.array_equal(getattr(table, name), getattr(table_b, name)), name
    finally:
        store.close()
        store_b.close()


def test_the_planner_declines_where_a_part_would_not_serve_and_keeps_nothing_it_refused(tmp_path):
    """A store whose layer was laid out plans its numpy way (declined: nothing assigned); a pick outside the table is
    refused with the tables unchanged, so ``SlotTable.assign`` names it; a replacement ekv_slots.c does not keep, or
    slots on a device, have no planner."""
    table, memory, store = twin(tmp_path, "fifo", 1)
    planner = FetchPlanner.for_policy(table, memory, store)
    try:
        store.open_sequence(1)
        store.place(1, 1, [np.arange(4)])
        groups, valid = np.array([[1, 2, 3]]), np.ones((1, 3), dtype=bool)
        assert planner.plan(1, groups, valid) is None and table.lookups.tolist() == [0]
        before = table.slot_of.copy()
        assert planner.plan(0, np.array([[1, 2, 999]]), valid) is None
        assert np.array_equal(table.slot_of, before) and table.lookups.tolist() == [0]
        with pytest.raises(IndexError):
            table.assign(0, np.array([[1, 2, 999]]), valid)
        assert planner.plan(0, groups, valid) is not None and table.lookups.tolist() == [3]
    finally:
        store.close()
    assert FetchPlanner.for_policy(table, object(), store) is None


def test_a_decode_with_the_planner_makes_the_tokens_of_one_without(model_dirs, kv_dir, monkeypatch):
    """The fixture model decoding with reuse and corrections: the same tokens and reads whether the policy plans its
    layers' reads in one native call or call by call, and the planner served every layer it was asked for."""
    from edgekv.runtime import Engine
    from edgekv.runtime import fetch_plan

    config = {"G": 4, "M": 4, "C": 8, "max_context": 160, "max_batch": 2, "reuse": True, "correction": "corrected"}
    prompts = [list(range(1, 50)), list(range(20, 41))]
    served, plan = [], FetchPlanner.plan
    monkeypatch.setattr(FetchPlanner, "plan", lambda self, *a: served.append(plan(self, *a)) or served[-1])
    runs = []
    for planned in (True, False):
        if not planned:
            monkeypatch.setattr(fetch_plan.FetchPlanner, "for_policy", classmethod(lambda cls, *a: None))
        with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_dir, config=config, device="cpu") as engine:
            results = engine.generate(prompts, max_new_tokens=8, stop_token_ids=[])
        runs.append([(r.token_ids, *(r.stats[key] for key in ("kv_bytes_read", "reuse_hits", "kv_read_requests",
                                                                 "kv_records_read", "kv_records_verified")))
                     for r in results])
    assert runs[0] == runs[1]
    assert served and all(s is not None for s in served) and any(s[2] is not None for s in served)


@pytest.mark.parametrize("extra", [{}, {"correction_recall": 0.85, "guess_from_before": True}])
def test_picks_taken_on_an_io_thread_decode_what_the_compute_thread_taking_them_decodes(model_dirs, kv_dir, extra):
    """The fixture model decoding with reuse and corrections, its picks taken on an I/O thread once made (on a CPU,
    picks still being made at prefetch: here every layer's, as if the helper were slow) or on the compute thread
    after the layer before attended: the same tokens, reads and hits, and every layer's picks seen in layer order
    (``groups_selected``)."""
    from edgekv.runtime import Engine
    from edgekv.runtime.offload import HostPicks, OffloadedKV, ScoredPicks

    config = {"G": 4, "M": 4, "C": 8, "max_context": 160, "max_batch": 2, "reuse": True, "correction": "corrected",
              **extra}
    prompts = [list(range(1, 50)), list(range(20, 41))]
    runs, taken = [], []
    take = OffloadedKV._take_on_io
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OffloadedKV, "_take_on_io", lambda self, layer, *a: taken.append(layer) or take(self, layer, *a))
        for on_io in (True, False):
            with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_dir, config=config,
                                        device="cpu") as engine:
                events = []
                engine.events.subscribe(lambda e: events.append((e.info["layer"], e.info["groups"].copy(),
                                                                 e.info["valid"].copy()))
                                        if e.kind == "groups_selected" else None)
                before = len(taken)
                patch.setattr(OffloadedKV, "_io_takes", OffloadedKV._io_takes if on_io else lambda self, active: False)
                for picks in (HostPicks, ScoredPicks):
                    patch.setattr(picks, "ready", lambda self: not on_io)
                results = engine.generate(prompts, max_new_tokens=8, stop_token_ids=[])
            runs.append(([(r.token_ids, *(r.stats[key] for key in ("kv_bytes_read", "reuse_hits", "kv_read_requests",
                                                                    "kv_records_read", "kv_correction_records")))
                          for r in results], events))
            assert len(taken) - before == (len(events) if on_io else 0)  # every layer's picks, or none
    (io_results, io_events), (compute_results, compute_events) = runs
    assert io_results == compute_results
    n_layers = len({layer for layer, *_ in io_events})
    assert [layer for layer, *_ in io_events] == [layer for layer, *_ in compute_events]
    assert [layer for layer, *_ in io_events][:n_layers] == list(range(n_layers))
    assert all(np.array_equal(a, c) for (_, *io), (_, *cp) in zip(io_events, compute_events) for a, c in zip(io, cp))


def test_picks_events_come_in_layer_order_when_some_layers_picks_are_taken_on_an_io_thread(model_dirs, kv_dir,
                                                                                           monkeypatch):
    """Every other launch's picks made already (taken by the compute thread at once), the rest still being made
    (taken on an I/O thread): each step's ``groups_selected`` events still come layer by layer."""
    from edgekv.runtime import Engine
    from edgekv.runtime.offload import HostPicks, ScoredPicks

    calls = []
    for picks in (HostPicks, ScoredPicks):
        monkeypatch.setattr(picks, "ready", lambda self: calls.append(0) or len(calls) % 2 == 0)
    config = {"G": 4, "M": 4, "C": 8, "max_context": 160, "max_batch": 2, "reuse": True}
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_dir, config=config, device="cpu") as engine:
        layers = []
        engine.events.subscribe(lambda e: layers.append(e.info["layer"]) if e.kind == "groups_selected" else None)
        engine.generate([list(range(1, 50)), list(range(20, 41))], max_new_tokens=6, stop_token_ids=[])
    n_layers = engine.model.dims.n_layers
    assert layers == list(range(n_layers)) * 5
