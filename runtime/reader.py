"""KV readers: batched positional reads into caller-owned aligned buffers.

``KVReader`` is the interface the runtime reads through; platforms may bring their own
(e.g. a P2P path).  Backends here, fastest first: ``io_uring`` and ``pthread`` (our small
C library, built on first use or by ``make native``) and ``python`` (a thread pool of
``os.preadv``, the last fallback: GIL-bound at small block sizes).  Around them: ``MultiPathReader``
gives each KV device its own queue, ``PacedReader`` emulates a slower device (runtime/pacing.py).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import native_build
from .native_build import address
from .pacing import MIB, Link

log = logging.getLogger(__name__)

_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024  # preadv's iovec limit per call
READER_BACKENDS = ("io_uring", "pthread", "python")


@dataclass(frozen=True)
class ReadBatch:
    """n read requests: request i takes ``counts[i]`` records of ``nbytes`` each from file ``fds[i]`` at ``offsets[i]``
    (consecutive on disk) into the next ``counts[i]`` host ``addresses`` (one per record: a scattered read, readv).

    Arrays, not objects: one decode step reads thousands of records, and building a
    Python object per record costs more than the read.  The caller keeps the destination
    memory alive until ``read`` returns.
    """

    fds: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [n]
    addresses: np.ndarray  # int64 [sum(counts)]: one host address per record, in request order
    nbytes: int  # bytes per record
    counts: np.ndarray | None = None  # int32 [n]: records per request, consecutive on disk, scattered in memory; None: 1 each
    paths: np.ndarray | None = None  # int32 [n]: the device (KV path) whose queue takes each request; None: all path 0

    def __len__(self) -> int:
        return len(self.fds)

    @property
    def n_records(self) -> int:
        return len(self.fds) if self.counts is None else int(self.counts.sum())

    @property
    def total_bytes(self) -> int:
        return self.n_records * self.nbytes


class BusyTime:
    """Wall time with at least one of several overlapping activities running (reads on several threads): their
    summed durations would count a common second twice.  ``begin``/``end`` bracket each activity."""

    def __init__(self, clock=time.perf_counter):
        self.total_s, self._clock = 0.0, clock
        self._running, self._since = 0, 0.0
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            if not self._running:
                self._since = self._clock()
            self._running += 1

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                self.total_s += self._clock() - self._since


class KVReader:
    """Interface: read a batch, blocking until all of it is in memory (native backends release the GIL)."""

    name = "abstract"

    def read(self, batch: ReadBatch) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def record_starts(batch: ReadBatch) -> np.ndarray:
    """int64 [n + 1]: request i's records are addresses[starts[i]:starts[i + 1]]."""
    if batch.counts is None:
        return np.arange(len(batch) + 1, dtype=np.int64)
    starts = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(batch.counts, out=starts[1:])
    return starts


def check_batch(batch: ReadBatch) -> None:
    """Shapes must agree before any read: a missing address would send a record into memory nobody owns."""
    n = len(batch)
    for name in ("offsets", "counts", "paths"):
        array = getattr(batch, name)
        if array is not None and len(array) != n:
            raise ValueError(f"ReadBatch.{name} has {len(array)} entries for {n} requests: give one per request")
    if batch.counts is not None and n and int(batch.counts.min()) < 1:
        raise ValueError("ReadBatch.counts must be >= 1 for every request: drop the empty requests")
    if len(batch.addresses) != batch.n_records:
        raise ValueError(f"ReadBatch.addresses has {len(batch.addresses)} entries for {batch.n_records} records: "
                         "give one host address per record (sum of counts)")


