"""Several KV paths: placement invariants, routing to the least-loaded copy, coalescing, prefix sharing, and
exactness of the disk policies over 1, 2 and 3 paths."""
import os

import numpy as np
import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.checksum import record_sums
from edgekv.runtime.disk_store import DiskKVStore, RecordLayout, StoreError, aligned_zeros
from edgekv.runtime.placement import Placement
from edgekv.runtime.reader import open_reader
from tests.conftest import files_under
from tests.test_exactness import EXACT, PROMPTS


def layout():
    return RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, align_bytes=4096)


def records(n, first=0):
    """n aligned records, record i filled with the byte value (first + i) % 251 + 1."""
    out = aligned_zeros((n, layout().stride_bytes), 4096)
    out[:] = ((np.arange(first, first + n) % 251) + 1)[:, None].astype(np.uint8)
    return out


def paths(tmp_path, n):
    out = [tmp_path / f"disk{i}" for i in range(n)]
    for p in out:
        p.mkdir()
    return out


def read(store, layer, seqs, groups):
    """Read records of (seqs[i], groups[i]) through the store; returns them [n, stride]."""
    dest = aligned_zeros((len(groups), store.layout.stride_bytes), 4096)
    addresses = dest.ctypes.data + np.arange(len(groups), dtype=np.int64) * store.layout.stride_bytes
    batch = store.batch(layer, np.asarray(seqs), np.asarray(groups), addresses)
    store.read(batch)
    return dest, batch


