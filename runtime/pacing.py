"""A virtual link: what an emulated slower device or network lets through, and when.

Bytes occupy the link for bytes / rate seconds after the previous bytes, plus 1 / iops per
request; an idle link builds no credit (a burst after a pause waits like any other).  The
rate may step at given clock times (a bandwidth drop).  Thread-safe: concurrent readers
queue on the one link.  Clock and sleep are injectable so tests run on a fake clock.
"""
from __future__ import annotations

import bisect
import math
import threading
import time

MIB = 2**20


class Link:
    def __init__(self, rate_bytes_s: float | None = None, iops: float | None = None,
                 clock=time.monotonic, sleep=time.sleep):
        """``rate_bytes_s`` None: bytes pass at once; ``iops`` None: requests cost nothing."""
        for name, value in (("rate_bytes_s", rate_bytes_s), ("iops", iops)):
            if value is not None and value <= 0:
                raise ValueError(f"Link {name} must be > 0 or None (unlimited), got {value}")
        self.iops = iops
        self.clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._step_at_s = [-math.inf]  # the rate is _step_rate[i] from clock time _step_at_s[i] on
        self._step_rate = [rate_bytes_s]
        self._free_at = -math.inf  # when the link has carried everything reserved so far
        self.bytes = 0
        self.requests = 0
        self.slept_s = 0.0

    def set_rate(self, rate_bytes_s: float | None, from_s: float) -> None:
        """The rate from clock time ``from_s`` on (later steps are dropped)."""
        if rate_bytes_s is not None and rate_bytes_s <= 0:
            raise ValueError(f"Link rate must be > 0 or None (unlimited), got {rate_bytes_s}")
        with self._lock:
            keep = bisect.bisect_left(self._step_at_s, from_s)
            del self._step_at_s[keep:], self._step_rate[keep:]
            self._step_at_s.append(from_s)
            self._step_rate.append(rate_bytes_s)

    def rate_at(self, t: float) -> float | None:
        """Bytes/s at clock time t (None: unlimited)."""
        with self._lock:
            return self._step_rate[bisect.bisect_right(self._step_at_s, t) - 1]

    def idle_from(self, t: float) -> None:
        """Nothing is queued on the link before clock time t."""
        with self._lock:
            self._free_at = t

    def _through(self, begin: float, nbytes: int) -> float:
        """When nbytes sent from ``begin`` are through, crossing every rate step on the way."""
        i = bisect.bisect_right(self._step_at_s, begin) - 1
        t, left = begin, float(nbytes)
        while left > 0:
            rate = self._step_rate[i]
            if rate is None:
                return t
            step_end = self._step_at_s[i + 1] if i + 1 < len(self._step_at_s) else math.inf
            if t + left / rate <= step_end:
                return t + left / rate
            left -= (step_end - t) * rate
            t, i = step_end, i + 1
        return t

    def reserve(self, nbytes: int, requests: int = 1, began: float | None = None) -> float:
        """Queue ``requests`` of ``nbytes`` in all, arrived at ``began`` (default now); returns when they are through."""
        with self._lock:
            start = max(self.clock() if began is None else began, self._free_at)
            if self.iops is not None:
                start += requests / self.iops
            self._free_at = self._through(start, nbytes)
            self.bytes += nbytes
            self.requests += requests
            return self._free_at

    def wait_until(self, t: float) -> float:
        """Sleep until clock time t; returns the seconds slept."""
        wait_s = t - self.clock()
        if wait_s <= 0:
            return 0.0
        with self._lock:
            self.slept_s += wait_s
        self._sleep(wait_s)
        return wait_s

    def carry(self, nbytes: int, requests: int = 1, began: float | None = None) -> float:
        """Reserve, then sleep until the bytes are through; returns the seconds slept."""
        return self.wait_until(self.reserve(nbytes, requests, began))