class PythonPoolReader(KVReader):
    """Thread pool of preadvs: portable, but the GIL caps it well below the disk at 4-16 KiB.

    Each worker has one read in flight at most, so ``threads`` is the queue depth."""

    name = "python"

    def __init__(self, threads: int = 16):
        if threads < 1:
            raise ValueError(f"PythonPoolReader needs threads (the queue depth) >= 1, got {threads}")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ekv-pread")

    @staticmethod
    def _read_one(fd: int, offset: int, addresses: list[int], nbytes: int) -> None:
        """One request: ``len(addresses)`` records consecutive on disk at ``offset``, each to its own address."""
        records = [memoryview((ctypes.c_char * nbytes).from_address(a)).cast("B") for a in addresses]
        done = 0
        while done < len(records) * nbytes:
            first, within = divmod(done, nbytes)
            views = records[first : first + _IOV_MAX]
            views[0] = views[0][within:]
            got = os.preadv(fd, views, offset + done)
            if got == 0:
                raise OSError(errno.EIO, f"unexpected end of file reading fd {fd} at offset {offset + done}: "
                                         "the record was never written")
            done += got

    def read(self, batch: ReadBatch) -> None:
        """Every read ends before this returns, a failed one included: the caller may free the buffers after."""
        check_batch(batch)
        starts = record_starts(batch).tolist()
        addresses = batch.addresses.tolist()
        jobs = zip(batch.fds.tolist(), batch.offsets.tolist(), starts, starts[1:])
        futures = [self._pool.submit(self._read_one, fd, off, addresses[a:b], batch.nbytes) for fd, off, a, b in jobs]
        wait(futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class NativeReader(KVReader):
    """ctypes front of ekv_reader.c (io_uring or pthread pool): at most ``queue_depth`` reads in flight per batch
    (the pthread pool runs min(threads, queue_depth) threads).

    A C handle holds one batch at a time, so each concurrent caller gets its own (opened on first need, kept
    after): two layers' batches read at once, and neither's queue runs down waiting for the other's tail."""

    def __init__(self, library: ctypes.CDLL, queue_depth: int = 64, threads: int = 16):
        self._lib = library
        self.name = library.ekv_backend().decode()
        self._depth, self._threads = queue_depth, threads
        self._cond = threading.Condition()
        self._idle = [self._open()]  # the first opened here: a refused io_uring falls back when the reader opens
        self._busy = 0
        self._closed = False

    def _open(self) -> int:
        handle = self._lib.ekv_open(self._depth, self._threads)
        if not handle:
            raise OSError(f"the {self.name} reader could not be opened (io_uring refused or out of memory)")
        return handle

    def _take(self) -> int:
        with self._cond:
            if self._closed:
                raise ValueError(f"the {self.name} reader is closed: open another with open_reader")
            self._busy += 1
            if self._idle:
                return self._idle.pop()
        try:
            return self._open()
        except BaseException:
            self._give(None)
            raise

    def _give(self, handle: int | None) -> None:
        with self._cond:
            self._busy -= 1
            if handle is not None:
                self._idle.append(handle)
            self._cond.notify_all()

    def read(self, batch: ReadBatch) -> None:
        check_batch(batch)
        n = len(batch)
        if n == 0:
            return
        fds = np.ascontiguousarray(batch.fds, dtype=np.int32)
        offsets = np.ascontiguousarray(batch.offsets, dtype=np.int64)
        addresses = np.ascontiguousarray(batch.addresses, dtype=np.int64)
        handle = self._take()
        try:
            if batch.counts is None:
                rc = self._lib.ekv_read(handle, n, address(fds), address(offsets), batch.nbytes,
                                        address(addresses))
            else:
                counts = np.ascontiguousarray(batch.counts, dtype=np.int32)
                rc = self._lib.ekv_readv(handle, n, address(fds), address(offsets), address(counts),
                                         batch.nbytes, address(addresses))
        finally:
            self._give(handle)
        if rc != 0:
            raise OSError(-rc, f"{self.name} read of {n} KV requests failed: {os.strerror(-rc)}")

    def close(self) -> None:
        """Waits for the batches being read, then closes every handle (a second close does nothing)."""
        with self._cond:
            self._closed = True
            while self._busy:
                self._cond.wait()
            handles, self._idle = self._idle, []
        for handle in handles:
            self._lib.ekv_close(handle)


class PacedReader(KVReader):
    """An emulated device no faster than ``limit_mib_s`` and ``limit_iops`` (None: no limit), to study
    several slow disks on one fast one.  Reads through ``inner``, then waits until its link has carried
    the batch; the link starts when the read does, so the real disk time overlaps the emulated time."""

    def __init__(self, inner: KVReader, limit_mib_s: float | None = None, limit_iops: float | None = None, *,
                 clock=time.monotonic, sleep=time.sleep):
        self.inner = inner
        self.link = Link(None if limit_mib_s is None else limit_mib_s * MIB, limit_iops, clock, sleep)
        limits = [f"{value:g} {unit}" for value, unit in ((limit_mib_s, "MiB/s"), (limit_iops, "IOPS"))
                  if value is not None]
        self.name = f"{inner.name} paced to {', '.join(limits) or 'no limit'}"

    def read(self, batch: ReadBatch) -> None:
        self.link.wait_until(self.start(batch))

    def start(self, batch: ReadBatch, began: float | None = None) -> float:
        """Read the batch and book it on the link from ``began`` (default: now, when the device got it); returns
        the clock time the emulated device is done."""
        began = self.link.clock() if began is None else began
        self.inner.read(batch)
        return self.link.reserve(batch.total_bytes, len(batch), began)

    def close(self) -> None:
        self.inner.close()


class MultiPathReader(KVReader):
    """One queue per KV device: a batch is split by ``paths`` and each device's share read by its own
    reader, all at once (``batches_at_once`` persistent threads per path, so the shares of two callers' batches,
    two layers', read side by side as on one path; native readers release the GIL).

    ``read`` returns, or raises the first path's error, only once every share has finished.
    Counters per path: ``bytes_by_path`` and ``requests_by_path`` (of the reads that succeeded)
    and ``busy_s_by_path`` (wall time with any of its shares reading)."""

    def __init__(self, readers: list[KVReader], clock=time.perf_counter, batches_at_once: int = 2):
        """``batches_at_once``: as many as the engine has I/O threads (runtime/slot_memory.py LAYERS_IN_FLIGHT)."""
        if not readers:
            raise ValueError("MultiPathReader needs one reader per KV path, got none")
        self.readers = list(readers)
        n = len(self.readers)
        self.name = f"{self.readers[0].name} x{n} paths"
        self._threads = [ThreadPoolExecutor(max_workers=batches_at_once, thread_name_prefix=f"ekv-path{p}")
                         for p in range(n)]
        self._lock = threading.Lock()
        self.bytes_by_path = np.zeros(n, dtype=np.int64)
        self.requests_by_path = np.zeros(n, dtype=np.int64)
        self._busy = [BusyTime(clock) for _ in range(n)]

    @property
    def busy_s_by_path(self) -> np.ndarray:
        return np.array([busy.total_s for busy in self._busy])

    def split(self, batch: ReadBatch) -> list[tuple[int, ReadBatch]]:
        """(path, that path's requests) for every path with any, in path order."""
        check_batch(batch)
        if len(batch) == 0:
            return []
        paths = np.zeros(len(batch), dtype=np.int32) if batch.paths is None else np.asarray(batch.paths)
        used = np.unique(paths)
        if used[0] < 0 or used[-1] >= len(self.readers):
            raise ValueError(f"ReadBatch.paths spans {used[0]}..{used[-1]} but this reader has {len(self.readers)} "
                             "paths: open the reader with n_paths covering every KV path")
        if len(used) == 1:
            return [(int(used[0]), replace(batch, paths=None))]
        starts = record_starts(batch)
        shares = []
        for path in used.tolist():
            idx = np.flatnonzero(paths == path)
            counts = None if batch.counts is None else batch.counts[idx]
            if counts is None:
                records = idx
            else:
                within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
                records = np.repeat(starts[idx], counts) + within
            shares.append((path, ReadBatch(batch.fds[idx], batch.offsets[idx], batch.addresses[records],
                                           batch.nbytes, counts)))
        return shares

    def _read_share(self, path: int, share: ReadBatch, read=None):
        """Read one device's share (``read``: how, by default its reader's ``read``), count it on its path, and
        tag a failure with the path (the store names its folder); returns what ``read`` returns."""
        carried = False
        self._busy[path].begin()
        try:
            result = (read or self.readers[path].read)(share)
            carried = True
            return result
        except OSError as error:
            error.kv_path_index = path
            raise
        finally:
            self._busy[path].end()
            with self._lock:
                if carried:
                    self.bytes_by_path[path] += share.total_bytes
                    self.requests_by_path[path] += len(share)

    def _read_paced(self, shares: list[tuple[int, ReadBatch]]) -> None:
        """Emulated devices: every share is booked on its path's link from the moment the batch arrives (as N
        devices would each start on theirs), read on this thread (the real disk is much faster than the emulated
        links: its time overlaps theirs), then one sleep until the last link is through: no thread hop and no
        sleep per path, whose wake-ups on a small CPU would be charged to the emulated devices."""
        done, error = [], None
        submitted = self.readers[shares[0][0]].link.clock()  # every device got its share now
        for path, share in shares:
            try:
                done.append((self._read_share(path, share, partial(self.readers[path].start, began=submitted)), path))
            except OSError as exc:
                error = error or exc
        if done:
            last, path = max(done)
            self.readers[path].link.wait_until(last)
        if error is not None:
            raise error

    def read(self, batch: ReadBatch) -> None:
        shares = self.split(batch)
        if not shares:
            return
        if all(isinstance(self.readers[path], PacedReader) for path, _ in shares):
            self._read_paced(shares)
        elif len(shares) == 1:  # one device: no thread hop
            self._read_share(*shares[0])
        else:
            futures = [self._threads[path].submit(self._read_share, path, share) for path, share in shares]
            wait(futures)
            for future in futures:
                if future.exception() is not None:
                    raise future.exception()

    def close(self) -> None:
        for thread in self._threads:
            thread.shutdown(wait=True)
        for reader in self.readers:
            reader.close()


def build_native(backend: str) -> Path:
    """The compiled library of ``backend`` ('io_uring' or 'pthread'; runtime/native_build.py)."""
    return native_build.build(backend)


def _load_native(backend: str) -> ctypes.CDLL:
    lib = native_build.load(backend)
    lib.ekv_backend.restype = ctypes.c_char_p
    lib.ekv_open.restype = ctypes.c_void_p
    lib.ekv_open.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.ekv_close.argtypes = [ctypes.c_void_p]
    lib.ekv_read.restype = ctypes.c_int
    lib.ekv_read.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.ekv_readv.restype = ctypes.c_int
    lib.ekv_readv.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_void_p]
    return lib


