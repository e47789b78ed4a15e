"""Requests of several records (readv) on every reader backend, queue depths, several KV paths, pacing."""
import os
import threading
import time

import numpy as np
import pytest

from edgekv.runtime.disk_store import aligned_zeros, open_maybe_direct
from edgekv.runtime.pacing import MIB, Link
from edgekv.runtime.reader import MultiPathReader, NativeReader, PacedReader, ReadBatch, open_reader
from tests.conftest import run_in_threads

BACKENDS = ["io_uring", "pthread", "python"]
RECORD = 4096
LONG = 1500  # records in one request: more than preadv's and io_uring's 1024 iovecs


def reader_or_skip(backend, **kwargs):
    try:
        return open_reader(backend, **kwargs)
    except OSError as exc:
        pytest.skip(f"{backend} reader unavailable here: {exc}")


@pytest.fixture
def kv_files(tmp_path):
    """Three files of random records, O_DIRECT where the filesystem allows: (fds, contents [records, RECORD])."""
    rng = np.random.default_rng(0)
    fds, contents = [], []
    for i, n_records in enumerate((2048, 300, 97)):
        data = rng.integers(0, 256, (n_records, RECORD), dtype=np.uint8)
        path = tmp_path / f"f{i}.kv"
        path.write_bytes(data.tobytes())
        fds.append(open_maybe_direct(path, os.O_RDONLY)[0])
        contents.append(data)
    yield fds, contents
    for fd in fds:
        os.close(fd)


