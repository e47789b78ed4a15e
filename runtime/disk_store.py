"""The full KV cache on disk: bytes and offsets, nothing else.

One file per (sequence, layer).  Record g holds tokens [g*G, (g+1)*G) of that layer as
K [H_kv, G, d] followed by V [H_kv, G, d], padded to the O_DIRECT alignment, so one
selected group is one aligned read at offset g * stride_bytes (64-bit).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from .quant import FloatRecord, record_codec
from .reader import KVReader, ReadBatch

log = logging.getLogger(__name__)


class StoreError(OSError):
    """The offload path cannot hold the KV cache; the message says what to fix."""


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
        grouped = [t.reshape(self.n_kv_heads, n, self.group_tokens, self.head_dim).transpose(0, 1).cpu() for t in (k, v)]
        self.codec.encode_into(torch.from_numpy(out), *grouped)
        return out


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


def check_offload_path(root) -> Path:
    """The offload folder must exist and be writable; nothing is created here."""
    if root is None:
        raise StoreError("kv_offload_path is required for the disk policies (kvswap, token, flexgen); pass a folder on the KV disk")
    root = Path(root)
    if not root.is_dir():
        raise StoreError(f"kv_offload_path {root} does not exist; create it (on the disk that should hold the KV cache)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise StoreError(f"kv_offload_path {root} is not writable by this user; pick a writable folder")
    return root


class DiskKVStore:
    """Creates, writes, reads and removes the per-sequence, per-layer KV files under one root."""

    def __init__(self, root: str | Path, n_layers: int, layout: RecordLayout, reader: KVReader):
        self.root = check_offload_path(root)
        self.layout = layout
        self.n_layers = n_layers
        self.reader = reader
        self.dir = root / f"edgekv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.o_direct: bool | None = None
        self._fds = np.full((0, n_layers), -1, dtype=np.int32)  # [sequence, layer] -> fd, -1 when closed
        self._prefix: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # seq -> (blob fds, groups per blob, groups)
        self.bytes_written = 0

    def _open(self, path: Path) -> int:
        fd, direct = open_maybe_direct(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, direct=self.o_direct is not False)
        if not direct and self.o_direct is not False:
            log.warning("O_DIRECT refused on %s: falling back to buffered I/O, "
                        "so reads may come from the page cache rather than the disk", self.root)
        self.o_direct = direct
        return fd

    def _path(self, seq: int, layer: int) -> Path:
        return self.dir / f"seq{seq}_layer{layer}.kv"

    def open_sequence(self, seq: int) -> None:
        self.release(seq)
        self.dir.mkdir(exist_ok=True)
        if seq >= len(self._fds):
            grown = np.full((seq + 1, self.n_layers), -1, dtype=np.int32)
            grown[: len(self._fds)] = self._fds
            self._fds = grown
        for layer in range(self.n_layers):  # recorded one by one: a failed open leaves the others for release
            self._fds[seq, layer] = self._open(self._path(seq, layer))

    def attach_prefix(self, seq: int, blobs: list[tuple[Path, int]]) -> None:
        """Serve the first groups of ``seq`` from stored blobs instead of its own files (no copy).

        ``blobs``: (path, groups) per stored token chunk, in order; a blob holds every layer's records,
        layer-major (the context store's layout), so group g of layer l sits in blob g // groups_of_chunk
        at record l * groups + g % groups_of_chunk.  Writes to those groups are skipped from now on.
        """
        fds = []
        try:
            for path, _ in blobs:
                fds.append(open_maybe_direct(Path(path), os.O_RDONLY)[0])  # the store's own reads say if it is buffered
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        groups = np.array([g for _, g in blobs], dtype=np.int64)
        self._prefix[seq] = (np.array(fds, dtype=np.int32), groups, int(groups.sum()))

    def prefix_groups(self, seq: int) -> int:
        return self._prefix[seq][2] if seq in self._prefix else 0

    def write_groups(self, seq: int, layer: int, first_group: int, records: np.ndarray) -> None:
        """Write aligned records [n, stride] as groups first_group .. first_group+n-1 (those an attached
        prefix holds are already on disk and are skipped)."""
        skip = max(0, min(self.prefix_groups(seq) - first_group, records.shape[0]))
        records, first_group = records[skip:], first_group + skip
        if records.shape[0] == 0:
            return
        fd = int(self._fds[seq, layer])
        offset = first_group * self.layout.stride_bytes
        view = memoryview(records.reshape(-1))
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        self.bytes_written += len(view)

    def batch(self, layer: int, seqs: np.ndarray, groups: np.ndarray, addresses: np.ndarray) -> ReadBatch:
        """Reads of group records ``groups[i]`` of sequences ``seqs[i]`` into aligned host ``addresses[i]``."""
        fds = self._fds[seqs, layer]  # fancy indexing: a copy, safe to edit
        offsets = groups.astype(np.int64) * self.layout.stride_bytes
        for seq in set(self._prefix) & set(np.unique(seqs).tolist()) if self._prefix else ():
            blob_fds, blob_groups, n_prefix = self._prefix[seq]
            hit = (seqs == seq) & (groups < n_prefix)
            if hit.any():
                per_blob = int(blob_groups[0])  # every blob but the last holds a full chunk
                g = groups[hit].astype(np.int64)
                t, within = g // per_blob, g % per_blob
                fds[hit] = blob_fds[t]
                offsets[hit] = (layer * blob_groups[t] + within) * self.layout.stride_bytes
        return ReadBatch(fds, offsets, addresses, self.layout.stride_bytes)

    def read(self, batch: ReadBatch) -> None:
        self.reader.read(batch)

    def release(self, seq: int) -> None:
        """Close and delete one sequence's files; each fd is forgotten before it is closed, so none is closed twice.
        An attached prefix's blobs are closed, never deleted (the context store owns them)."""
        blob_fds = self._prefix.pop(seq, (np.zeros(0, np.int32),))[0]
        for fd in blob_fds.tolist():
            os.close(fd)
        if seq >= len(self._fds):
            return
        for layer in np.flatnonzero(self._fds[seq] >= 0).tolist():
            fd, self._fds[seq, layer] = int(self._fds[seq, layer]), -1
            os.close(fd)
            self._path(seq, layer).unlink(missing_ok=True)

    def close(self) -> None:
        try:
            for seq in range(len(self._fds)):
                self.release(seq)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