_SKIPPED: set[str] = set()  # backends 'auto' has said it skips (each engine opens readers)


def _open_backend(backend: str, queue_depth: int) -> KVReader:
    """One reader of ``backend``; 'auto' tries io_uring, then pthread, then python, logging each fallback."""
    if backend != "auto" and backend not in READER_BACKENDS:
        raise ValueError(f"unknown KV reader backend {backend!r}: choose auto or one of {', '.join(READER_BACKENDS)}")
    order = READER_BACKENDS if backend == "auto" else [backend]
    errors = []
    for name in order:
        try:
            if name == "python":
                return PythonPoolReader(threads=queue_depth)
            return NativeReader(_load_native(name), queue_depth=queue_depth)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
            if backend == "auto" and name not in _SKIPPED:  # once a process, in one line
                _SKIPPED.add(name)
                log.warning("KV reader backend %s unavailable, falling back: %s", name,
                            native_build.cause(exc))
    raise OSError(f"KV reader backend {backend!r} unavailable: {'; '.join(errors)}")


def open_reader(backend: str = "auto", queue_depth: int = 64, n_paths: int = 1, limit_mib_s: float | None = None,
                limit_iops: float | None = None) -> KVReader:
    """A reader of ``backend`` with at most ``queue_depth`` reads in flight per device.

    One path and no limit: the backend's reader itself.  Otherwise a MultiPathReader of ``n_paths``
    readers (one queue per device), each paced to ``limit_mib_s`` / ``limit_iops`` when given.
    """
    if n_paths < 1:
        raise ValueError(f"n_paths must be >= 1 (one per KV device), got {n_paths}")
    first = _open_backend(backend, queue_depth)
    limited = limit_mib_s is not None or limit_iops is not None
    if n_paths == 1 and not limited:
        return first
    readers = [first]
    try:
        while len(readers) < n_paths:
            readers.append(_open_backend(first.name, queue_depth))  # 'auto' resolved once, its fallbacks logged once
        if limited:
            readers = [PacedReader(r, limit_mib_s, limit_iops) for r in readers]
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return MultiPathReader(readers)