class Scattered:
    """Random requests of 1..64 consecutive records (and one LONG) from every file, scattered over a buffer."""

    def __init__(self, fds, contents, rng, n_requests=120, with_counts=True, n_paths=1):
        picks = []
        for _ in range(n_requests):
            f = int(rng.integers(len(fds)))
            count = int(rng.integers(1, 65)) if with_counts else 1
            picks.append((f, int(rng.integers(0, len(contents[f]) - count + 1)), count))
        if with_counts:
            picks.append((0, 3, LONG))
        counts = np.array([c for _, _, c in picks], dtype=np.int32)
        self.dest = aligned_zeros((int(counts.sum()), RECORD), 4096)
        slots = rng.permutation(len(self.dest))
        self.expected = np.empty_like(self.dest)
        self.expected[slots] = np.concatenate([contents[f][start : start + c] for f, start, c in picks])
        self.slots_by_request = np.split(slots, np.cumsum(counts)[:-1])
        self.paths = rng.integers(0, n_paths, len(picks)).astype(np.int32)
        self.batch = ReadBatch(np.array([fds[f] for f, _, _ in picks], dtype=np.int32),
                               np.array([s * RECORD for _, s, _ in picks], dtype=np.int64),
                               self.dest.ctypes.data + slots.astype(np.int64) * RECORD, RECORD,
                               counts if with_counts else None, self.paths if n_paths > 1 else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_counts", [True, False])
def test_scattered_requests_are_byte_exact(kv_files, backend, with_counts):
    reader = reader_or_skip(backend, queue_depth=8)
    try:
        rng = np.random.default_rng(1)
        for _ in range(3):
            case = Scattered(*kv_files, rng, with_counts=with_counts)
            reader.read(case.batch)
            assert np.array_equal(case.dest, case.expected)
    finally:
        reader.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_request_raises_after_the_whole_batch(kv_files, backend):
    """The caller frees the buffers once read raises: every other request has landed by then."""
    reader = reader_or_skip(backend, queue_depth=4)
    try:
        case = Scattered(*kv_files, np.random.default_rng(2), n_requests=60)
        bad = 7
        case.batch.fds[bad] = -1
        with pytest.raises(OSError):
            reader.read(case.batch)
        good = np.concatenate([s for i, s in enumerate(case.slots_by_request) if i != bad])
        assert np.array_equal(case.dest[good], case.expected[good])
        assert not case.dest[case.slots_by_request[bad]].any()

        past_end = ReadBatch(np.array([kv_files[0][2]], dtype=np.int32), np.array([90 * RECORD], dtype=np.int64),
                             case.dest.ctypes.data + np.arange(10, dtype=np.int64) * RECORD, RECORD,
                             np.array([10], dtype=np.int32))
        with pytest.raises(OSError):
            reader.read(past_end)  # 7 records there, 10 asked
        again = Scattered(*kv_files, np.random.default_rng(3))
        reader.read(again.batch)  # the reader survives failed requests
        assert np.array_equal(again.dest, again.expected)
    finally:
        reader.close()


def test_malformed_batches_are_refused_before_any_read():
    reader = open_reader("python")
    with pytest.raises(ValueError, match="one host address per record"):
        reader.read(ReadBatch(np.zeros(2, np.int32), np.zeros(2, np.int64), np.zeros(3, np.int64), RECORD,
                              np.array([1, 1], dtype=np.int32)))
    with pytest.raises(ValueError, match="counts must be >= 1"):
        reader.read(ReadBatch(np.zeros(2, np.int32), np.zeros(2, np.int64), np.zeros(1, np.int64), RECORD,
                              np.array([1, 0], dtype=np.int32)))
    with pytest.raises(ValueError, match="unknown KV reader backend"):
        open_reader("iouring")
    with pytest.raises(ValueError, match="n_paths"):
        open_reader("python", n_paths=0)
    reader.close()


@pytest.mark.parametrize("depth", [1, 4])
def test_python_reader_keeps_at_most_queue_depth_reads_in_flight(kv_files, monkeypatch, depth):
    """``depth`` reads meet at a barrier (fewer would time out); one more in flight shows in the count."""
    real_preadv, lock, state = os.preadv, threading.Lock(), {"now": 0, "max": 0}
    barrier = threading.Barrier(depth, timeout=10)

    def counting_preadv(fd, buffers, offset):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        try:
            barrier.wait()
            time.sleep(0.005)  # room for an extra reader to overlap
            return real_preadv(fd, buffers, offset)
        finally:
            with lock:
                state["now"] -= 1

    reader = open_reader("python", queue_depth=depth)
    monkeypatch.setattr(os, "preadv", counting_preadv)
    fds, contents = kv_files
    n = 4 * depth
    dest = aligned_zeros((n, RECORD), 4096)
    reader.read(ReadBatch(np.full(n, fds[0], np.int32), np.arange(n, dtype=np.int64) * RECORD,
                          dest.ctypes.data + np.arange(n, dtype=np.int64) * RECORD, RECORD))
    reader.close()
    assert state["max"] == depth
    assert np.array_equal(dest, contents[0][:n])


class MeetingLibrary:
    """The real C library, whose batch calls first meet at a barrier of two: a reader that let only one caller into
    the C code at a time would leave the other waiting outside, and the barrier would time out."""

    def __init__(self, library):
        self._library = library
        self.barrier = threading.Barrier(2, timeout=10)

    def __getattr__(self, name):
        return getattr(self._library, name)

    def ekv_readv(self, *args):
        self.barrier.wait()
        return self._library.ekv_readv(*args)


@pytest.mark.parametrize("backend", ["io_uring", "pthread"])
def test_native_reader_reads_two_callers_batches_at_once(kv_files, backend):
    """Each concurrent caller gets its own C handle (the engine's I/O threads read two layers at once); after close,
    a read is refused by name."""
    inner = reader_or_skip(backend, queue_depth=8)
    library = MeetingLibrary(inner._lib)
    inner.close()
    reader = NativeReader(library, queue_depth=8)
    rng = np.random.default_rng(5)
    cases = [Scattered(*kv_files, rng) for _ in range(2)]
    batches = iter([case.batch for case in cases])
    assert run_in_threads(lambda: reader.read(next(batches)), 2) == []
    assert not library.barrier.broken
    assert all(np.array_equal(case.dest, case.expected) for case in cases)
    reader.close()
    reader.close()
    with pytest.raises(ValueError, match="closed: open another"):
        reader.read(cases[0].batch)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
@pytest.mark.parametrize("depth,threads", [(1, 1), (4, 4), (64, 16)])
def test_pthread_reader_runs_one_thread_per_read_in_flight(depth, threads):
    reader_or_skip("pthread").close()  # build (or skip) before counting
    before = len(os.listdir("/proc/self/task"))
    reader = open_reader("pthread", queue_depth=depth)
    assert len(os.listdir("/proc/self/task")) - before == threads
    reader.close()


class FakeClock:
    """A clock per thread (shared ones would mix the paths' times); sleep advances it."""

    def __init__(self):
        self._local = threading.local()
        self.sleeps = []

    def __call__(self):
        return getattr(self._local, "now", 0.0)

    def advance(self, s):
        self._local.now = self() + s

    def sleep(self, s):
        self.sleeps.append(s)
        self.advance(s)


class RecordingReader:
    def __init__(self, name, clock=None, busy_s=0.0, fail=None, before=None):
        self.name, self.clock, self.busy_s, self.fail, self.before = name, clock, busy_s, fail, before
        self.batches, self.closed = [], False

    def read(self, batch):
        if self.before:
            self.before()
        self.batches.append(batch)
        if self.clock:
            self.clock.advance(self.busy_s)
        if self.fail:
            raise self.fail

    def close(self):
        self.closed = True


def test_multipath_splits_by_path_and_counts_per_path():
    clock = FakeClock()
    readers = [RecordingReader(f"r{p}", clock, busy_s=p + 1.0) for p in range(4)]
    multi = MultiPathReader(readers, clock=clock)
    paths = np.array([2, 0, 2, 0, 0], dtype=np.int32)
    counts = np.array([3, 1, 2, 4, 1], dtype=np.int32)
    addresses = np.arange(counts.sum(), dtype=np.int64) * 10  # request order: [0 10 20] [30] [40 50] [60..90] [100]
    batch = ReadBatch(np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int64) * 100, addresses, 8, counts, paths)
    multi.read(batch)
    (share0,), (share2,) = readers[0].batches, readers[2].batches
    assert share0.fds.tolist() == [1, 3, 4] and share0.counts.tolist() == [1, 4, 1]
    assert share0.addresses.tolist() == [30, 60, 70, 80, 90, 100] and share0.offsets.tolist() == [100, 300, 400]
    assert share2.fds.tolist() == [0, 2] and share2.addresses.tolist() == [0, 10, 20, 40, 50]
    assert not readers[1].batches and not readers[3].batches
    assert multi.bytes_by_path.tolist() == [6 * 8, 0, 5 * 8, 0]
    assert multi.requests_by_path.tolist() == [3, 0, 2, 0]
    assert multi.busy_s_by_path.tolist() == [1.0, 0.0, 3.0, 0.0]

    multi.read(ReadBatch(np.zeros(2, np.int32), np.zeros(2, np.int64), np.zeros(2, np.int64), 8,
                         paths=np.array([3, 3], dtype=np.int32)))  # one path: read whole, paths dropped
    assert readers[3].batches[0].paths is None and len(readers[3].batches[0]) == 2
    multi.read(ReadBatch(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64), 8))
    assert multi.requests_by_path.tolist() == [3, 0, 2, 2]
    with pytest.raises(ValueError, match="n_paths"):
        multi.read(ReadBatch(np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64), 8,
                             paths=np.array([4], dtype=np.int32)))
    multi.close()
    assert all(r.closed for r in readers)


