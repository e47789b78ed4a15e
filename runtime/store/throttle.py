"""A store backend seen through a slower link, to measure TTFT at a given (and dropping) bandwidth.

Pacing is a virtual link: each read's bytes, once actually read, occupy the link for
bytes / rate seconds after the previous read's bytes (no credit builds up while idle), and
the reader sleeps until its bytes are through.  Concurrent readers share the one link.
"""
from __future__ import annotations

import threading
import time

import numpy as np

MIB = 2**20


class ThrottledBackend:
    def __init__(self, backend, rate_mib_s: float, drop_at_s: float | None = None, drop_factor: float = 0.5,
                 clock=time.monotonic, sleep=time.sleep):
        if rate_mib_s <= 0 or drop_factor <= 0:
            raise ValueError(f"rate_mib_s ({rate_mib_s}) and drop_factor ({drop_factor}) must be > 0")
        self.backend = backend
        self.rate_bytes_s = rate_mib_s * MIB
        self.drop_at_s = drop_at_s
        self.drop_factor = drop_factor
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._free_at = 0.0  # when the link has sent every byte reserved so far
        self.bytes_read = 0
        self.slept_s = 0.0

    def start(self) -> None:
        """Time zero for ``drop_at_s`` (and an idle link); without it the first read starts the clock."""
        with self._lock:
            self._t0 = self._free_at = self._clock()

    def rate_at(self, t: float) -> float:
        """Link rate in bytes/s at clock time t."""
        dropped = self.drop_at_s is not None and self._t0 is not None and t >= self._t0 + self.drop_at_s
        return self.rate_bytes_s * (self.drop_factor if dropped else 1.0)

    def _send_until(self, begin: float, nbytes: int) -> float:
        """When nbytes starting at ``begin`` are through, crossing the rate drop if it falls in between."""
        end = begin + nbytes / self.rate_at(begin)
        if self.drop_at_s is None or self.rate_at(begin) != self.rate_bytes_s:
            return end
        drop = self._t0 + self.drop_at_s
        if end <= drop:
            return end
        sent = (drop - begin) * self.rate_bytes_s
        return drop + (nbytes - sent) / (self.rate_bytes_s * self.drop_factor)

    def read_range(self, blob: str, offset: int, nbytes: int, out: np.ndarray) -> None:
        """The link carries the bytes from the moment the read starts, so the backend's own time (the disk
        read under it) overlaps the transfer instead of adding to it: a fast backend sees the rate."""
        began = self._clock()
        self.backend.read_range(blob, offset, nbytes, out)
        with self._lock:
            if self._t0 is None:
                self._t0 = self._free_at = began
            self._free_at = self._send_until(max(began, self._free_at), nbytes)
            self.bytes_read += nbytes
            done_at = self._free_at
        wait = done_at - self._clock()
        if wait > 0:
            with self._lock:
                self.slept_s += wait
            self._sleep(wait)

    def read_file(self, rel: str) -> bytes | None:
        return self.backend.read_file(rel)  # index and id lists: small, not paced

    def __getattr__(self, name):
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)