def test_striping_without_a_table_equals_explicit_striping():
    implicit = Placement(n_layers=1, max_groups=40, n_paths=3)
    explicit = Placement(n_layers=1, max_groups=40, n_paths=3)
    explicit.assign(0, [np.array([], dtype=np.int64)] * 3)  # a table, empty: new groups are striped into it
    explicit.stripe(0, np.arange(40))
    for got, want in zip(implicit.copies(0, np.arange(40)), explicit.copies(0, np.arange(40))):
        np.testing.assert_array_equal(got, want)
    path, index = implicit.copies(0, np.arange(40))
    assert (path[:, 0] == np.arange(40) % 3).all() and (index[:, 0] == np.arange(40) // 3).all()
    assert (path[:, 1] == -1).all()


def test_a_layout_places_every_group_once_per_path_and_never_moves_a_record():
    placement = Placement(n_layers=2, max_groups=10, n_paths=2)
    placement.assign(0, [np.array([3, 1, 0]), np.array([2, 1, 4])])  # group 1 on both paths
    placement.stripe(0, np.arange(5, 8))
    path, index = placement.copies(0, np.arange(8))
    assert path[1].tolist() == [0, 1] and index[1].tolist() == [1, 1]
    assert path[3].tolist() == [0, -1] and index[3, 0] == 0
    assert path[6, 0] == 0 and index[6, 0] == 3 and path[5, 0] == 1 and index[5, 0] == 3
    with pytest.raises(ValueError, match="never move"):
        placement.assign(0, [np.array([8]), np.array([9])])
    with pytest.raises(ValueError, match="listed twice"):
        placement.assign(1, [np.array([2, 2]), np.array([])])


@pytest.mark.parametrize("n_paths", [1, 2, 3])
def test_records_read_back_from_every_path_with_coalesced_requests(tmp_path, n_paths):
    reader = open_reader("python", n_paths=n_paths)
    store = DiskKVStore(paths(tmp_path, n_paths), 2, layout(), reader, max_groups=64, max_request_bytes=3 * 4096)
    try:
        store.open_sequence(0)
        store.open_sequence(1)
        for seq in (0, 1):
            for layer in (0, 1):
                store.write_groups(seq, layer, 0, records(30, first=100 * seq + 10 * layer))
        seqs = np.array([0] * 9 + [1] * 3)
        groups = np.array([5, 0, 1, 2, 3, 4, 6, 20, 29, 7, 8, 9])
        got, batch = read(store, 1, seqs, groups)
        expected = (100 * seqs + 10 + groups) % 251 + 1
        assert (got == expected[:, None]).all()
        assert batch.counts.sum() == len(groups) and batch.counts.max() <= 3
        assert set(batch.paths.tolist()) == set(range(n_paths))
        for d in store.dirs:  # each path holds its share of each layer's records
            assert sorted(f.name for f in d.iterdir()) == sorted(f"seq{s}_layer{l}.kv" for s in (0, 1) for l in (0, 1))
        sizes = [os.path.getsize(d / "seq0_layer0.kv") for d in store.dirs]
        assert sum(sizes) == 30 * store.layout.stride_bytes
    finally:
        store.close()
        reader.close()
    assert files_under(tmp_path / "disk0") == []


def test_coalescing_stops_at_gaps_files_and_the_request_size():
    from edgekv.runtime.disk_store import request_starts

    stride = 4096
    fds = np.array([3, 3, 3, 3, 3, 4, 4], dtype=np.int32)
    offsets = np.array([0, 1, 2, 4, 5, 6, 7]) * stride
    assert request_starts(fds, offsets, stride, max_records=8).tolist() == [0, 3, 5]
    assert request_starts(fds, offsets, stride, max_records=2).tolist() == [0, 2, 3, 5]
    assert request_starts(fds, offsets, stride, max_records=1).tolist() == list(range(7))
    # with gaps bridged: through the one-record gap, never across files, and no request spans over max_records
    assert request_starts(fds, offsets, stride, max_records=8, gap_records=1).tolist() == [0, 5]
    assert request_starts(fds, offsets, stride, max_records=4, gap_records=1).tolist() == [0, 3, 5]
    assert request_starts(fds, offsets, stride, max_records=8, gap_records=0).tolist() == [0, 3, 5]
    twice = np.array([0, 0, 2, 9]) * stride  # the same record twice (two readers of a shared group) is two requests
    assert request_starts(np.zeros(4, np.int32), twice, stride, max_records=16, gap_records=6).tolist() == [0, 1]


@pytest.mark.parametrize("n_paths,backend", [(1, "python"), (2, "python"), (1, "pthread"), (2, "io_uring")])
def test_gaps_bridged_read_every_wanted_record_right_in_fewer_requests(tmp_path, n_paths, backend):
    """Every gap record of every request lands in one sink record (the same memory many times in one readv, with
    O_DIRECT where the filesystem takes it)."""
    from tests.test_reader_paths import reader_or_skip

    reader = reader_or_skip(backend, n_paths=n_paths)
    store = DiskKVStore(paths(tmp_path, n_paths), 1, layout(), reader, max_groups=64, max_request_bytes=6 * 4096,
                        gap_bytes=2 * 4096 + 100)
    try:
        for seq in (0, 1):
            store.open_sequence(seq)
            store.write_groups(seq, 0, 0, records(40, first=100 * seq))
        seqs = np.array([0] * 7 + [1] * 3)
        groups = np.array([9, 0, 3, 5, 6, 20, 24, 1, 2, 39])
        got, batch = read(store, 0, seqs, groups)
        assert (got == ((100 * seqs + groups) % 251 + 1)[:, None]).all(), "each wanted record at its own address"
        assert store.records_read == 10 and store.records_by_path.sum() == 10, "gap records are not records read"
        assert store.gap_records_read == int(batch.gap_counts.sum()) > 0
        assert (batch.counts - batch.gap_counts).sum() == 10
        assert batch.counts.max() <= 6 and len(batch) < len(groups)
        assert batch.check.sum() == 10 and (batch.seqs[~batch.check] == -1).all(), "gap records are never checked"
        assert (batch.counts - batch.gap_counts).min() >= 1 and batch.gap_counts.max() >= 2, "a request bridges two"
    finally:
        store.close()
        reader.close()


def test_replicated_records_go_to_the_least_loaded_path(tmp_path):
    reader = open_reader("python", n_paths=2)
    store = DiskKVStore(paths(tmp_path, 2), 1, layout(), reader, max_groups=16, max_request_bytes=8 * 4096)
    try:
        store.open_sequence(0)
        # path 0: groups 0..3 and 4, 5; path 1: copies of 4 and 5, then 6
        store.place(0, 0, [np.array([0, 1, 2, 3, 4, 5]), np.array([4, 5, 6])])
        store.write_groups(0, 0, 0, records(7))
        got, batch = read(store, 0, np.zeros(4, dtype=np.int64), np.array([0, 1, 4, 5]))
        assert (got[:, 0] == np.array([0, 1, 4, 5]) + 1).all()
        # 0 and 1 load path 0 with two records: the replicated 4 and 5 are read from path 1, as one request
        assert sorted(zip(batch.paths.tolist(), batch.counts.tolist())) == [(0, 2), (1, 2)]
        np.testing.assert_array_equal(store.records_by_path, [2, 2])
    finally:
        store.close()
        reader.close()


def test_a_borrower_writes_none_of_the_shared_groups_and_its_owner_stays_until_it_is_released(tmp_path):
    reader = open_reader("python")
    store = DiskKVStore(tmp_path, 1, layout(), reader, max_groups=16)
    try:
        store.open_sequence(0)
        store.open_sequence(1)
        store.write_groups(0, 0, 0, records(6))
        store.share_prefix(1, 0, 4)
        store.write_groups(1, 0, 0, records(6, first=50))
        assert os.path.getsize(store._path(1, 0)) == 6 * store.layout.stride_bytes  # groups 4, 5 only
        got, _ = read(store, 0, np.array([0, 1, 1]), np.array([2, 4, 5]))  # (owner 0, 2); the borrower's own groups
        assert got[:, 0].tolist() == [3, 55, 56]
        store.release(0)
        assert store._path(0, 0).exists(), "the owner's files stay while a borrower reads them"
        with pytest.raises(StoreError, match="lends"):
            store.open_sequence(0)
        store.release(1)
        assert not store._path(0, 0).exists() and not store._path(1, 0).exists()
    finally:
        store.close()
        reader.close()


def test_a_missing_or_repeated_kv_path_is_named(tmp_path):
    reader = open_reader("python")
    with pytest.raises(StoreError, match="disk9"):
        DiskKVStore([tmp_path, tmp_path / "disk9"], 1, layout(), reader)
    with pytest.raises(StoreError, match="twice"):
        DiskKVStore([tmp_path, tmp_path], 1, layout(), reader)
    store = DiskKVStore(str(tmp_path), 1, layout(), reader)  # a str path is a path
    store.close()
    reader.close()


def run(model_dir, kv, policy, config):
    with Engine.from_pretrained(model_dir, kv_path=kv, config=config, policy=policy, device="cpu") as engine:
        results = engine.generate(PROMPTS, max_new_tokens=14, stop_token_ids=[], output_logits=True)
    for path in kv if isinstance(kv, list) else [kv]:
        assert files_under(path) == [], "released sequences must leave no KV files"
    return results


@pytest.fixture(scope="module")
def full_reference(model_dirs, tmp_path_factory):
    return run(model_dirs["llama"], tmp_path_factory.mktemp("kv"), "full", EXACT)


@pytest.mark.parametrize("n_paths,policy,extra", [
    (1, "kvswap", {}), (3, "kvswap", {}), (1, "kvswap", {"clustering": True}),
    (2, "kvswap", {"clustering": True, "replacement": "cost"}), (3, "kvswap", {"clustering": True, "replica_share": 0.5}),
    (2, "kvswap", {"replacement": "lru"}), (3, "flexgen", {}), (2, "token", {"clustering": True}),
    (1, "kvswap", {"io_gap_bytes": 3 * 4096}), (2, "token", {"io_gap_bytes": 2 * 4096}),
])
def test_disk_policies_over_several_paths_match_full(model_dirs, tmp_path, full_reference, n_paths, policy, extra):
    config = {**EXACT, "max_request_bytes": 4 * 4096, "cluster_queries": 8, "recluster_steps": 5, **extra}
    results = run(model_dirs["llama"], paths(tmp_path, n_paths), policy, config)
    for ref, got in zip(full_reference, results):
        assert got.token_ids == ref.token_ids
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        assert got.stats["kv_bytes_read"] > 0
    stats = results[0].stats
    assert stats["n_paths"] == n_paths and len(stats["kv_records_by_path"]) == n_paths
    assert min(stats["kv_records_by_path"]) > 0, "every path serves reads"
    assert stats["kv_read_requests"] < stats["kv_records_read"], "adjacent records are read as one request"
    assert sum(stats["kv_records_by_path"]) == stats["kv_records_read"]


@pytest.mark.parametrize("policy", ["kvswap", "token"])
def test_reading_through_gaps_changes_no_token_and_takes_fewer_requests(model_dirs, tmp_path, policy):
    """A subset picked (M of 64 groups): the picks leave gaps, and bridging them reads the same records."""
    config = {**EXACT, "M": 10, "C": 10, "reuse": False}
    (tmp_path / "plain").mkdir(), (tmp_path / "bridged").mkdir()
    plain = run(model_dirs["llama"], paths(tmp_path / "plain", 1), policy, config)
    bridged = run(model_dirs["llama"], paths(tmp_path / "bridged", 1), policy, {**config, "io_gap_bytes": 3 * 4096})
    for a, b in zip(plain, bridged):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    a, b = plain[0].stats, bridged[0].stats
    assert b["kv_records_read"] == a["kv_records_read"] and a["kv_gap_records_read"] == 0 < b["kv_gap_records_read"]
    assert b["kv_read_requests"] < a["kv_read_requests"]


def test_sequences_sharing_a_document_read_it_once_and_decode_the_same_tokens(model_dirs, tmp_path):
    document = [(7 * i) % 150 + 3 for i in range(160)]
    prompts = [document + [11 + q, 12 + q, 13] for q in range(4)]
    config = {"G": 4, "M": 12, "C": 24, "max_context": 256, "max_batch": 4, "sigma": 4}

    def generate(share):
        with Engine.from_pretrained(model_dirs["llama"], kv_path=tmp_path, policy="kvswap",
                                    config={**config, "share_prefix": share}, device="cpu") as engine:
            return engine.generate(prompts, max_new_tokens=12, stop_token_ids=[])

    shared, alone = generate(True), generate(False)
    assert [r.token_ids for r in shared] == [r.token_ids for r in alone]
    read_shared = sum(r.stats["kv_bytes_read"] for r in shared)
    read_alone = sum(r.stats["kv_bytes_read"] for r in alone)
    assert read_shared * 2 < read_alone


@pytest.mark.parametrize("n_paths", [1, 2])
def test_relocated_groups_read_back_exactly_as_one_request_per_path(tmp_path, n_paths):
    reader = open_reader("python", n_paths=n_paths)
    store = DiskKVStore(paths(tmp_path, n_paths), 1, layout(), reader, max_groups=64, max_request_bytes=16 * 4096)
    try:
        store.open_sequence(0)
        store.write_groups(0, 0, 0, records(40))
        scattered = np.array([31, 3, 17, 9, 25, 12])
        _, before = read(store, 0, np.zeros(6, dtype=np.int64), scattered)
        assert len(before) == 6
        store.relocate(0, 0, [scattered[p::n_paths] for p in range(n_paths)])
        store.write_groups(0, 0, 40, records(2, first=40))  # groups written after a relocation are striped after it
        got, after = read(store, 0, np.zeros(8, dtype=np.int64), np.r_[scattered, 40, 41])
        assert (got[:, 0] == np.r_[scattered, 40, 41] + 1).all()
        assert len(after) == n_paths  # the moved six: one request per path, the new 40 and 41 right after them
        assert store.records_relocated == 6
    finally:
        store.close()
        reader.close()


def test_a_kv_path_that_fails_under_running_sequences_is_named_not_read_as_zeros(tmp_path):
    reader = open_reader("python", n_paths=2)
    store = DiskKVStore(paths(tmp_path, 2), 1, layout(), reader, max_groups=16)
    try:
        store.open_sequence(0)
        store.write_groups(0, 0, 0, records(8))
        fd = int(store._fds[0, 0, 1])
        os.close(fd)  # the second device goes away under the open sequence
        with pytest.raises(StoreError, match="disk1") as caught:
            read(store, 0, np.zeros(4, dtype=np.int64), np.array([0, 1, 2, 3]))
        assert isinstance(caught.value.__cause__, OSError)
        store._fds[0, 0, 1] = os.open(os.devnull, os.O_RDONLY)  # something for release to close
    finally:
        store.close()
        reader.close()


def test_relocated_groups_of_a_stored_context_are_read_from_the_kv_paths_the_rest_from_the_store(tmp_path):
    reader = open_reader("python", n_paths=2)
    store = DiskKVStore(paths(tmp_path, 2), 1, layout(), reader, max_groups=32, max_request_bytes=8 * 4096)
    blob = tmp_path / "blob.kv"
    blob.write_bytes(records(12, first=200).tobytes())  # one stored chunk of 12 groups, one layer
    try:
        store.open_sequence(0)
        sums = record_sums(records(12, first=200), layout().record_bytes, 0, np.arange(12))[None]
        store.attach_prefix(0, [(blob, 12, sums)])
        store.write_groups(0, 0, 0, records(14, first=200))  # the stored 12 are skipped: only 12, 13 are written
        store.relocate(0, 0, [np.array([9, 2]), np.array([5])])
        got, batch = read(store, 0, np.zeros(5, dtype=np.int64), np.array([2, 5, 9, 3, 13]))
        assert (got[:, 0] == np.array([2, 5, 9, 3, 13]) + 201).all()
        blob_fd = int(store._prefix[0][0][0])
        from_blob = np.repeat(batch.fds, batch.counts) == blob_fd
        assert from_blob.sum() == 1, "only group 3 is still read from the stored blob"
    finally:
        store.close()
        reader.close()


def test_a_stored_context_over_two_paths_is_laid_out_from_its_decode_picks_and_decodes_the_same(tmp_path, monkeypatch):
    from edgekv.runtime.ttft.prefill import TTFTOptions

    moved = []
    relocate = DiskKVStore.relocate
    monkeypatch.setattr(DiskKVStore, "relocate", lambda self, seq, layer, per_path, in_memory=None: (
        moved.append(np.concatenate(per_path)), relocate(self, seq, layer, per_path, in_memory))[1])
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    config = {"max_context": 1024, "M": 24, "C": 48, "clustering": True, "recluster_steps": 3}
    with Engine.from_pretrained("fixture", policy="kvswap", kv_path=tmp_path, config=config,
                                device="cpu") as plain:
        expected = plain.generate([ids], max_new_tokens=10, stop_token_ids=[])[0].token_ids
    kv = paths(tmp_path, 2)
    with Engine.from_pretrained("fixture", policy="kvswap", kv_path=kv, config=config, device="cpu") as engine:
        engine.open_context_store(tmp_path / "store", chunk_tokens=128)
        engine.ttft = TTFTOptions("load_only")
        engine.save_context(ids[:256])
        out = engine.generate([ids], max_new_tokens=10, stop_token_ids=[])[0]
    assert engine.prefill_stats[0]["stored_tokens"] == 256
    assert out.token_ids == expected
    stored_groups = 256 // 4
    assert any((groups < stored_groups).any() for groups in moved), "the stored context's picked groups moved"
    for path in kv:
        assert files_under(path) == []


def test_m_and_c_beyond_the_context_allocate_nothing_more(model_dirs, tmp_path):
    huge = {**EXACT, "M": 100_000, "C": 200_000}
    with Engine.from_pretrained(model_dirs["llama"], kv_path=tmp_path, config=huge, policy="kvswap",
                                device="cpu") as big, \
            Engine.from_pretrained(model_dirs["llama"], kv_path=tmp_path, config=EXACT, policy="kvswap",
                                   device="cpu") as fit:
        assert big.config.M == 64 and big.config.C == 64  # 256 tokens are 64 groups of 4
        assert big.memory_plan.per_sequence_bytes == fit.memory_plan.per_sequence_bytes
        tokens = [e.generate(PROMPTS, max_new_tokens=3, stop_token_ids=[])[0].token_ids for e in (big, fit)]
        assert tokens[0] == tokens[1]


def test_the_kv_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    folders = {name: tmp_path / name for name in (f"edgekv-{dead_pid}-0badc0de", "edgekv-1-0000cafe",
                                                  f"edgekv-{os.getpid()}-00000001", "edgekv-kv-scratch")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "seq0_layer0.kv").write_bytes(b"x" * 16)
    reader = open_reader("python")
    store = DiskKVStore(tmp_path, 1, layout(), reader)
    store.close()
    reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n in folders if not n.startswith(f"edgekv-{dead_pid}-"))


def test_a_symlink_named_like_a_dead_kv_folder_is_neither_followed_nor_counted(tmp_path):
    import subprocess
    import sys

    from edgekv.runtime.disk_store import remove_dead_sequences

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True).stdout)
    (tmp_path / "kv").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (tmp_path / "kv" / f"edgekv-{dead_pid}-0badc0de").symlink_to(elsewhere, target_is_directory=True)
    assert remove_dead_sequences(tmp_path / "kv") == []
    assert (elsewhere / "keep.txt").read_text() == "mine"


def test_an_interrupted_atomic_write_leaves_the_old_file_and_no_debris(tmp_path, monkeypatch):
    from edgekv.runtime.store import files

    target = tmp_path / "config.json"
    files.write_json_atomic(target, {"G": 4})

    def power_cut(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(files.os, "fsync", power_cut)
    with pytest.raises(OSError, match="I/O error"):
        files.write_json_atomic(target, {"G": 8})
    assert target.read_text() == '{\n "G": 4\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
