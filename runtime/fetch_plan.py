"""A layer's picks to its reads in one native call on the decode thread (runtime/native/ekv_fetch.c): the reuse
buffer's slots assigned, the misses' host addresses and their requests planned, where ``SlotTable.assign``, the slot
memory's addresses and ``DiskKVStore.batch`` took two native calls and the Python between them.  It serves where both
native paths would (a replacement ekv_slots.c keeps, no shared prefix, host slots, a store whose layer plans natively)
and gives the same slots, misses and batch; elsewhere the policy takes those calls one by one."""
from __future__ import annotations

import functools
import logging

import numpy as np

from . import native_build
from .disk_store import DiskKVStore, VerifiedBatch
from .native_build import address
from .slots import Misses, SlotTable

log = logging.getLogger(__name__)

# a job's int64 fields in ekv_fetch.c's order (its F_* enum)
FIELDS = ("sequences", "batch", "picks", "capacity", "max_groups", "pool", "group_at", "owner_at", "inserted_at",
          "used_at", "slot_of", "score_kind", "clock", "hits", "lookups", "frequency", "cost",
          "slots", "new_owner", "new_slot", "new_group", "slot_base", "stride", "addresses",
          "n_seqs", "fds", "fd_seq_stride", "fd_path_stride", "n_paths", "check", "sum_tables", "sum_row_bytes",
          "layer", "sink", "scratch", "req_fds", "req_offsets", "req_counts", "req_paths", "req_gap_counts",
          "read_addresses", "read_seqs", "read_groups", "expected", "check_flags", "capacity_records")


@functools.cache
def native_fetch():
    """The library, or None (logged once) when it cannot be built: the calls one by one serve."""
    p, i64, i32 = native_build.P, native_build.I64, native_build.I32
    lib = native_build.load_or_none("fetch", log, "assigning slots and planning reads in separate calls", {
        "ekv_fetch_fields": ([], i32), "ekv_fetch_run": ([p, p, p, i64, i64, p], i64),
        "ekv_requests_scratch_bytes": ([i64], i64)})
    if lib is not None and lib.ekv_fetch_fields() != len(FIELDS):
        raise RuntimeError(f"ekv_fetch.c's job has {lib.ekv_fetch_fields()} fields, runtime/fetch_plan.py FIELDS "
                           f"{len(FIELDS)}: one of the two changed without the other")
    return lib


class LayerJob:
    """One layer's job for picks of one shape: its fields and the buffers it writes (the last step's until the next:
    a layer's reads and attention are done with them by then)."""

    def __init__(self, lib, slots: SlotTable, slot_memory, store: DiskKVStore, layer: int, batch: int, picks: int):
        entries = batch * picks
        self.version = store.tables_version
        self.capacity = entries + (entries - 1) * store.gap_records  # every gap bridged
        self.gap_records = store.gap_records
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
        fields = {**slots.native_fields(layer), **store.native_plan_fields(layer), "batch": batch, "picks": picks,
                  "slots": address(self.slots), "new_owner": new, "new_slot": new + rows, "new_group": new + 2 * rows,
                  "addresses": new + 3 * rows, "slot_base": slot_memory.slot_base(slots.buffer_index(layer)),
                  "stride": store.layout.stride_bytes, "scratch": address(self.scratch), "req_fds": requests,
                  "req_counts": requests + request_rows, "req_paths": requests + 2 * request_rows,
                  "req_gap_counts": requests + 3 * request_rows, "req_offsets": address(self.offsets),
                  "read_addresses": records, "read_seqs": records + record_rows,
                  "read_groups": records + 2 * record_rows,
                  "expected": address(self.expected), "check_flags": address(self.check),
                  "capacity_records": self.capacity}
        self.fields = np.array([fields[name] for name in FIELDS], dtype=np.int64)


class FetchPlanner:
    """The policy's picks to (slots, misses, their reads) in one native call a layer."""

    def __init__(self, lib, slots: SlotTable, slot_memory, store: DiskKVStore):
        self._lib, self._slots, self._slot_memory, self._store = lib, slots, slot_memory, store
        self._jobs: dict[tuple[int, int, int], LayerJob] = {}

    @classmethod
    def for_policy(cls, slots, slot_memory, store) -> "FetchPlanner | None":
        """A planner where the policy's parts can take one (a slot table whose replacement ekv_slots.c keeps, slots in
        host memory where the reads land, a disk store); None elsewhere."""
        if not (isinstance(slots, SlotTable) and isinstance(store, DiskKVStore) and hasattr(slot_memory, "slot_base")):
            return None
        if slots.native_fields(0) is None:
            return None
        lib = native_fetch()
        return None if lib is None else cls(lib, slots, slot_memory, store)

    def plan(self, layer: int, groups: np.ndarray, valid: np.ndarray
             ) -> tuple[np.ndarray, Misses, VerifiedBatch | None] | None:
        """``layer``'s picks groups, valid [B, M] (each row its own records): their flat slots [B, M], the misses and
        the misses' reads (None: planned the store's way, ``DiskKVStore.batch``), the store's counters counted; None
        where it does not serve or the assignment refuses (nothing changed: ``SlotTable.assign`` says why)."""
        store = self._store
        if not store.plans_natively(layer):
            return None
        groups = np.ascontiguousarray(groups, dtype=np.int64)
        valid = np.ascontiguousarray(valid, dtype=bool)
        key = (layer, *groups.shape)
        job = self._jobs.get(key)
        if job is None or job.version != store.tables_version or job.gap_records < store.gap_records:
            job = self._jobs[key] = LayerJob(self._lib, self._slots, self._slot_memory, store, layer, *groups.shape)
        n = self._lib.ekv_fetch_run(address(job.fields), address(groups), address(valid), store.max_request_records,
                                    store.gap_records, address(job.counts))
        if n < 0:
            return None
        misses = Misses(job.new[0, :n], job.new[1, :n], job.new[2, :n])
        k, total = (int(c) for c in job.counts)
        if n == 0 or k < 0:
            return job.slots, misses, None
        fds, counts, paths, gap_counts = job.requests[:, :k]
        reads = VerifiedBatch(fds, job.offsets[:k], job.records[0, :total], store.layout.stride_bytes, counts, paths,
                              layer, job.records[1, :total], job.records[2, :total], job.expected[:total],
                              job.check[:total], gap_counts if total > n else None)
        store.count_reads(reads, n)
        return job.slots, misses, reads
