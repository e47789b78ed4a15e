"""The full KV cache on disk: where each (sequence, layer, group) record is, and moving its bytes.

One file per (sequence, layer) and KV path.  Record g holds tokens [g*G, (g+1)*G) of that layer as
K [H_kv, G, d] followed by V [H_kv, G, d], padded to the O_DIRECT alignment, so one selected group is one
aligned read at offset g * stride_bytes (64-bit).  What the store holds besides bytes and offsets, each
because it decides where a record is read from:
- placement over several KV paths (striped, or a clustered order and hot replicas: runtime/placement.py holds
  the tables, ``place``/``relocate`` write them), adjacent records read as one request;
- shared prefixes: a sequence whose leading groups are another's, or a stored context's blobs read in place
  (``share_prefix``, ``attach_prefix``): one record, several readers;
- integrity: each record's checksum (runtime/checksum.py) kept when written and checked when read back
  (``verify_fraction`` of them), a record that fails twice raising ``CorruptRecord``;
- ownership: files named by process, so a dead process's files are removed when a store opens on the folder.
Which groups to read is the selector's; when to read them is the pipeline's (runtime/offload/).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from .native_build import address
from .checksum import record_sums, sums_at
from .errors import DiskError, disk_fix
from .kernels import Backend, resolve_backend
from .placement import Placement
from .store.files import pid_alive
from .quant import FloatRecord, record_codec
from .reader import KVReader, ReadBatch, record_starts

log = logging.getLogger(__name__)
WRITES_IN_FLIGHT = 8  # a flush's record writes issued at once (write_layers): one a layer, each to its own file
# what ekv_requests_plan takes of the files and checksums (native_plan_fields), in its arguments' order: the first five
# before the record stride and the gap and size caps, the rest after them
FILE_FIELDS = ("n_seqs", "fds", "fd_seq_stride", "fd_path_stride", "n_paths", "check", "sum_tables", "sum_row_bytes",
               "layer", "sink")


class StoreError(OSError):
    """The offload path cannot hold the KV cache; the message says what to fix."""


class KVDiskError(StoreError, DiskError):
    """A KV folder that cannot hold or give back records (gone, full, not writable, failing): its errno says which."""


class CorruptRecord(StoreError):
    """A KV record failed its checksum on two reads: its bytes on disk are not what was written.

    ``blob`` is the context-store blob it came from (None: the sequence's own file)."""

    def __init__(self, message: str, path: str, record: int, seq: int, layer: int, group: int, blob: str | None):
        super().__init__(errno.EIO, message)
        self.path, self.record, self.seq, self.layer, self.group, self.blob = path, record, seq, layer, group, blob


@dataclass(frozen=True)
class VerifiedBatch(ReadBatch):
    """A store's read batch with what its records must hold: per record (in address order) the
    sequence and group it is, and the checksum to find (``check`` marks the records verified)."""

    layer: int = 0
    seqs: np.ndarray | None = None
    groups: np.ndarray | None = None
    expected: np.ndarray | None = None
    check: np.ndarray | None = None
    gap_counts: np.ndarray | None = None  # int32 [n]: records per request read only to bridge a gap (seqs -1 there)


def aligned_zeros(shape: tuple[int, ...], align: int) -> np.ndarray:
    """A zeroed uint8 array of ``shape`` whose first byte sits on an ``align`` boundary (O_DIRECT buffers).

    Zeroed, not empty: attention masks unused slots, but 0 * NaN from stale memory is still NaN.
    """
    nbytes = int(np.prod(shape))
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes].reshape(shape)


