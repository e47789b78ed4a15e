"""A layer's picks to its reads in one native call (runtime/fetch_plan.py NativePlanner, runtime/native/ekv_fetch.c)
against the calls it stands in for (``CallsPlanner``: ``SlotTable.assign``, the slot memory's addresses,
``DiskKVStore.batch``): twin tables, slot memories and stores fed the same picks step after step give the same slots,
misses, batches, tables and counters."""
import dataclasses

import numpy as np
import pytest
import torch

from edgekv.runtime.fetch_plan import CallsPlanner, FetchJob, NativePlanner, planner_for
from edgekv.runtime.kernels import Backend, resolve_backend
from edgekv.runtime.slot_memory import HostSlots
from edgekv.runtime.slots import SlotTable, record_owners
from tests.test_native_requests import assert_same, store_of

NATIVE = resolve_backend("cpu")
pytestmark = pytest.mark.skipif(NATIVE.lib("fetch") is None, reason="no C compiler for the native fetch planning")

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
@pytest.mark.parametrize("trial", range(6))
def test_the_planner_gives_what_the_calls_one_by_one_give(tmp_path, replacement, trial):
    """Batches of 1 to 3, one and two KV paths, gaps bridged or not, every record checked or none, picks that
    overlap the step before's (hits, misses and evictions) with rows shorter than M; in trials 4 and 5 the rows after
    the first borrow its first groups (one pool, a record two rows pick read once)."""
    rng = np.random.default_rng(trial)
    batch, picks = 1 + trial % 3, 7
    shared = np.array([0] + [12] * (batch - 1)) if trial >= 4 else np.zeros(batch, dtype=np.int64)
    options = {"n_paths": 1 + trial % 2, "verify_fraction": float(trial != 3), "gap_bytes": 512 * (trial % 3)}
    (table, memory, store), (table_b, memory_b, store_b) = (
        twin(tmp_path / name, replacement, batch, **options) for name in ("planned", "by calls"))
    if shared.any():
        for t in (table, table_b):
            t.share(list(range(batch)))
    read, read_b = np.zeros(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
    planner = planner_for(NATIVE, table, memory, store, read)
    assert isinstance(planner, NativePlanner)
    try:
        for _ in range(10):
            layer = int(rng.integers(LAYERS))
            groups = np.stack([rng.choice(GROUPS, picks, replace=False) for _ in range(batch)])
            valid = rng.random((batch, picks)) < 0.85
            owners = record_owners(groups, np.zeros(batch, dtype=np.int64), shared) if shared.any() else None
            slots, misses, reads = planner.plan(layer, groups, valid, owners)
            slots_b, misses_b = table_b.assign(layer, groups, valid, owners)
            assert np.array_equal(slots[valid], slots_b[valid])
            assert all(np.array_equal(a, b) for a, b in zip(misses, misses_b))
            addresses = memory_b.read_addresses(layer, layer, misses_b) - memory_b.slot_base(layer) + \
                memory.slot_base(layer)
            reference = store_b.batch(layer, misses_b.seq, misses_b.group, addresses)
            read_b += np.bincount(misses_b.seq, minlength=batch) * store_b.layout.stride_bytes
            sink, sink_b = store._gap_sink().ctypes.data, store_b._gap_sink().ctypes.data
            fds = dict(zip(store_b._fds.ravel().tolist(), store._fds.ravel().tolist()))  # the twin's files
            assert_same(reads, dataclasses.replace(
                reference, addresses=np.where(reference.addresses == sink_b, sink, reference.addresses),
                fds=np.array([fds[fd] for fd in reference.fds.tolist()], dtype=np.int32)))
            assert counters(table, store) == counters(table_b, store_b)
            assert read.tolist() == read_b.tolist()
        for name in ("group", "owner", "inserted", "used", "slot_of"):
            assert np.array_equal(getattr(table, name), getattr(table_b, name)), name
    finally:
        store.close()
        store_b.close()


def test_the_job_layout_is_the_headers():
    """FetchJob's fields sit where runtime/native/ekv_fetch.h's struct has them (the library checks it on loading:
    here against a field moved in Python)."""
    lib = NATIVE.lib("fetch")
    offsets = np.zeros(lib.ekv_fetch_job_fields(), dtype=np.int64)
    lib.ekv_fetch_job_offsets(offsets.ctypes.data)
    assert offsets.tolist() == [getattr(FetchJob, name).offset for name, _ in FetchJob._fields_]
    assert len(FetchJob._fields_) == lib.ekv_fetch_job_fields()


def test_the_planner_plans_a_laid_out_layer_call_by_call_and_lets_the_table_name_a_refused_pick(tmp_path):
    """A store whose layer was laid out plans that layer's reads its own way (the calls one by one, counted as ever);
    a pick outside the table is refused by the native call with the tables unchanged, and ``SlotTable.assign`` names
    it; a replacement ekv_slots.c does not keep, or slots on a device, get the calls one by one."""
    table, memory, store = twin(tmp_path, "fifo", 1)
    planner = planner_for(NATIVE, table, memory, store, np.zeros(1, dtype=np.int64))
    try:
        store.open_sequence(1)
        store.place(1, 1, [np.arange(4)])
        groups, valid = np.array([[1, 2, 3]]), np.ones((1, 3), dtype=bool)
        assert not planner._jobs
        plan = planner.plan(1, groups, valid, None)
        assert planner._jobs[(1, 1, 3)][2] is None and table.lookups.tolist() == [3] and len(plan.misses.seq) == 3
        before = table.slot_of.copy()
        with pytest.raises(IndexError):
            planner.plan(0, np.array([[1, 2, 999]]), valid, None)
        assert np.array_equal(table.slot_of, before) and table.lookups.tolist() == [3]
        assert planner.plan(0, groups, valid, None).reads is not None and table.lookups.tolist() == [6]
        assert planner._jobs[(0, 1, 3)][2] is not None
    finally:
        store.close()
    assert type(planner_for(NATIVE, table, object(), store, np.zeros(1, dtype=np.int64))) is CallsPlanner
    reference = Backend("torch", torch.device("cpu"))
    assert type(planner_for(reference, table, memory, store, np.zeros(1, dtype=np.int64))) is CallsPlanner


def test_a_decode_with_the_planner_makes_the_tokens_of_one_without(model_dirs, kv_path, monkeypatch):
    """The fixture model decoding with reuse and corrections: the same tokens and reads whether the policy plans its
    layers' reads in one native call or call by call, and the native call served every layer's picks."""
    from edgekv.runtime import Engine
    from edgekv.runtime.offload import pipeline

    config = {"G": 4, "M": 4, "C": 8, "max_context": 160, "max_batch": 2, "reuse": True, "correction": "corrected"}
    prompts = [list(range(1, 50)), list(range(20, 41))]
    planners, plan = [], pipeline.planner_for
    runs = []
    for native in (True, False):
        monkeypatch.setattr(pipeline, "planner_for", lambda backend, *a: planners.append(
            plan(backend, *a) if native else CallsPlanner(*a)) or planners[-1])
        with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu") as engine:
            results = engine.generate(prompts, max_new_tokens=8, stop_token_ids=[])
        runs.append([(r.token_ids, *(r.stats[key] for key in ("kv_bytes_read", "reuse_hits", "kv_read_requests",
                                                                 "kv_records_read", "kv_records_verified")))
                     for r in results])
    assert runs[0] == runs[1]
    assert [type(p) for p in planners] == [NativePlanner, CallsPlanner]
    assert planners[0]._jobs and all(job is not None for *_, job in planners[0]._jobs.values())


@pytest.mark.parametrize("extra", [{}, {"correction_recall": 0.85, "guess_from_before": True}])
def test_picks_taken_on_an_io_thread_decode_what_the_compute_thread_taking_them_decodes(model_dirs, kv_path, extra):
    """The fixture model decoding with reuse and corrections, its picks taken on an I/O thread once made (on a CPU,
    picks still being made at prefetch: here every layer's, as if the helper were slow) or on the compute thread
    after the layer before attended: the same tokens, reads and hits, and every layer's picks seen in layer order
    (``groups_selected``)."""
    from edgekv.runtime import Engine
    from edgekv.runtime.offload import OffloadedKV
    from edgekv.runtime.offload.fetch import HostPicks, ScoredPicks

    config = {"G": 4, "M": 4, "C": 8, "max_context": 160, "max_batch": 2, "reuse": True, "correction": "corrected",
              **extra}
    prompts = [list(range(1, 50)), list(range(20, 41))]
    runs, taken = [], []
    take, init = OffloadedKV._take_and_read, OffloadedKV.__init__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OffloadedKV, "_take_and_read", lambda self, fetch, *a: taken.append(fetch.layer) or
                      take(self, fetch, *a))
        for on_io in (True, False):
            with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config,
                                        device="cpu") as engine:
                events = []
                engine.events.subscribe(lambda e: events.append((e.info["layer"], e.info["groups"].copy(),
                                                                 e.info["valid"].copy()))
                                        if e.kind == "groups_selected" else None)
                before = len(taken)
                patch.setattr(OffloadedKV, "__init__", lambda self, *a, **k: init(self, *a, **k) or
                              setattr(self, "takes_on_io", self.takes_on_io and on_io))
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


def test_picks_events_come_in_layer_order_when_some_layers_picks_are_taken_on_an_io_thread(model_dirs, kv_path,
                                                                                           monkeypatch):
    """Every other launch's picks made already (taken by the compute thread at once), the rest still being made
    (taken on an I/O thread): each step's ``groups_selected`` events still come layer by layer."""
    from edgekv.runtime import Engine
    from edgekv.runtime.offload.fetch import HostPicks, ScoredPicks

    calls = []
    for picks in (HostPicks, ScoredPicks):
        monkeypatch.setattr(picks, "ready", lambda self: calls.append(0) or len(calls) % 2 == 0)
    config = {"G": 4, "M": 4, "C": 8, "max_context": 160, "max_batch": 2, "reuse": True}
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu") as engine:
        layers = []
        engine.events.subscribe(lambda e: layers.append(e.info["layer"]) if e.kind == "groups_selected" else None)
        engine.generate([list(range(1, 50)), list(range(20, 41))], max_new_tokens=6, stop_token_ids=[])
    n_layers = engine.model.dims.n_layers
    assert layers == list(range(n_layers)) * 5
