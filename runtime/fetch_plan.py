"""Planning a layer's fetch apart from moving its bytes: a layer's picks become one ``FetchPlan`` (the picks' flat
slots, the misses, the misses' read batch), made by a planner; the offload pipeline performs it (runtime/offload/)
and the reader moves the bytes (runtime/reader.py).

Two implementations, chosen once when a policy is built (``planner_for``):

- ``CallsPlanner``: the slot table's assignment, the slot memory's addresses and the store's request planning, call
  by call: any slots, any slot memory.
- ``NativePlanner``: the three in one native call a layer (runtime/native/ekv_fetch.c), where the slots are the reuse
  buffer's ``SlotTable`` with a replacement ekv_slots.c keeps and the records land in host slots: the same slots,
  misses and batch, without the Python between the calls.  A layer whose reads the store plans in Python only (a
  stored context attached, records laid out by clustering) is planned call by call; that is known when the store's
  tables move, and a layer's job is made again then.

A planner holds the planning lock: the compute thread and an I/O thread both plan (picks taken on an I/O thread, a
correction's reads), and one plan at a time keeps the slot tables and the store's counters whole.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from typing import NamedTuple

import numpy as np

from .disk_store import DiskKVStore, VerifiedBatch
from .kernels import Backend
from .native_build import address
from .reader import ReadBatch
from .slots import Misses, SlotTable

_I64, _P = ctypes.c_int64, ctypes.c_void_p


class FetchJob(ctypes.Structure):
    """runtime/native/ekv_fetch.h's ``struct ekv_fetch_job``, field for field (checked when the library loads)."""

    _fields_ = [(name, _I64) for name in ("sequences", "batch", "picks", "capacity", "max_groups")] + [
        (name, _P) for name in ("pool", "group_at", "owner_at", "inserted_at", "used_at", "slot_of")] + [
        ("score_kind", _I64)] + [(name, _P) for name in ("clock", "hits", "lookups", "frequency", "cost", "slots",
                                                        "new_owner", "new_slot", "new_group")] + [
        ("slot_base", _I64), ("stride", _I64), ("addresses", _P), ("n_seqs", _I64), ("fds", _P)] + [
        (name, _I64) for name in ("fd_seq_stride", "fd_path_stride", "n_paths", "check")] + [
        ("sum_tables", _P), ("sum_row_bytes", _P), ("layer", _I64), ("sink", _I64)] + [
        (name, _P) for name in ("scratch", "req_fds", "req_offsets", "req_counts", "req_paths", "req_gap_counts",
                                "read_addresses", "read_seqs", "read_groups", "expected", "check_flags")] + [
        ("capacity_records", _I64)]