def test_multipath_raises_the_first_error_once_every_path_finished():
    failed, finished = threading.Event(), []

    def slow_after_the_failure():
        failed.wait(10)
        time.sleep(0.05)
        finished.append(True)

    readers = [RecordingReader("r0", fail=OSError("path 0 gone"), before=failed.set),
               RecordingReader("r1", before=slow_after_the_failure),
               RecordingReader("r2", fail=OSError("path 2 gone"), before=lambda: failed.wait(10))]
    multi = MultiPathReader(readers)
    batch = ReadBatch(np.zeros(3, np.int32), np.zeros(3, np.int64), np.zeros(3, np.int64), 8,
                      paths=np.array([1, 0, 2], dtype=np.int32))
    with pytest.raises(OSError, match="path 0 gone"):
        multi.read(batch)
    assert finished == [True]
    assert multi.requests_by_path.tolist() == [0, 1, 0]
    multi.close()


def test_multipath_reads_two_callers_shares_of_one_path_at_once():
    """Two layers' batches in flight (the engine's two I/O threads) over two paths: each path's reader holds both
    callers' shares at once; one thread per path would queue the second behind the first (the barriers time out)."""
    barriers = [threading.Barrier(2, timeout=10) for _ in range(2)]
    readers = [RecordingReader(f"r{p}", before=barriers[p].wait) for p in range(2)]
    multi = MultiPathReader(readers)
    batch = ReadBatch(np.zeros(4, np.int32), np.arange(4, dtype=np.int64) * 8, np.zeros(4, np.int64), 8,
                      paths=np.array([0, 1, 0, 1], dtype=np.int32))
    errors = run_in_threads(lambda: multi.read(batch), 2)
    multi.close()
    assert errors == [] and [len(r.batches) for r in readers] == [2, 2]
    assert multi.requests_by_path.tolist() == [4, 4]


