"""A store backend seen through a slower link, to measure TTFT at a given (and dropping) bandwidth.

Pacing is a virtual link (runtime/pacing.py): each read's bytes, once actually read, occupy
the link for bytes / rate seconds after the previous read's bytes (no credit builds up while
idle), and the reader sleeps until its bytes are through.  Concurrent readers share the one link.
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np

from ..pacing import MIB, Link


class ThrottledBackend:
    def __init__(self, backend, rate_mib_s: float, drop_at_s: float | None = None, drop_factor: float = 0.5,
                 clock=time.monotonic, sleep=time.sleep):
        if rate_mib_s <= 0 or drop_factor <= 0:
            raise ValueError(f"rate_mib_s ({rate_mib_s}) and drop_factor ({drop_factor}) must be > 0")
        self.backend = backend
        self.rate_bytes_s = rate_mib_s * MIB
        self.drop_at_s = drop_at_s
        self.drop_factor = drop_factor
        self.link = Link(self.rate_bytes_s, clock=clock, sleep=sleep)
        self._start_lock = threading.Lock()
        self._t0: float | None = None

    @property
    def bytes_read(self) -> int:
        return self.link.bytes

    @property
    def slept_s(self) -> float:
        return self.link.slept_s

    def start(self) -> None:
        """Time zero for ``drop_at_s`` (and an idle link); without it the first read starts the clock."""
        with self._start_lock:
            self._start_at(self.link.clock())

    def _start_at(self, t0: float) -> None:
        self._t0 = t0
        self.link.idle_from(t0)
        self.link.set_rate(self.rate_bytes_s, -math.inf)  # a restart forgets the previous drop
        if self.drop_at_s is not None:
            self.link.set_rate(self.rate_bytes_s * self.drop_factor, t0 + self.drop_at_s)

    def rate_at(self, t: float) -> float:
        """Link rate in bytes/s at clock time t."""
        return self.link.rate_at(t)

    def read_range(self, blob: str, offset: int, nbytes: int, out: np.ndarray) -> None:
        """The link carries the bytes from the moment the read starts, so the backend's own time (the disk
        read under it) overlaps the transfer instead of adding to it: a fast backend sees the rate."""
        began = self.link.clock()
        self.backend.read_range(blob, offset, nbytes, out)
        with self._start_lock:
            if self._t0 is None:
                self._start_at(began)
        self.link.carry(nbytes, requests=0, began=began)

    def read_file(self, rel: str) -> bytes | None:
        return self.backend.read_file(rel)  # index and id lists: small, not paced

    def __getattr__(self, name):
        if name in ("backend", "link"):
            raise AttributeError(name)
        return getattr(self.backend, name)
