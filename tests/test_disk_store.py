"""The disk store writes what it reads back, at any group, past 4 GiB, through every reader backend."""
import errno
import os
import time

import numpy as np
import pytest
import torch

from edgekv.runtime.disk_store import DiskKVStore, RecordLayout, StoreError, aligned_zeros
from edgekv.runtime.reader import PythonPoolReader, ReadBatch, open_reader

BACKENDS = ["io_uring", "pthread", "python"]


def reader_or_skip(backend):
    try:
        return open_reader(backend)
    except OSError as exc:
        pytest.skip(f"{backend} reader unavailable here: {exc}")


def read_into(store, dest, layer, groups):
    """Reads of sequence 0's ``groups`` of ``layer`` into the rows of ``dest``."""
    rows = np.arange(len(groups))
    return store.batch(layer, np.zeros(len(groups), dtype=np.int64), np.array(groups), dest.ctypes.data + rows * dest.shape[1])


def test_layout_is_aligned_and_round_trips():
    layout = RecordLayout(group_tokens=4, n_kv_heads=2, head_dim=16, dtype=torch.float32, align_bytes=4096)
    assert layout.record_bytes == 2 * 4 * 2 * 16 * 4
    assert layout.stride_bytes == 4096
    k, v = torch.randn(2, 12, 16), torch.randn(2, 12, 16)
    records = layout.pack(k, v)
    assert records.shape == (3, 4096) and records.ctypes.data % 4096 == 0
    typed = layout.typed(records)
    torch.testing.assert_close(typed[1, 0], k[:, 4:8], rtol=0, atol=0)
    torch.testing.assert_close(typed[2, 1], v[:, 8:12], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_across_4_gib(kv_path, backend):
    reader = reader_or_skip(backend)
    layout = RecordLayout(group_tokens=8, n_kv_heads=2, head_dim=64, dtype=torch.float16)
    store = DiskKVStore(kv_path, n_layers=2, layout=layout, reader=reader)
    try:
        store.open_sequence(0)
        far = (5 << 30) // layout.stride_bytes  # a group index whose offset is past 5 GiB (64-bit offsets)
        written = {}
        for group in (0, 1, 7, far - 1, far, far + 3):
            k, v = torch.randn(2, 8, 64, dtype=torch.float16), torch.randn(2, 8, 64, dtype=torch.float16)
            store.write_groups(0, 1, group, layout.pack(k, v))
            written[group] = (k, v)
        assert written and far * layout.stride_bytes > 4 << 30
        dest = aligned_zeros((len(written), layout.stride_bytes), layout.align_bytes)
        store.read(read_into(store, dest, 1, list(written)))
        typed = layout.typed(dest)
        for i, (k, v) in enumerate(written.values()):
            assert torch.equal(typed[i, 0], k) and torch.equal(typed[i, 1], v)
    finally:
        store.close()
        reader.close()
    assert not any(kv_path.iterdir()), "store.close() must remove its files"


def test_direct_io_is_used_where_the_filesystem_allows(kv_path):
    layout = RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32)
    store = DiskKVStore(kv_path, 1, layout, open_reader("python"))
    store.open_sequence(0)
    try:
        fs_type = filesystem_of(kv_path)
        if fs_type in ("ext4", "xfs", "btrfs", "f2fs"):
            assert store.o_direct is True
        else:  # tmpfs and friends refuse O_DIRECT; the store falls back (with a warning): it must say which
            probe = kv_path / "probe"
            try:
                os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT))
                allowed = True
            except OSError:
                allowed = False
            finally:
                probe.unlink(missing_ok=True)
            assert store.o_direct is allowed
    finally:
        store.close()


def filesystem_of(path) -> str:
    path, best = str(path.resolve()), ("", "")
    for line in open("/proc/mounts"):
        _, mount, fs_type = line.split()[:3]
        if path.startswith(mount) and len(mount) > len(best[0]):
            best = (mount, fs_type)
    return best[1]


def test_release_removes_the_sequence_files(kv_path):
    layout = RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32)
    store = DiskKVStore(kv_path, 3, layout, open_reader("python"))
    store.open_sequence(0)
    store.open_sequence(1)
    assert len(list(store.dir.iterdir())) == 6
    store.release(0)
    assert sorted(p.name for p in store.dir.iterdir()) == [f"seq1_layer{i}.kv" for i in range(3)]
    store.close()
    assert not store.dir.exists()


def test_store_refuses_missing_or_read_only_paths(tmp_path):
    layout = RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(StoreError, match="does not exist"):
        DiskKVStore(tmp_path / "nope", 1, layout, open_reader("python"))
    with pytest.raises(StoreError, match="required"):
        DiskKVStore(None, 1, layout, open_reader("python"))


def test_short_file_read_is_an_error(kv_path):
    reader = open_reader("auto")
    layout = RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32)
    store = DiskKVStore(kv_path, 1, layout, reader)
    store.open_sequence(0)
    dest = aligned_zeros((1, layout.stride_bytes), layout.align_bytes)
    with pytest.raises(OSError):
        store.read(read_into(store, dest, 0, [3]))  # nothing written there
    store.close()
    reader.close()