@functools.cache
def check_job_layout(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (the backend's "fetch" library) once its ``struct ekv_fetch_job`` is found to be ``FetchJob``'s."""
    offsets = np.zeros(lib.ekv_fetch_job_fields(), dtype=np.int64)
    lib.ekv_fetch_job_offsets(address(offsets))
    ours = [getattr(FetchJob, name).offset for name, _ in FetchJob._fields_]
    if lib.ekv_fetch_job_bytes() != ctypes.sizeof(FetchJob) or offsets.tolist() != ours:
        raise RuntimeError("runtime/native/ekv_fetch.h's struct ekv_fetch_job and runtime/fetch_plan.py's FetchJob "
                           "differ: one of the two changed without the other")
    return lib


class FetchPlan(NamedTuple):
    """A layer's picks planned: their flat ``slots`` [B, M] (0 where not valid), the records to read (``misses``), and
    the misses' reads (``reads``, their bytes counted; empty when nothing misses, None for a correction that reads
    nothing: its layer's read job has run already)."""

    slots: np.ndarray
    misses: Misses
    reads: ReadBatch | None


class CallsPlanner:
    """The slot table's assignment, the slot memory's addresses and the store's planning, one call each; each read's
    bytes count against its record's owner in ``bytes_read`` [B], the policy's own array (added to in place)."""

    def __init__(self, slots, slot_memory, store: DiskKVStore, bytes_read: np.ndarray):
        self.slots, self.slot_memory, self.store, self.bytes_read = slots, slot_memory, store, bytes_read
        self.lock = threading.Lock()

    def plan(self, layer: int, groups: np.ndarray, valid: np.ndarray, owners: np.ndarray | None) -> FetchPlan:
        """``layer``'s picks groups, valid [B, M] (``owners`` [B, M] whose record each is; None: each row's own)."""
        with self.lock:
            return self._counted(layer, *self._assign(layer, groups, valid, owners))

    def correct(self, layer: int, groups: np.ndarray, valid: np.ndarray, owners: np.ndarray) -> FetchPlan:
        """A correction's picks of ``layer``, after its own ``plan`` this step: the slots already holding them stay,
        and only the rest read (``Slots.correct``)."""
        with self.lock:
            slots, misses = self.slots.correct(layer, groups, valid, owners)
            return self._counted(layer, slots, misses, None) if len(misses.seq) else FetchPlan(slots, misses, None)

    def _assign(self, layer: int, groups: np.ndarray, valid: np.ndarray, owners: np.ndarray | None
                ) -> tuple[np.ndarray, Misses, ReadBatch | None]:
        """The picks' slots, the misses and, where planned already, their reads (None: the store plans them)."""
        return (*self.slots.assign(layer, groups, valid, owners), None)

    def _counted(self, layer: int, slots: np.ndarray, misses: Misses, reads: ReadBatch | None) -> FetchPlan:
        self.bytes_read += np.bincount(misses.seq, minlength=len(self.bytes_read)) * self.store.layout.stride_bytes
        if reads is None:
            addresses = self.slot_memory.read_addresses(layer, self.slots.buffer_index(layer), misses)
            reads = self.store.batch(layer, misses.seq, misses.group, addresses)
        return FetchPlan(slots, misses, reads)


class LayerJob:
    """One layer's job for picks of one shape, and the buffers it writes (the last step's until the next: a layer's
    reads and attention are done with them by then)."""

    def __init__(self, lib, slots: SlotTable, slot_memory, store: DiskKVStore, layer: int, batch: int, picks: int):
        entries = batch * picks
        self.capacity = entries + (entries - 1) * store.gap_records  # every gap bridged
        self.slots = np.empty((batch, picks), dtype=np.int64)
        self.new = np.empty((4, entries), dtype=np.int64)  # each miss's owner, slot and group, and its address
        self.requests = np.empty((4, entries), dtype=np.int32)  # each request's file, count, path and gap count
        self.offsets = np.empty(entries, dtype=np.int64)
        self.records = np.empty((3, self.capacity), dtype=np.int64)  # each record read's address, sequence, group
        self.expected = np.empty(self.capacity, dtype=np.uint32)
        self.check = np.empty(self.capacity, dtype=bool)
        self.scratch = np.empty(lib.ekv_requests_scratch_bytes(entries), dtype=np.uint8)
        self.counts = np.zeros(2, dtype=np.int64)
        new, requests, records = (address(a) for a in (self.new, self.requests, self.records))
        rows, request_rows, record_rows = 8 * entries, 4 * entries, 8 * self.capacity
        fields = {**slots.native_fields(layer), **store.native_plan_fields(layer),
                  "batch": batch, "picks": picks, "slots": address(self.slots), "new_owner": new,
                  "new_slot": new + rows, "new_group": new + 2 * rows, "addresses": new + 3 * rows,
                  "slot_base": slot_memory.slot_base(slots.buffer_index(layer)), "stride": store.layout.stride_bytes,
                  "scratch": address(self.scratch), "req_fds": requests, "req_counts": requests + request_rows,
                  "req_paths": requests + 2 * request_rows, "req_gap_counts": requests + 3 * request_rows,
                  "req_offsets": address(self.offsets), "read_addresses": records, "read_seqs": records + record_rows,
                  "read_groups": records + 2 * record_rows, "expected": address(self.expected),
                  "check_flags": address(self.check), "capacity_records": self.capacity}
        self.job = FetchJob(**fields)
        self.address = ctypes.addressof(self.job)


class NativePlanner(CallsPlanner):
    """The picks to (slots, misses, their reads) in one native call a layer (runtime/native/ekv_fetch.c)."""

    def __init__(self, lib, slots: SlotTable, slot_memory, store: DiskKVStore, bytes_read: np.ndarray):
        super().__init__(slots, slot_memory, store, bytes_read)
        self._lib = lib
        # (layer, batch, picks) -> (the store's tables_version and gap it was made for, the job; None: the store plans
        # this layer in Python)
        self._jobs: dict[tuple[int, int, int], tuple[int, int, LayerJob | None]] = {}

    def _assign(self, layer, groups, valid, owners):
        store = self.store
        key = (layer, *groups.shape)
        version, gap_records, job = self._jobs.get(key, (None, 0, None))
        if version != store.tables_version or gap_records < store.gap_records:
            job = LayerJob(self._lib, self.slots, self.slot_memory, store, layer, *groups.shape) \
                if store.plans_natively(layer) else None
            self._jobs[key] = (store.tables_version, store.gap_records, job)
        if job is None:
            return super()._assign(layer, groups, valid, owners)
        groups = np.ascontiguousarray(groups, dtype=np.int64)
        valid = np.ascontiguousarray(valid, dtype=bool)
        owners = None if owners is None else np.ascontiguousarray(owners, dtype=np.int64)
        n = self._lib.ekv_fetch_run(job.address, address(groups), address(valid),
                                    None if owners is None else address(owners), store.max_request_records,
                                    store.gap_records, address(job.counts))
        if n < 0:  # refused, nothing changed: a pick outside the table or its pool, which the table's own call names
            return super()._assign(layer, groups, valid, owners)
        misses = Misses(job.new[0, :n], job.new[1, :n], job.new[2, :n])
        k, total = (int(c) for c in job.counts)
        if n == 0 or k < 0:  # nothing to read, or a file or checksum table the store's own planning names
            return job.slots, misses, None
        fds, counts, paths, gap_counts = job.requests[:, :k]
        reads = VerifiedBatch(fds, job.offsets[:k], job.records[0, :total], store.layout.stride_bytes, counts, paths,
                              layer, job.records[1, :total], job.records[2, :total], job.expected[:total],
                              job.check[:total], gap_counts if total > n else None)
        store.count_reads(reads, n)
        return job.slots, misses, reads


def planner_for(backend: Backend, slots, slot_memory, store: DiskKVStore, bytes_read: np.ndarray) -> CallsPlanner:
    """The native planner where the backend has its library and the parts allow it (a slot table whose replacement
    ekv_slots.c keeps, slots in host memory where the reads land), else the calls one by one."""
    lib = backend.lib("fetch")
    if lib is None or not (isinstance(slots, SlotTable) and hasattr(slot_memory, "slot_base")
                           and slots.native_fields(0) is not None):
        return CallsPlanner(slots, slot_memory, store, bytes_read)
    return NativePlanner(check_job_layout(lib), slots, slot_memory, store, bytes_read)