def test_a_paths_busy_time_counts_overlapping_shares_once():
    """Two shares of one path reading at once (here nested on one thread, on a clock set by hand): busy from the
    first's start to the last's end, 3 s, where their summed durations would be 4."""
    now = [0.0]
    multi = MultiPathReader([RecordingReader("r0")], clock=lambda: now[0])
    share = ReadBatch(np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64), 8)

    def outer(batch):
        now[0] = 1.0
        multi._read_share(0, batch, read=lambda b: now.__setitem__(0, 2.0))
        now[0] = 3.0

    multi._read_share(0, share, read=outer)
    assert multi.busy_s_by_path.tolist() == [3.0] and multi.requests_by_path.tolist() == [2]
    multi.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_multipath_reads_real_files_byte_exact(kv_files, backend):
    reader_or_skip(backend).close()
    multi = open_reader(backend, queue_depth=8, n_paths=3)
    assert isinstance(multi, MultiPathReader) and multi.name.startswith(backend)
    case = Scattered(*kv_files, np.random.default_rng(4), n_paths=3)
    multi.read(case.batch)
    multi.close()
    assert np.array_equal(case.dest, case.expected)
    records = [int(case.batch.counts[case.paths == p].sum()) for p in range(3)]
    assert multi.bytes_by_path.tolist() == [r * RECORD for r in records]
    assert multi.requests_by_path.tolist() == np.bincount(case.paths, minlength=3).tolist()