def test_python_reader_raises_only_after_every_read_of_the_batch_ended(monkeypatch):
    """The caller frees the buffers once read raises: no read of the batch may still write into them."""
    ended = []

    def read_one(fd, offset, address, nbytes):
        if fd < 0:
            raise OSError(errno.EBADF, "injected")
        time.sleep(0.05)
        ended.append(offset)

    monkeypatch.setattr(PythonPoolReader, "_read_one", staticmethod(read_one))
    reader = PythonPoolReader(threads=4)
    n_reads = 4
    batch = ReadBatch(np.array([-1] + [3] * (n_reads - 1), dtype=np.int32), np.arange(n_reads, dtype=np.int64),
                      np.zeros(n_reads, dtype=np.int64), 4096)
    with pytest.raises(OSError, match="injected"):
        reader.read(batch)
    assert sorted(ended) == [1, 2, 3]
    reader.close()


def test_a_flush_writes_every_layer_at_once_and_raises_the_first_failure(kv_path, monkeypatch):
    """``write_layers`` (a decode step's flush: a record a layer, each to its own file, the writes in flight
    together) stores what ``write_groups`` layer by layer stores; with two layers' writes failing, every other write
    still lands and the error raised is the lowest layer's, named as a write failure."""
    import edgekv.runtime.disk_store as disk_store_mod

    layout = RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, align_bytes=512)
    store = DiskKVStore(kv_path, 6, layout, open_reader("python"))
    try:
        store.open_sequence(0)
        records, reversed_records = (aligned_zeros((6, 1, layout.stride_bytes), layout.align_bytes) for _ in range(2))
        for layer in range(6):  # O_DIRECT: the records' memory aligned as a flush's is
            records[layer] = layout.pack(torch.randn(1, 4, 8), torch.randn(1, 4, 8))
        reversed_records[:] = records[::-1]
        store.write_layers(0, 3, records)
        dest = aligned_zeros((1, layout.stride_bytes), layout.align_bytes)
        for layer in range(6):
            store.read(read_into(store, dest, layer, [3]))
            assert np.array_equal(dest[0], records[layer, 0])
        failing = {int(store._fds[0, layer, 0]): layer for layer in (4, 2)}
        real = os.pwrite

        def pwrite(fd, data, offset):
            if fd in failing:
                time.sleep(0.01 * (6 - failing[fd]))  # the later layer fails first
                raise OSError(errno.EIO, f"layer {failing[fd]}")
            return real(fd, data, offset)
        monkeypatch.setattr(disk_store_mod.os, "pwrite", pwrite)
        with pytest.raises(StoreError) as err:
            store.write_layers(0, 4, reversed_records)
        assert err.value.errno == errno.EIO and "layer 2" in str(err.value) and "writing KV records" in str(err.value)
        monkeypatch.undo()
        for layer in (0, 1, 3, 5):  # the writes beside the failures landed
            store.read(read_into(store, dest, layer, [4]))
            assert np.array_equal(dest[0], records[5 - layer, 0])
    finally:
        store.close()


@pytest.mark.parametrize("paths,per_flush", [(1, 1), (1, 3), (2, 1), (3, 2)])
def test_a_striped_flush_in_one_pass_stores_what_the_layers_one_by_one_store(tmp_path, monkeypatch, paths, per_flush):
    """``write_layers`` where every layer is striped (the checksums in one call, the runs found at once) leaves the
    files, checksums, placement and counters that ``_write_runs`` layer by layer leaves: one to three KV paths, one
    to three records a layer a flush (more than one on several paths takes the layers one by one), 5 layers."""
    layout = RecordLayout(group_tokens=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, align_bytes=512)
    torch.manual_seed(0)
    flushes = [aligned_zeros((5, per_flush, layout.stride_bytes), layout.align_bytes) for _ in range(4)]
    for records in flushes:
        for layer in range(5):
            records[layer] = layout.pack(torch.randn(1, 4 * per_flush, 8), torch.randn(1, 4 * per_flush, 8))
    striped = DiskKVStore.__dict__["_striped_runs"]
    found, stores = [], []
    for at_once in (True, False):
        roots = [tmp_path / f"{at_once}-{p}" for p in range(paths)]
        for root in roots:
            root.mkdir()
        store = DiskKVStore(roots, 5, layout, open_reader("python"))
        stores.append(store)
        monkeypatch.setattr(DiskKVStore, "_striped_runs", lambda self, *a: found.append(striped(self, *a)) or
                            found[-1] if at_once else None)
        store.open_sequence(0)
        for i, records in enumerate(flushes):
            store.write_layers(0, 2 + i * per_flush, records)
    try:
        (one, each) = stores
        assert np.array_equal(one._sums[0], each._sums[0]) and one.bytes_written == each.bytes_written
        assert np.array_equal(one._placement[0]._striped_end, each._placement[0]._striped_end)
        for layer in range(5):
            for path in range(paths):
                files = [s._path(0, layer, path).read_bytes() for s in stores]
                assert files[0] == files[1] and len(files[0]) > 0
        assert all(f is not None for f in found) == (per_flush == 1 or paths == 1)
    finally:
        for store in stores:
            store.close()