@dataclass(frozen=True)
class RecordLayout:
    """Shape of one on-disk group record; ``record_dtype`` picks its format (runtime/quant.py):
    "auto" the model's dtype, "fp16", or "int8"/"int4" codes with their scales."""

    group_tokens: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    align_bytes: int = 4096
    record_dtype: str = "auto"

    @classmethod
    def padded(cls, group_tokens: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, record_dtype: str,
               page_bytes: int, block_bytes: int | None = None) -> "RecordLayout":
        """The layout whose records pad as ``record_align_bytes`` says from the disk's ``block_bytes`` (None: to
        whole ``page_bytes``)."""
        record = cls(group_tokens, n_kv_heads, head_dim, dtype, 1, record_dtype).record_bytes
        align = page_bytes if block_bytes is None else record_align_bytes(record, page_bytes, block_bytes)
        return cls(group_tokens, n_kv_heads, head_dim, dtype, align, record_dtype)

    @cached_property
    def codec(self):
        return record_codec(self.record_dtype, self.n_kv_heads, self.group_tokens, self.head_dim, self.dtype)

    @property
    def record_bytes(self) -> int:
        return self.codec.record_bytes

    @property
    def stride_bytes(self) -> int:
        return -(-self.record_bytes // self.align_bytes) * self.align_bytes

    def typed(self, records: np.ndarray) -> torch.Tensor:
        """View uint8 records [..., stride] of a float format as [..., 2, H_kv, G, d] tensors (no copy)."""
        if not isinstance(self.codec, FloatRecord):
            raise TypeError(f"{self.record_dtype} records hold codes, not floats: decode them with RecordLayout.decode")
        return self.codec.decode(torch.from_numpy(records), self.codec.dtype)

    def decode(self, records: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 records [..., stride] -> KV [..., 2, H_kv, G, d] in ``dtype`` (dequantised when quantized)."""
        return self.codec.decode(torch.as_tensor(records), dtype)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
        """k, v [H_kv, n*G, d] -> aligned records [n, stride] ready for an O_DIRECT write."""
        n = k.shape[1] // self.group_tokens
        out = aligned_zeros((n, self.stride_bytes), self.align_bytes)
        if n == 0:  # a prompt shorter than a group: its tokens wait in the window until the group fills
            return out
        grouped = [t.reshape(self.n_kv_heads, n, self.group_tokens, self.head_dim).transpose(0, 1).cpu() for t in (k, v)]
        self.codec.encode_into(torch.from_numpy(out), *grouped)
        return out


def record_align_bytes(record_bytes: int, page_bytes: int, block_bytes: int) -> int:
    """The alignment a record of ``record_bytes`` pads to (``RecordLayout.align_bytes``): the smallest power of two
    that holds it, at least the disk's ``block_bytes`` (its O_DIRECT unit) and at most ``page_bytes`` (a record that
    long pads to whole pages).  So padded, a record never straddles a page (on this machine's disk records across 4
    KiB boundaries read far slower than their count says), and one far smaller than a page
    does not take a whole one on disk and in the slots (SmolLM2's int4 records of 4 tokens: 1,584 bytes, 2 KiB a slot
    instead of 4)."""
    align = min(block_bytes, page_bytes)
    while align < min(record_bytes, page_bytes):
        align *= 2
    return min(align, page_bytes)


def open_maybe_direct(path: Path, flags: int, mode: int = 0o600, direct: bool = True) -> tuple[int, bool]:
    """(fd, True) opened with O_DIRECT, or (fd, False) buffered when ``direct`` is off or the filesystem refuses
    O_DIRECT (EINVAL, e.g. tmpfs); any other error surfaces as itself.  Callers decide whether to warn."""
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def check_kv_path(root) -> Path:
    """The KV folder (``kv_path``) must exist and be writable; nothing is created here."""
    if root is None:
        raise StoreError("kv_path is required for the disk policies (kvswap, token, flexgen, hillinfer); pass a folder on the KV disk")
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise KVDiskError(errno.ENOTDIR, f"kv_path {root} is a file, not a folder: point kv_path (--kv-path) at a "
                                         "folder on the disk that should hold the KV cache")
    if not root.is_dir():
        raise KVDiskError(errno.ENOENT, f"kv_path {root} does not exist; create it (on the disk that should hold the "
                                        "KV cache)")
    if os.statvfs(root).f_flag & os.ST_RDONLY:
        raise KVDiskError(errno.EROFS, f"kv_path {root} is on a read-only filesystem; remount it read-write or pick "
                                       "a folder on a writable disk")
    if not os.access(root, os.W_OK | os.X_OK):
        raise KVDiskError(errno.EACCES, f"kv_path {root} is not writable by this user; pick a writable folder")
    return root


def remove_dead_sequences(root: Path) -> list[Path]:
    """Remove the KV folders (``edgekv-<pid>-<id>``) of processes that no longer run, e.g. killed mid-decode: their
    files are nobody's.  A live process's folder, this one's included, is never touched (a reused pid keeps it)."""
    removed = []
    for entry in root.glob("edgekv-*-*"):
        pid = entry.name.split("-")[1]
        if entry.is_symlink() or not entry.is_dir():  # not a folder edgekv made: never followed, never counted
            continue
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    if removed:
        log.info("removed the KV files of %d dead process(es) under %s", len(removed), root)
    return removed


def kv_path_list(paths) -> list:
    """One KV path (str or Path), a list of them, or None -> a list (empty for None)."""
    if paths is None:
        return []
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


class DiskKVStore:
    """Creates, writes, reads and removes the per-sequence, per-layer KV files under one root per KV path.

    With several paths (devices) each (sequence, layer) has one file per path and a ``Placement`` says
    which records each holds (runtime/placement.py).  A step's reads are routed to the least-loaded copy
    and adjacent records of one file become one request of at most ``max_request_bytes`` (``batch``); so do
    records at most ``gap_bytes`` apart, the gap read and dropped: on a disk where a request costs as much as
    reading that many bytes more (virtio, SATA), fewer requests outweigh the extra bytes.
    """

    def __init__(self, roots, n_layers: int, layout: RecordLayout, reader: KVReader, max_groups: int = 1 << 20,
                 max_request_bytes: int | None = None, verify_fraction: float = 1.0, gap_bytes: int = 0,
                 backend: Backend | None = None):
        """``backend``: whose request planning it takes (runtime/kernels.py: the native one's or numpy's; None: the
        CPU's)."""
        self.roots = [check_kv_path(root) for root in kv_path_list(roots) or [None]]
        for root in self.roots:
            remove_dead_sequences(root)
        if len({r.resolve() for r in self.roots}) != len(self.roots):
            raise StoreError(f"KV paths {[str(r) for r in self.roots]} name one folder twice; list each path once")
        self.root = self.roots[0]
        self.layout = layout
        self.n_layers = n_layers
        self.max_groups = max_groups
        self.reader = reader
        name = f"edgekv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dirs = [root / name for root in self.roots]
        self.dir = self.dirs[0]
        self.max_request_records = max(1, (max_request_bytes or layout.stride_bytes) // layout.stride_bytes)
        self.gap_records = gap_bytes // layout.stride_bytes  # a gap read through: cheaper than a request more
        self._gaps: np.ndarray | None = None  # the gap sink, made on first need
        self.o_direct: bool | None = None
        self._fds = np.full((0, n_layers, self.n_paths), -1, dtype=np.int32)  # [sequence, layer, path], -1 closed
        self._placement: dict[int, Placement] = {}
        self._prefix: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # seq -> (blob fds, groups per blob, groups)
        self._shared: dict[int, tuple[int, int]] = {}  # borrower seq -> (owner seq, groups it reads from the owner)
        self._held: set[int] = set()  # released sequences whose files borrowers still read
        self._moved: dict[tuple[int, int], np.ndarray] = {}  # (seq, layer) -> stored-prefix groups relocated here
        self.bytes_written = 0
        self.requests = 0
        self.records_read = 0
        self.gap_records_read = 0  # read only to bridge a gap between wanted records, and dropped
        self.records_by_path = np.zeros(self.n_paths, dtype=np.int64)
        self.records_relocated = 0
        self.verify_fraction = verify_fraction
        self._sums: dict[int, np.ndarray] = {}  # seq -> uint32 [layer, group]: each written record's checksum
        self._sum_tables: tuple[np.ndarray, np.ndarray] | None = None  # their addresses and row bytes by sequence
        self.tables_version = 0  # moves when the files' or checksums' tables move (native_plan_fields)
        self._tabled = np.zeros(n_layers, dtype=bool)  # layers some sequence laid out (place) or relocated
        self._rng = np.random.default_rng()
        self.records_verified = 0
        self.records_reread = 0  # failed once, then read back intact (a transient fault)
        self._checks_lock = threading.Lock()  # the two counters above (and bytes_written) grow on several threads
        self._writers: ThreadPoolExecutor | None = None  # a flush's writes in flight together (write_layers)
        self._requests_lib = (backend or resolve_backend("cpu")).lib("requests")
        self._requests = self._requests_numpy if self._requests_lib is None else self._planned

    @property
    def n_paths(self) -> int:
        return len(self.roots)

    @property
    def table_bytes(self) -> int:
        """Memory of the placement tables (clustered layers only) and of the checksums."""
        return sum(p.table_bytes for p in self._placement.values()) + sum(s.nbytes for s in self._sums.values())

    def _open(self, path: Path) -> int:
        try:
            fd, direct = open_maybe_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, direct=self.o_direct is not False)
        except OSError as exc:
            raise _disk_failure(exc, f"creating the KV file {path}") from exc
        if not direct and self.o_direct is not False:
            log.warning("O_DIRECT refused on %s: falling back to buffered I/O, "
                        "so reads may come from the page cache rather than the disk", path.parent.parent)
        self.o_direct = direct
        return fd

    def _path(self, seq: int, layer: int, path: int = 0) -> Path:
        return self.dirs[path] / f"seq{seq}_layer{layer}.kv"

    def open_sequence(self, seq: int) -> None:
        if seq in self._held:
            raise StoreError(f"sequence {seq} still lends its KV to {self._borrowers(seq)}: release those first")
        self.release(seq)
        for d in self.dirs:
            try:
                d.mkdir(exist_ok=True)
            except OSError as exc:
                raise _disk_failure(exc, f"creating the KV folder {d}") from exc
        if seq >= len(self._fds):
            grown = np.full((seq + 1, self.n_layers, self.n_paths), -1, dtype=np.int32)
            grown[: len(self._fds)] = self._fds
            self._fds = grown
        self._placement[seq] = Placement(self.n_layers, self.max_groups, self.n_paths)
        if self.verify_fraction > 0:
            self._sums[seq] = np.zeros((self.n_layers, self.max_groups), dtype=np.uint32)
        self._tables_moved()
        for layer in range(self.n_layers):  # recorded one by one: a failed open leaves the others for release
            for path in range(self.n_paths):
                self._fds[seq, layer, path] = self._open(self._path(seq, layer, path))

    def place(self, seq: int, layer: int, per_path: list[np.ndarray]) -> None:
        """Lay out a layer's first groups before they are written: ``per_path[p]`` the groups path p holds, in
        record order (runtime/cluster.py's layouts); groups written without one are striped in token order."""
        self._placement[seq].assign(layer, per_path)
        self._tabled[layer] = True
        self._tables_moved()

    def attach_prefix(self, seq: int, blobs: list[tuple[Path, int, np.ndarray]]) -> None:
        """Serve the first groups of ``seq`` from stored blobs instead of its own files (no copy).

        ``blobs``: (path, groups, checksums [n_layers, groups] from its trailer) per stored token chunk, in
        order; a blob holds every layer's records, layer-major (the context store's layout), so group g of
        layer l sits in blob g // groups_of_chunk at record l * groups + g % groups_of_chunk.  Writes to
        those groups are skipped from now on.
        """
        fds = []
        try:
            for path, _, _ in blobs:
                fds.append(open_maybe_direct(Path(path), os.O_RDONLY)[0])  # the store's own reads say if it is buffered
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        groups = np.array([g for _, g, _ in blobs], dtype=np.int64)
        self._prefix[seq] = (np.array(fds, dtype=np.int32), groups, int(groups.sum()))
        self._tables_moved()
        if seq in self._sums and blobs:
            self._sum_table(seq, int(groups.sum()))[:, : int(groups.sum())] = np.concatenate([s for _, _, s in blobs], axis=1)

    def _sum_table(self, seq: int, n_groups: int) -> np.ndarray:
        """``seq``'s checksums [layer, group], grown when a write goes past ``max_groups`` (never in the engine)."""
        table = self._sums[seq]
        if n_groups > table.shape[1]:
            grown = np.zeros((self.n_layers, max(n_groups, 2 * table.shape[1])), dtype=np.uint32)
            grown[:, : table.shape[1]] = table
            table = self._sums[seq] = grown
            self._tables_moved()
        return table

    def share_prefix(self, seq: int, owner: int, n_groups: int) -> None:
        """``seq``'s first ``n_groups`` groups are ``owner``'s (same tokens, same KV): reads of them name the
        owner, and ``seq`` never writes them.  The owner's files stay until every borrower is released."""
        if owner == seq or owner in self._shared:
            raise StoreError(f"sequence {seq} cannot borrow from {owner}: an owner lends its own groups only")
        self._shared[seq] = (owner, n_groups)

    def prefix_groups(self, seq: int) -> int:
        """Leading groups of ``seq`` held elsewhere (a stored context's blobs or a sharing owner): never written."""
        stored = self._prefix[seq][2] if seq in self._prefix else 0
        return max(stored, self._shared[seq][1] if seq in self._shared else 0)

    def write_groups(self, seq: int, layer: int, first_group: int, records: np.ndarray) -> None:
        """Write aligned records [n, stride] as groups first_group .. first_group+n-1 at their placement (striped
        in token order unless laid out by ``place``); groups held elsewhere (``prefix_groups``) are skipped."""
        for fd, run, offset in self._write_runs(seq, layer, first_group, records):
            self._pwrite(fd, run, offset)

    def write_layers(self, seq: int, first_group: int, records: np.ndarray) -> None:
        """``write_groups`` for every layer at once, records [n_layers, n, stride]: a decode step's flush, one record
        a layer each in its own file, whose writes are in flight together (one after another, each waited for, 30
        O_DIRECT writes took ~4 ms of a batch 4 step from this machine's disk).  Returns once all landed; the first
        failed write's error is raised, after every write finished."""
        runs = self._striped_runs(seq, first_group, records)
        if runs is None:
            runs = [run for layer in range(records.shape[0])
                    for run in self._write_runs(seq, layer, first_group, records[layer])]
        if len(runs) < 2:
            for run in runs:
                self._pwrite(*run)
            return
        if self._writers is None:
            self._writers = ThreadPoolExecutor(max_workers=WRITES_IN_FLIGHT, thread_name_prefix="ekv-write")
        futures = [self._writers.submit(self._pwrite, *run) for run in runs]
        wait(futures)
        for future in futures:  # in order: the lowest layer's failure is the one raised
            future.result()

    def _striped_runs(self, seq: int, first_group: int, records: np.ndarray
                      ) -> list[tuple[int, np.ndarray, int]] | None:
        """``_write_runs`` of every layer at once, records [n_layers, n, stride], where every layer's groups are
        striped and none is held elsewhere and each layer's records are one run (one path, or one record: a decode
        flush); None elsewhere.  The checksums in one call, where 30 layers' numpy glue cost ~5 ms a flush."""
        n_layers, n = records.shape[:2]
        placement = self._placement[seq]
        if (n != 1 and self.n_paths != 1) or first_group < self.prefix_groups(seq) or not placement.all_striped():
            return None
        groups = np.arange(first_group, first_group + n)
        if seq in self._sums:
            sums = record_sums(records.reshape(n_layers * n, -1), self.layout.record_bytes,
                               np.repeat(np.arange(n_layers), n), np.tile(groups, n_layers))
            self._sum_table(seq, first_group + n)[:, groups] = sums.reshape(n_layers, n)
        for layer in range(n_layers):
            placement.stripe(layer, groups)
        paths, indexes = placement.copies(0, groups[:1])  # every layer's run where layer 0's first record goes
        path, offset = int(paths[0, 0]), int(indexes[0, 0]) * self.layout.stride_bytes
        return [(int(self._fds[seq, layer, path]), records[layer], offset) for layer in range(n_layers)]

    def _write_runs(self, seq: int, layer: int, first_group: int, records: np.ndarray
                    ) -> list[tuple[int, np.ndarray, int]]:
        """(fd, records, offset) of each contiguous run ``write_groups`` writes; the checksums and placement are
        recorded here."""
        skip = max(0, min(self.prefix_groups(seq) - first_group, records.shape[0]))
        records, first_group = records[skip:], first_group + skip
        if records.shape[0] == 0:
            return []
        placement = self._placement[seq]
        groups = np.arange(first_group, first_group + records.shape[0])
        if seq in self._sums:
            self._sum_table(seq, int(groups[-1]) + 1)[layer, groups] = record_sums(records, self.layout.record_bytes, layer, groups)
        placement.stripe(layer, groups)
        paths, indexes = placement.copies(layer, groups)
        row, copy = np.nonzero(paths >= 0)
        path, index = paths[row, copy], indexes[row, copy]
        order = np.lexsort((index, path))
        row, path, index = row[order], path[order], index[order]
        starts = np.flatnonzero(np.r_[True, (path[1:] != path[:-1]) | (index[1:] != index[:-1] + 1)])
        runs = []
        for a, b in zip(starts, np.r_[starts[1:], len(row)]):
            rows = row[a:b]
            run = records[rows[0] : rows[-1] + 1] if np.all(np.diff(rows) == 1) else _aligned_take(records, rows, self.layout.align_bytes)
            runs.append((int(self._fds[seq, layer, path[a]]), run, int(index[a]) * self.layout.stride_bytes))
        return runs

    def _pwrite(self, fd: int, records: np.ndarray, offset: int) -> None:
        """A failed write names the file and what to do (a full disk above all); the caller releases the files."""
        view = memoryview(records.reshape(-1))
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise _disk_failure(exc, f"writing KV records to {_fd_path(fd)}") from exc
        with self._checks_lock:  # writes of one flush run on several threads
            self.bytes_written += len(view)

    def batch(self, layer: int, seqs: np.ndarray, groups: np.ndarray, addresses: np.ndarray) -> ReadBatch:
        """Reads of group records ``groups[i]`` of sequences ``seqs[i]`` (the records' owners) into aligned host
        ``addresses[i]``: each record from its least-loaded copy, adjacent records of a file in one request."""
        batch = self._requests(layer, seqs, groups, addresses)
        self.count_reads(batch, len(seqs))
        return batch

    def count_reads(self, batch: "VerifiedBatch", wanted: int) -> None:
        """A batch of ``wanted`` records planned for reading (``batch``, or the caller's native planning), counted."""
        self.requests += len(batch)
        self.records_read += wanted
        if batch.gap_counts is not None:
            self.gap_records_read += int(batch.gap_counts.sum())
        if self.n_paths == 1:
            self.records_by_path[0] += wanted
        else:
            by_request = batch.counts if batch.gap_counts is None else batch.counts - batch.gap_counts
            self.records_by_path += np.bincount(batch.paths, weights=by_request,
                                                minlength=self.n_paths).astype(np.int64)

    def read_stats(self) -> dict:
        """What the store read (the policy's stats keys): requests, records by path, checks, gap records."""
        return {"o_direct": self.o_direct, "n_paths": self.n_paths, "kv_read_requests": self.requests,
                "kv_records_read": self.records_read, "kv_gap_records_read": self.gap_records_read,
                "kv_records_by_path": self.records_by_path.tolist(), "kv_records_verified": self.records_verified,
                "kv_records_reread": self.records_reread}

    def relocate(self, seq: int, layer: int, per_path: list[np.ndarray], in_memory=None) -> None:
        """Write the listed groups of ``seq`` again, appended to each path in the given order (a clustering found
        while decoding: co-activated groups become one request), and read them from there on.  ``in_memory``
        (groups -> (held mask, their records)) supplies records already resident, so only the rest are read.
        Call between steps, with no read of this layer in flight."""
        groups = np.concatenate([np.asarray(g, dtype=np.int64) for g in per_path])
        if len(groups) == 0:
            return
        stride = self.layout.stride_bytes
        records = aligned_zeros((len(groups), stride), self.layout.align_bytes)
        held = np.zeros(len(groups), dtype=bool)
        if in_memory is not None:
            held, resident = in_memory(groups)
            records[held] = resident
        rows = np.flatnonzero(~held)
        addresses = address(records) + rows * stride
        self.read(self._requests(layer, np.full(len(rows), seq), groups[rows], addresses))
        path, index = self._placement[seq].move(layer, per_path)
        self._tabled[layer] = True
        self._tables_moved()
        if seq in self._prefix:  # a stored context's groups are read from here from now on, not from its blobs
            self._moved.setdefault((seq, layer), np.zeros(self.max_groups, dtype=bool))[groups] = True
        starts = np.flatnonzero(np.r_[True, path[1:] != path[:-1]])  # one contiguous run per path
        for a, b in zip(starts, np.r_[starts[1:], len(groups)]):
            self._pwrite(int(self._fds[seq, layer, path[a]]), records[a:b], int(index[a]) * stride)
        self.records_relocated += len(groups)

    def _planned(self, layer: int, seqs: np.ndarray, groups: np.ndarray, addresses: np.ndarray) -> ReadBatch:
        """``_requests`` with the native planner: one call where the layer's tables allow it (``_native_requests``),
        numpy's steps where they do not."""
        seqs, groups = np.asarray(seqs, dtype=np.int64), np.asarray(groups, dtype=np.int64)
        planned = self._native_requests(layer, seqs, groups, addresses)
        return self._requests_numpy(layer, seqs, groups, addresses) if planned is None else planned

    def _requests_numpy(self, layer: int, seqs: np.ndarray, groups: np.ndarray, addresses: np.ndarray) -> ReadBatch:
        """One decode layer's reads as sorted requests (the reference the native planner is tested against); called
        twice a layer on the compute thread (the picks, then a correction's), so a batch of one sequence with single
        copies takes no per-sequence or per-record steps."""
        seqs, groups = np.asarray(seqs, dtype=np.int64), np.asarray(groups, dtype=np.int64)
        n = len(seqs)
        stride = self.layout.stride_bytes
        fds = np.empty(n, dtype=np.int32)
        offsets = np.empty(n, dtype=np.int64)
        paths = np.zeros(n, dtype=np.int32)
        owners = [] if n == 0 else [int(seqs[0])] if (seqs == seqs[0]).all() else np.unique(seqs).tolist()
        copies = []  # (sequence, its read indices, path [k, R], index [k, R]) of the reads not from a stored blob
        for seq in owners:
            mine = np.arange(n) if len(owners) == 1 else np.flatnonzero(seqs == seq)
            if seq in self._prefix:
                blob_fds, blob_groups, n_prefix = self._prefix[seq]
                hit = groups[mine] < n_prefix
                if (seq, layer) in self._moved:
                    hit &= ~self._moved[seq, layer][groups[mine]]
                if hit.any():
                    per_blob = int(blob_groups[0])  # every blob but the last holds a full chunk
                    g = groups[mine[hit]]
                    t, within = g // per_blob, g % per_blob
                    fds[mine[hit]] = blob_fds[t]
                    offsets[mine[hit]] = (layer * blob_groups[t] + within) * stride
                    mine = mine[~hit]
            path, index = self._placement[seq].copies(layer, groups[mine])
            copies.append((seq, mine, path, index))
        replicated = [np.flatnonzero(path[:, 1] >= 0) for _, _, path, _ in copies]
        load = np.zeros(self.n_paths, dtype=np.int64)
        if any(len(r) for r in replicated):  # Swarm's buckets: records with one copy first, replicated ones after
            for _, mine, path, _ in copies:
                load += np.bincount(path[path[:, 1] < 0, 0], minlength=self.n_paths)
        for (seq, mine, path, index), twins in zip(copies, replicated):
            pick = np.zeros(len(mine), dtype=np.int64)
            for i in twins.tolist():
                pick[i] = int(load[path[i, 1]] < load[path[i, 0]])
                load[path[i, pick[i]]] += 1
            chosen = path[:, 0] if len(twins) == 0 else path[np.arange(len(mine)), pick]
            fds[mine] = self._fds[seq, layer, chosen]
            offsets[mine] = (index[:, 0] if len(twins) == 0 else index[np.arange(len(mine)), pick]) * stride
            paths[mine] = chosen
        order = np.argsort((fds.astype(np.int64) << 40) | (offsets // stride), kind="stable")  # by file, then offset
        fds, offsets, paths, addresses = fds[order], offsets[order], paths[order], np.asarray(addresses)[order]
        gaps = gap_sizes(offsets, stride)
        starts = request_starts(fds, offsets, stride, self.max_request_records, self.gap_records, gaps)
        counts = np.empty(len(starts), dtype=np.int32)
        if len(starts):
            counts[:-1], counts[-1] = starts[1:] - starts[:-1], n - starts[-1]
        seqs, groups = seqs[order], groups[order]
        check = np.ones(n, dtype=bool) if self.verify_fraction >= 1 else self._rng.random(n) < self.verify_fraction
        expected = np.zeros(n, dtype=np.uint32)
        for seq in owners if self.verify_fraction > 0 else ():
            mine = check if len(owners) == 1 else check & (seqs == seq)
            expected[mine] = self._sums[seq][layer, groups[mine]]
        gaps[starts] = 0  # a request's first record bridges nothing; the others at most gap_records each
        if not gaps.any():
            return VerifiedBatch(fds[starts], offsets[starts], addresses, stride, counts, paths[starts],
                                 layer, seqs, groups, expected, check)
        # the records of the gaps a request reads through land in the gap sink, unchecked, and are dropped
        at = np.arange(n) + np.cumsum(gaps)  # each wanted record's place among all the records read
        total = n + int(gaps.sum())
        all_addresses = np.full(total, address(self._gap_sink()), dtype=np.int64)
        all_seqs, all_groups = np.full(total, -1, dtype=np.int64), np.full(total, -1, dtype=np.int64)
        all_expected, all_check = np.zeros(total, dtype=np.uint32), np.zeros(total, dtype=bool)
        all_addresses[at], all_seqs[at], all_groups[at], all_expected[at], all_check[at] = (
            addresses, seqs, groups, expected, check)
        gap_counts = np.add.reduceat(gaps, starts).astype(np.int32)
        return VerifiedBatch(fds[starts], offsets[starts], all_addresses, stride, counts + gap_counts, paths[starts],
                             layer, all_seqs, all_groups, all_expected, all_check, gap_counts)

    def _native_requests(self, layer: int, seqs: np.ndarray, groups: np.ndarray, addresses: np.ndarray
                         ) -> VerifiedBatch | None:
        """``_requests`` in one native call (runtime/native/ekv_requests.c: the same batch, array for array) where
        every group of the layer sits in the stripe, no stored context is attached and every record is checked or
        none is; None elsewhere, and where it refuses (a closed file, a sequence without checksums): the numpy path
        then raises the error."""
        n, lib = len(seqs), self._requests_lib
        if not n or not self.plans_natively(layer):
            return None
        files = self.native_plan_fields(layer)
        seqs, groups = np.ascontiguousarray(seqs), np.ascontiguousarray(groups)
        addresses = np.ascontiguousarray(addresses, dtype=np.int64)
        fds, counts, paths, gap_counts = np.empty((4, n), dtype=np.int32)
        offsets = np.empty(n, dtype=np.int64)
        scratch = np.empty(lib.ekv_requests_scratch_bytes(n), dtype=np.uint8)
        total = ctypes.c_int64()
        most = n + (n - 1) * self.gap_records  # every gap bridged
        for capacity in (min(2 * n, most), most):  # room for the records read: rarely more than twice the wanted
            read_addresses, read_seqs, read_groups = np.empty((3, capacity), dtype=np.int64)
            expected, check = np.empty(capacity, dtype=np.uint32), np.empty(capacity, dtype=bool)
            k = lib.ekv_requests_plan(
                n, address(seqs), address(groups), address(addresses), *(files[name] for name in FILE_FIELDS[:5]),
                self.layout.stride_bytes, self.max_request_records, self.gap_records,
                *(files[name] for name in FILE_FIELDS[5:]), address(scratch), address(fds), address(offsets),
                address(counts), address(paths), address(gap_counts), address(read_addresses),
                address(read_seqs), address(read_groups), address(expected), address(check), capacity,
                ctypes.byref(total))
            if k != -2:
                break
        if k < 0:
            return None
        t = total.value
        return VerifiedBatch(fds[:k], offsets[:k], read_addresses[:t], self.layout.stride_bytes, counts[:k], paths[:k],
                             layer, read_seqs[:t], read_groups[:t], expected[:t], check[:t],
                             gap_counts[:k] if t > n else None)

    def plans_natively(self, layer: int) -> bool:
        """Whether ``layer``'s reads may be planned natively (ekv_requests.c): every group in the stripe, no stored
        context attached, every record checked or none."""
        return not (self._prefix or self._tabled[layer]) and (self.verify_fraction >= 1 or self.verify_fraction <= 0)

    def native_plan_fields(self, layer: int) -> dict[str, int]:
        """What ``ekv_requests_plan`` takes of the files and checksums for ``layer`` (runtime/native/ekv_fetch.c's
        job fields), valid until ``tables_version`` moves (a sequence opens or goes, a checksum table grows, a layer is
        laid out or a stored context attached)."""
        table, every = self._fds, self.verify_fraction >= 1
        bases, row_bytes = self._sums_by_sequence() if every else (None, None)
        return {"n_seqs": len(table), "fds": address(table) + layer * table.strides[1],
                "fd_seq_stride": table.strides[0] // 4, "fd_path_stride": table.strides[2] // 4,
                "n_paths": self.n_paths, "check": int(every), "sum_tables": 0 if bases is None else address(bases),
                "sum_row_bytes": 0 if row_bytes is None else address(row_bytes), "layer": layer,
                "sink": address(self._gap_sink())}

    def _sums_by_sequence(self) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's checksum table address and row bytes (0: none), made again once tables moved."""
        if self._sum_tables is None:
            bases, row_bytes = np.zeros((2, len(self._fds)), dtype=np.int64)
            for seq, table in self._sums.items():
                bases[seq], row_bytes[seq] = table.ctypes.data, table.strides[0]
            self._sum_tables = bases, row_bytes
        return self._sum_tables

    def _tables_moved(self) -> None:
        """A sequence's files opened or closed, a checksum table grew, or a layer's reads are planned another way (a
        layout placed or moved, a stored context attached): what was taken of their addresses and ways goes."""
        self._sum_tables = None
        self.tables_version += 1

    def _gap_sink(self) -> np.ndarray:
        """Where every record of a gap read through lands: one record, written over and over, never read (scratch,
        not KV: not in ``table_bytes``)."""
        if self._gaps is None:
            self._gaps = aligned_zeros((1, self.layout.stride_bytes), self.layout.align_bytes)
        return self._gaps

    def read(self, batch: ReadBatch) -> None:
        """A failed read names the KV folder it came from (a device that vanished, an unmounted path); a record
        whose checksum fails is read once more, and if it fails again ``CorruptRecord`` names its file and offset."""
        try:
            self.reader.read(batch)
        except OSError as exc:
            where = self.roots[getattr(exc, "kv_path_index", 0)]
            raise KVDiskError(exc.errno, f"reading KV records from {where} failed ({exc.strerror or exc}); every "
                              "KV path must stay available while its sequences run: check the device, then run "
                              "again") from exc
        if isinstance(batch, VerifiedBatch) and batch.check is not None:
            self._verify(batch)

    def _verify(self, batch: VerifiedBatch) -> None:
        rows = np.flatnonzero(batch.check)
        with self._checks_lock:
            self.records_verified += len(rows)
        record_bytes = self.layout.record_bytes
        found = sums_at(batch.addresses[rows], record_bytes, batch.layer, batch.groups[rows])
        bad = rows[found != batch.expected[rows]]
        if len(bad) == 0:
            return
        starts = record_starts(batch)
        request = np.searchsorted(starts, bad, side="right") - 1
        for i, r in zip(bad.tolist(), request.tolist()):
            fd, offset = int(batch.fds[r]), int(batch.offsets[r]) + (i - int(starts[r])) * batch.nbytes
            address, seq, group = int(batch.addresses[i]), int(batch.seqs[i]), int(batch.groups[i])
            self.reader.read(ReadBatch(np.array([fd], dtype=np.int32), np.array([offset], dtype=np.int64),
                                       np.array([address], dtype=np.int64), batch.nbytes))
            if sums_at(np.array([address]), record_bytes, batch.layer, [group])[0] == batch.expected[i]:
                with self._checks_lock:
                    self.records_reread += 1
                log.warning("KV record %d of %s failed its checksum, then read back intact (a transient fault)",
                            offset // batch.nbytes, _fd_path(fd))
                continue
            blob = seq in self._prefix and fd in self._prefix[seq][0]
            path = _fd_path(fd)
            raise CorruptRecord(
                f"KV record {offset // batch.nbytes} (offset {offset}) of {path} (sequence {seq}, layer {batch.layer}, "
                f"group {group}) failed its checksum twice: the bytes on disk are not those written; it was not used. "
                + ("The stored context's chunk is dropped and computed again" if blob else
                   "The sequence is computed again from its tokens; if this repeats, check the device"),
                path, offset // batch.nbytes, seq, batch.layer, group, Path(path).stem if blob else None)

    def _borrowers(self, owner: int) -> list[int]:
        return [seq for seq, (o, _) in self._shared.items() if o == owner]

    def release(self, seq: int) -> None:
        """Close and delete one sequence's files; each fd is forgotten before it is closed, so none is closed twice.
        An attached prefix's blobs are closed, never deleted (the context store owns them).  A sequence others
        borrow from keeps its files until the last of them is released."""
        owner = self._shared.pop(seq, (None, 0))[0]
        if self._borrowers(seq):
            self._held.add(seq)
            return
        self._held.discard(seq)
        blob_fds = self._prefix.pop(seq, (np.zeros(0, np.int32),))[0]
        for fd in blob_fds.tolist():
            os.close(fd)
        self._placement.pop(seq, None)
        self._sums.pop(seq, None)
        self._tables_moved()
        self._moved = {key: moved for key, moved in self._moved.items() if key[0] != seq}
        if seq < len(self._fds):
            for layer, path in zip(*np.nonzero(self._fds[seq] >= 0)):
                fd, self._fds[seq, layer, path] = int(self._fds[seq, layer, path]), -1
                os.close(fd)
                self._path(seq, int(layer), int(path)).unlink(missing_ok=True)
        if owner in self._held and not self._borrowers(owner):
            self.release(owner)

    def close(self) -> None:
        try:
            self._shared.clear()
            for seq in range(len(self._fds)):
                self.release(seq)
        finally:
            if self._writers is not None:  # idle: write_layers waits for its writes
                self._writers.shutdown()
            for d in self.dirs:
                shutil.rmtree(d, ignore_errors=True)


def _disk_failure(exc: OSError, what: str) -> KVDiskError:
    """``what`` (creating or writing KV files) failed with ``exc``: the error naming it, the cause and the fix."""
    return KVDiskError(exc.errno, f"{what} failed ({exc.strerror or exc}): {disk_fix(exc.errno)}")


def _fd_path(fd: int) -> str:
    """The file behind an open fd, for messages (Linux); the fd number elsewhere."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


def _aligned_take(records: np.ndarray, rows: np.ndarray, align: int) -> np.ndarray:
    out = aligned_zeros((len(rows), records.shape[1]), align)
    np.take(records, rows, axis=0, out=out)
    return out


def request_starts(fds: np.ndarray, offsets: np.ndarray, stride: int, max_records: int, gap_records: int = 0,
                   gaps: np.ndarray | None = None) -> np.ndarray:
    """First read of each request over reads sorted by (fd, offset): a request continues while the next record is in
    the same file at most ``gap_records`` records past the one before (the gap is read too, and dropped), as long as
    the request spans at most ``max_records`` records (a longer run is cut on a grid from its first record: never
    over the cap, at times one request more than cutting where each request fills).  ``gaps``: ``gap_sizes`` of the
    offsets, when the caller has them."""
    n = len(fds)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    gaps = gap_sizes(offsets, stride) if gaps is None else gaps
    breaks = np.empty(n, dtype=bool)
    breaks[0] = True
    breaks[1:] = (fds[1:] != fds[:-1]) | (gaps[1:] < 0) | (gaps[1:] > gap_records)
    first = np.flatnonzero(breaks)
    last = np.empty_like(first)
    last[:-1], last[-1] = first[1:] - 1, n - 1
    if ((offsets[last] - offsets[first]) // stride < max_records).all():  # none does (offsets rise within a run)
        return first
    span = (offsets - np.repeat(offsets[first], last - first + 1)) // stride  # records past the run's first
    piece = span // max_records
    breaks[1:] |= piece[1:] != piece[:-1]
    return np.flatnonzero(breaks)


def gap_sizes(offsets: np.ndarray, stride: int) -> np.ndarray:
    """int64 [n]: records between each sorted read and the one before (-1: the same record again; 0 at the first)."""
    gaps = np.zeros(len(offsets), dtype=np.int64)
    gaps[1:] = np.diff(offsets) // stride - 1
    return gaps
