"""Reads from a store folder on this machine: O_DIRECT where the filesystem allows it, so a
chunk read measures (and loads) the disk rather than the page cache, like DiskKVStore."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

from ..disk_store import open_maybe_direct
from .errors import ChunkUnavailable
from .meta import check_blob, check_rel

log = logging.getLogger(__name__)


def byte_view(out: np.ndarray, nbytes: int) -> memoryview:
    """The first ``nbytes`` of a C-contiguous uint8 array as a writable memoryview."""
    if out.dtype != np.uint8 or not out.flags.c_contiguous or out.nbytes < nbytes:
        raise ValueError(f"out must be a contiguous uint8 array of at least {nbytes} bytes (aligned_zeros), "
                         f"got {out.dtype} {out.shape}")
    return memoryview(out.reshape(-1))[:nbytes]


class LocalBackend:
    def __init__(self, root: str | Path, align_bytes: int = 4096):
        self.root = Path(root)
        self.align_bytes = align_bytes
        self.o_direct: bool | None = None  # None until the first aligned read tried it
        self._warn_lock = threading.Lock()

    def blob_path(self, blob: str) -> Path:
        return self.root / "chunks" / f"{check_blob(blob)}.kv"

    def read_file(self, rel: str) -> bytes | None:
        try:
            return (self.root / check_rel(rel)).read_bytes()
        except FileNotFoundError:
            return None

    def _open(self, path: Path, direct: bool) -> tuple[int, bool]:
        fd, is_direct = open_maybe_direct(path, os.O_RDONLY, direct=direct and self.o_direct is not False)
        if direct and self.o_direct is not False:
            with self._warn_lock:
                if not is_direct and self.o_direct is not False:
                    log.warning("O_DIRECT refused on %s: context store reads fall back to buffered I/O, "
                                "so they may come from the page cache rather than the disk", self.root)
                self.o_direct = is_direct
        return fd, is_direct

    def read_range(self, blob: str, offset: int, nbytes: int, out: np.ndarray) -> None:
        """Fill out[:nbytes] with bytes [offset, offset + nbytes) of a blob, or raise ChunkUnavailable."""
        view = byte_view(out, nbytes)
        a = self.align_bytes
        aligned = out.ctypes.data % a == 0 and offset % a == 0 and nbytes % a == 0
        path = self.blob_path(blob)
        try:
            fd, direct = self._open(path, aligned)
        except FileNotFoundError as exc:
            raise ChunkUnavailable(f"chunk {blob[:16]} is not in the store at {self.root} (evicted or removed)") from exc
        except OSError as exc:
            raise ChunkUnavailable(f"cannot open {path}: {exc}") from exc
        try:
            done = 0
            while done < nbytes:
                if direct and done % a:  # an unaligned resume cannot stay O_DIRECT
                    old, fd = fd, -1
                    os.close(old)
                    fd, direct = os.open(path, os.O_RDONLY), False
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:
                    raise ChunkUnavailable(f"chunk {blob[:16]} ends {nbytes - done} bytes short of "
                                           f"[{offset}, {offset + nbytes}) ({path})")
                done += got
        except ChunkUnavailable:
            raise
        except OSError as exc:
            raise ChunkUnavailable(f"reading {path} at {offset}: {exc}") from exc
        finally:
            if fd >= 0:
                os.close(fd)
