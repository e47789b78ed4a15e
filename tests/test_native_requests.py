"""The disk store's request planning in one native call (runtime/native/ekv_requests.c) against the numpy path it
stands in for: the same batch, array for array, over random reads (several sequences, repeated groups, one and two
KV paths, gaps bridged or not, requests cut at their size cap, every record checked or none), and the stores it
leaves to numpy (a stored context, a laid-out layer, a share of the records checked, a released sequence)."""
import dataclasses

import numpy as np
import pytest
import torch

from edgekv.runtime.disk_store import DiskKVStore, RecordLayout
from edgekv.runtime.kernels import resolve_backend
from edgekv.runtime.reader import open_reader

pytestmark = pytest.mark.skipif(resolve_backend("cpu").lib("requests") is None,
                                reason="no C compiler for the native request planning")


def store_of(root, n_paths=1, verify_fraction=1.0, gap_bytes=0, max_request_bytes=None, seqs=3):
    roots = [root / f"path{p}" for p in range(n_paths)]
    for r in roots:
        r.mkdir(parents=True)
    layout = RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, align_bytes=512)
    store = DiskKVStore(roots, 2, layout, open_reader("python"), max_groups=256, verify_fraction=verify_fraction,
                        gap_bytes=gap_bytes, max_request_bytes=max_request_bytes)
    for seq in range(seqs):
        store.open_sequence(seq)
        for layer in range(2):
            store.write_groups(seq, layer, 0, layout.pack(torch.randn(1, 4 * 60, 8), torch.randn(1, 4 * 60, 8)))
    return store


def both_plans(store, layer, seqs, groups, addresses):
    """(native batch, numpy batch) of the same reads; the native one asserted to have served."""
    native = store._native_requests(layer, seqs, groups, addresses)
    assert native is not None
    return native, store._requests_numpy(layer, seqs, groups, addresses)


def assert_same(native, reference):
    for field in dataclasses.fields(reference):
        a, b = getattr(native, field.name), getattr(reference, field.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), field.name
        else:
            assert a == b, field.name


@pytest.mark.parametrize("trial", range(12))
def test_native_requests_equal_the_numpy_paths(tmp_path, trial):
    rng = np.random.default_rng(trial)
    n_paths = 1 + trial % 2
    stride = 512
    store = store_of(tmp_path, n_paths=n_paths, verify_fraction=float(trial % 3 != 2),
                     gap_bytes=int(rng.integers(0, 4)) * stride, max_request_bytes=int(rng.integers(1, 6)) * stride)
    try:
        for _ in range(5):
            n = int(rng.integers(1, 120))
            seqs = rng.integers(0, 3, n)
            groups = np.where(rng.random(n) < 0.6, rng.integers(0, 60, n), rng.integers(0, 12, n))  # runs and repeats
            addresses = rng.integers(1, 1 << 40, n)
            layer = int(rng.integers(0, 2))
            native, reference = both_plans(store, layer, seqs, groups, addresses)
            assert_same(native, reference)
    finally:
        store.close()


def test_a_batch_with_gaps_reads_them_into_the_sink_unchecked(tmp_path):
    store = store_of(tmp_path, gap_bytes=2 * 512, max_request_bytes=4 * 512)
    try:
        native, reference = both_plans(store, 1, np.zeros(5, dtype=np.int64), np.array([9, 3, 0, 1, 7]),
                                       np.arange(5) * 4096 + 4096)
        assert_same(native, reference)
        # 0 1 [2] 3 in one request (the cap: 4 records), then 7 [8] 9: a gap of one record each
        assert native.counts.tolist() == [4, 3] and native.gap_counts.tolist() == [1, 1]
        assert native.groups.tolist() == [0, 1, -1, 3, 7, -1, 9] and native.check.tolist() == [1, 1, 0, 1, 1, 0, 1]
        assert native.addresses[2] == native.addresses[5] == store._gap_sink().ctypes.data
    finally:
        store.close()
    wide = store_of(tmp_path / "wide", gap_bytes=3 * 512, max_request_bytes=16 * 512)
    try:  # more records read than twice those wanted: the native call asks for room again
        native, reference = both_plans(wide, 0, np.zeros(3, dtype=np.int64), np.array([0, 4, 8]),
                                       np.arange(3) * 4096 + 4096)
        assert_same(native, reference)
        assert native.counts.tolist() == [9] and native.gap_counts.tolist() == [6]
    finally:
        wide.close()


def test_stores_the_native_planning_does_not_serve_take_the_numpy_path(tmp_path):
    """A share of the records checked (numpy's random draw), a layer laid out by clustering, a stored context, and a
    released sequence's closed files: the native call declines or refuses, and numpy plans the batch or raises."""
    seqs, groups, addresses = np.zeros(3, dtype=np.int64), np.array([1, 2, 5]), np.arange(3) * 4096 + 4096
    partly, laid_out = store_of(tmp_path / "a", verify_fraction=0.5), store_of(tmp_path / "b")
    unchecked = store_of(tmp_path / "c", verify_fraction=0.0)
    try:
        assert partly._native_requests(0, seqs, groups, addresses) is None
        laid_out.open_sequence(3)
        laid_out.place(3, 1, [np.arange(4)])
        assert laid_out._native_requests(1, seqs, groups, addresses) is None
        assert laid_out._native_requests(0, seqs, groups, addresses) is not None
        laid_out._prefix[5] = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), 0)
        assert laid_out._native_requests(0, seqs, groups, addresses) is None
        del laid_out._prefix[5]
        released = np.ones(3, dtype=np.int64)
        for store in (laid_out, unchecked):  # sequence 1's files closed: the native planning refuses
            store.release(1)
            assert store._native_requests(0, released, groups, addresses) is None
            with pytest.raises(KeyError):  # and numpy's error is the one raised: no placement for it
                store.batch(0, released, groups, addresses)
    finally:
        for store in (partly, laid_out, unchecked):
            store.close()