def test_link_paces_bytes_and_requests_and_builds_no_credit():
    clock = FakeClock()
    link = Link(rate_bytes_s=MIB, clock=clock, sleep=clock.sleep)
    assert link.carry(MIB // 2) == pytest.approx(0.5)
    link.carry(MIB // 2)
    assert clock() == pytest.approx(1.0)
    clock.advance(9.0)  # idle until 10 s: no credit
    link.carry(MIB)
    assert clock() == pytest.approx(11.0)
    clock.advance(1.0)
    assert link.carry(MIB // 4, began=clock() - 0.1) == pytest.approx(0.15)  # the read itself took 0.1 s of it
    assert link.bytes == 2 * MIB + MIB // 4 and link.slept_s == pytest.approx(2.15)

    link.set_rate(MIB / 2, from_s=clock() + 0.5)  # 0.5 s at 1 MiB/s, the rest at half
    link.carry(MIB)
    assert clock() == pytest.approx(12.15 + 0.5 + 1.0)
    assert link.rate_at(0.0) == MIB and link.rate_at(clock()) == MIB / 2

    requests = Link(iops=100, clock=clock, sleep=clock.sleep)
    assert requests.carry(10 * MIB, requests=10) == pytest.approx(0.1)  # no byte rate: only the request cost
    both = Link(rate_bytes_s=MIB, iops=1000, clock=clock, sleep=clock.sleep)
    assert both.carry(MIB, requests=500) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="iops"):
        Link(iops=0)


def test_link_queues_concurrent_reservations():
    clock = FakeClock()
    link = Link(rate_bytes_s=4 * MIB, clock=clock, sleep=clock.sleep)
    ends = []

    def reserve_many():
        for _ in range(25):
            ends.append(link.reserve(64 * 1024))

    threads = [threading.Thread(target=reserve_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert link.bytes == 8 * 25 * 64 * 1024 and link.requests == 200
    assert max(ends) == pytest.approx(link.bytes / (4 * MIB))
    assert len(set(ends)) == 200  # every reservation queued after another, none lost


def test_paced_reader_overlaps_the_disk_time_with_the_link():
    clock = FakeClock()
    inner = RecordingReader("disk", clock, busy_s=0.2)
    paced = PacedReader(inner, limit_mib_s=1.0, limit_iops=1000, clock=clock, sleep=clock.sleep)
    n = 128  # 0.5 MiB in 128 requests: 0.128 s of requests + 0.5 s of bytes
    batch = ReadBatch(np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64), RECORD)
    paced.read(batch)
    assert clock() == pytest.approx(0.628) and clock.sleeps == [pytest.approx(0.428)]
    paced.read(batch)
    assert clock() == pytest.approx(2 * 0.628)
    assert paced.name == "disk paced to 1 MiB/s, 1000 IOPS"
    paced.close()
    assert inner.closed


def test_open_reader_paces_every_path(kv_files):
    multi = open_reader("python", queue_depth=2, n_paths=2, limit_mib_s=1e6)
    assert isinstance(multi, MultiPathReader) and all(isinstance(r, PacedReader) for r in multi.readers)
    case = Scattered(*kv_files, np.random.default_rng(5), n_paths=2)
    multi.read(case.batch)
    assert np.array_equal(case.dest, case.expected)
    assert [r.link.bytes for r in multi.readers] == multi.bytes_by_path.tolist()
    multi.close()
    single = open_reader("python", queue_depth=2)
    assert not isinstance(single, (MultiPathReader, PacedReader))
    single.close()


def test_emulated_devices_start_together_and_the_batch_waits_once_for_the_slowest():
    clock = FakeClock()  # one thread here: the paced shares are read on the caller's
    readers = [PacedReader(RecordingReader(f"disk{p}", clock, busy_s=0.01), limit_mib_s=1.0, clock=clock,
                           sleep=clock.sleep) for p in range(3)]
    multi = MultiPathReader(readers, clock=clock)
    records = [64, 128, 32]  # 0.25, 0.5 and 0.125 MiB: the devices are through at 0.25, 0.5 and 0.125 s
    paths = np.repeat(np.arange(3, dtype=np.int32), records)
    n = len(paths)
    multi.read(ReadBatch(np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64), RECORD, None, paths))
    assert clock() == pytest.approx(0.5), "three devices at 1 MiB/s in parallel, not one after another"
    assert clock.sleeps == [pytest.approx(0.5 - 0.03)]  # one sleep; the real reads overlapped the links
    assert multi.bytes_by_path.tolist() == [r * RECORD for r in records]


def test_auto_compiles_a_failing_backend_once_and_says_why_once(tmp_path, monkeypatch, caplog):
    """Without liburing (the lent GPU machines, many CI hosts) 'auto' falls back to pthread at every engine: the
    failed io_uring build is not run again, and the warning names the cause in one line, once a process."""
    import dataclasses
    import shutil
    import subprocess

    from edgekv.runtime import native_build, reader

    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    lib = native_build.LIBRARIES["io_uring"]  # as if liburing's header were missing
    monkeypatch.setitem(native_build.LIBRARIES, "io_uring",
                        dataclasses.replace(lib, flags=lib.flags + ("-include", "no_liburing_here.h")))
    monkeypatch.setattr(reader, "_SKIPPED", set())
    compiles = []
    real_run = subprocess.run
    monkeypatch.setattr(native_build.subprocess, "run", lambda cmd, **kw: (compiles.append(cmd), real_run(cmd, **kw))[1])
    with caplog.at_level("WARNING", logger="edgekv.runtime.reader"):
        for _ in range(3):
            r = open_reader("auto")
            assert r.name == "pthread"
            r.close()
    io_uring_builds = [c for c in compiles if "-DEKV_URING" in c]
    assert len(io_uring_builds) == 1
    warnings = [rec.getMessage() for rec in caplog.records if "io_uring unavailable" in rec.getMessage()]
    assert len(warnings) == 1 and "no_liburing_here.h" in warnings[0] and "\n" not in warnings[0]
    with pytest.raises(OSError, match="no_liburing_here.h"):  # asked for by name, the cause still surfaces
        open_reader("io_uring")
