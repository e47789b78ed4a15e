"""The reads' threads and their deadline: where a layer's planned reads run, how long the compute thread waits for
them, and what becomes of a read past its deadline (never waited for again; its memory kept until it lands)."""
from __future__ import annotations

import errno
import threading
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout

from ..disk_store import DiskKVStore, KVDiskError
from ..reader import BusyTime, ReadBatch
from ..slot_memory import LAYERS_IN_FLIGHT
from ..slots import Misses

_ABANDONED: dict = {}  # id(future) -> (future, buffers) of reads past their deadline: their memory lives till they land
_ABANDONED_LOCK = threading.Lock()


class ReadIO:
    """Two I/O threads (the layer picked ahead reads beside the one about to attend) and, with corrections, one
    more for a correction's few reads, which hold up their layer's attention and so never queue behind a layer's."""

    def __init__(self, store: DiskKVStore, slot_memory, read_time: BusyTime, deadline_s: float, corrects: bool):
        self.store, self.slot_memory, self.read_time, self.deadline_s = store, slot_memory, read_time, deadline_s
        self._layers = ThreadPoolExecutor(max_workers=LAYERS_IN_FLIGHT, thread_name_prefix="ekv-io")
        self._fixes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ekv-fix") if corrects else None
        self._hung: list[Future] = []  # reads that missed the deadline: never waited for again

    def submit(self, job, *args) -> Future:
        """``job(*args)`` on a layer's I/O thread."""
        return self._layers.submit(job, *args)

    def submit_fix(self, layer: int, buffer: int, misses: Misses, reads: ReadBatch) -> Future:
        """A correction's reads, on its own thread."""
        return self._fixes.submit(self.read, layer, buffer, misses, reads)

    def read(self, layer: int, buffer: int, misses: Misses, reads: ReadBatch, after: threading.Event | None = None
             ) -> None:
        """On an I/O thread: the misses read from disk (checksums checked), then moved where attention reads them.
        ``after`` (with correction): set once the layer before's correction has landed (or needed no reads); that
        layer's few reads hold up its attention, so they go first instead of sharing the disk with this whole
        layer's (sharing: 0.86x the step), and this read starts the moment they land, overlapping that layer's
        attention and MLP (set once that layer had attended instead: down to 0.90x where many layers correct)."""
        if after is not None:
            after.wait(timeout=self.deadline_s)
        self.slot_memory.before_read(layer, buffer)
        self.read_time.begin()
        try:
            self.store.read(reads)
        finally:
            self.read_time.end()
        self.slot_memory.after_read(layer, buffer, misses)

    def wait(self, layer: int, future: Future) -> None:
        """Wait for a read of ``layer``; one past ``read_deadline_s`` fails (and is never waited for again) with the
        KVDiskError of a device that cannot give records back (a server's 503)."""
        try:
            future.result(timeout=self.deadline_s)
        except FutureTimeout:
            self._hung.append(future)
            raise KVDiskError(errno.ETIMEDOUT, f"the KV read of layer {layer} did not finish within read_deadline_s="
                              f"{self.deadline_s:g} s: the KV device under {self.store.root} hangs or is far slower "
                              "than profiled; check it, or raise read_deadline_s") from None

    def close(self, futures: list[Future]) -> list[BaseException]:
        """Reads still in flight finish before the threads go; returns their errors.  A read past its deadline is not
        waited for: its buffers are kept alive until it lands, and the files close under it (the kernel holds them
        for a syscall in progress)."""
        errors = []
        for future in futures:
            if self._hung and future.cancel():  # queued behind a hung read: never started
                continue
            try:
                error = future.exception(timeout=self.deadline_s)
            except FutureTimeout:
                self._hung.append(future)
                continue
            if error is not None:
                errors.append(error)
        hung = [f for f in self._hung if not f.done()]
        for future in hung:
            with _ABANDONED_LOCK:
                _ABANDONED[id(future)] = (future, self.slot_memory)
            future.add_done_callback(_forget_abandoned)
        self._layers.shutdown(wait=not hung)
        if self._fixes is not None:
            self._fixes.shutdown(wait=not hung)
        return errors


def _forget_abandoned(future) -> None:
    with _ABANDONED_LOCK:
        _ABANDONED.pop(id(future), None)
