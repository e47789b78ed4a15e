"""KV readers: batched positional reads into caller-owned aligned buffers.

``KVReader`` is the interface the runtime reads through; platforms may bring their own
(e.g. a P2P path).  Backends here, fastest first: ``io_uring`` and ``pthread`` (our small
C library, built on first use or by ``make native``) and ``python`` (a thread pool of
``os.preadv``, the last fallback: GIL-bound at small block sizes).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("native") / "ekv_reader.c"


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


class KVReader:
    """Interface: read a batch, blocking until all of it is in memory (native backends release the GIL)."""

    name = "abstract"

    def read(self, batch: ReadBatch) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PythonPoolReader(KVReader):
    """Thread pool of preads: portable, but the GIL caps it well below the disk at 4-16 KiB."""

    name = "python"

    def __init__(self, threads: int = 16):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ekv-pread")

    @staticmethod
    def _read_one(fd: int, offset: int, address: int, nbytes: int) -> None:
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"unexpected end of file reading fd {fd} at offset {offset + done}")
            done += got

    def read(self, batch: ReadBatch) -> None:
        """Every read ends before this returns, a failed one included: the caller may free the buffers after."""
        jobs = zip(batch.fds.tolist(), batch.offsets.tolist(), batch.addresses.tolist())
        futures = [self._pool.submit(self._read_one, fd, off, addr, batch.nbytes) for fd, off, addr in jobs]
        wait(futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class NativeReader(KVReader):
    """ctypes front of ekv_reader.c (io_uring or pthread pool)."""

    def __init__(self, library: ctypes.CDLL, queue_depth: int = 64, threads: int = 16):
        self._lib = library
        self.name = library.ekv_backend().decode()
        self._handle = library.ekv_open(queue_depth, threads)
        if not self._handle:
            raise OSError(f"the {self.name} reader could not be opened (io_uring refused or out of memory)")

    def read(self, batch: ReadBatch) -> None:
        n = len(batch)
        if n == 0:
            return
        fds = np.ascontiguousarray(batch.fds, dtype=np.int32)
        offsets = np.ascontiguousarray(batch.offsets, dtype=np.int64)
        addresses = np.ascontiguousarray(batch.addresses, dtype=np.int64)
        rc = self._lib.ekv_read(self._handle, n, fds.ctypes.data, offsets.ctypes.data, batch.nbytes, addresses.ctypes.data)
        if rc != 0:
            raise OSError(-rc, f"{self.name} read of {n} KV records failed: {os.strerror(-rc)}")

    def close(self) -> None:
        if self._handle:
            self._lib.ekv_close(self._handle)
            self._handle = None


def _cache_dir() -> Path:
    root = os.environ.get("EDGEKV_CACHE") or Path.home() / ".cache" / "edgekv"
    return Path(root) / "native"


def build_native(backend: str) -> Path:
    """Compile ekv_reader.c for ``backend`` ('io_uring' or 'pthread') into the cache; returns the .so path.

    The file name carries the source hash, so an edited source is rebuilt and a stale
    library is never loaded.
    """
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    target = _cache_dir() / f"libekv_reader-{backend}-{digest}.so"
    if target.exists():
        return target
    flags = ["-DEKV_URING"] if backend == "io_uring" else []
    libs = ["-luring"] if backend == "io_uring" else ["-lpthread"]
    return compile_library(lambda out: ["cc", "-O2", "-shared", "-fPIC", "-Wall", *flags, str(_SOURCE), "-o", out, *libs],
                           target, f"the {backend} reader")


def compile_library(command, target: Path, what: str) -> Path:
    """Run ``command(output_path)`` into a temporary file and move it to ``target``: a failed or
    interrupted build never leaves a library that would be loaded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = command(str(tmp))
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise OSError(f"building {what} failed ({' '.join(cmd)}):\n{result.stderr.strip()}")
    tmp.replace(target)
    return target


def _load_native(backend: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_native(backend)))
    lib.ekv_backend.restype = ctypes.c_char_p
    lib.ekv_open.restype = ctypes.c_void_p
    lib.ekv_open.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.ekv_close.argtypes = [ctypes.c_void_p]
    lib.ekv_read.restype = ctypes.c_int
    lib.ekv_read.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


def open_reader(backend: str = "auto", queue_depth: int = 64) -> KVReader:
    """Open the requested backend; 'auto' tries io_uring, then pthread, then python, logging each fallback."""
    order = ["io_uring", "pthread", "python"] if backend == "auto" else [backend]
    errors = []
    for name in order:
        try:
            if name == "python":
                return PythonPoolReader()
            return NativeReader(_load_native(name), queue_depth=queue_depth)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
            if backend == "auto":
                log.warning("KV reader backend %s unavailable, falling back: %s", name, exc)
    raise OSError(f"KV reader backend {backend!r} unavailable: {'; '.join(errors)}")


def build_all() -> dict[str, str]:
    """Build every native library this machine can (the reader backends, arkv's quantized attention kernel);
    returns name -> library path or error."""
    from .qattn import build_qattn

    builds = {"io_uring": lambda: build_native("io_uring"), "pthread": lambda: build_native("pthread"), "qattn": build_qattn}
    out = {}
    for name, build in builds.items():
        try:
            out[name] = str(build())
        except OSError as exc:
            out[name] = f"unavailable: {exc}"
    return out

