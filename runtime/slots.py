"""Where each selected group sits in memory: the reuse buffer's slot table, or a plain preload buffer.

Both answer one question per layer and step: given the selected groups of every sequence, which slot of
the layer's buffer holds each, and which records must be read from disk.  Slots are flat: sequence ``b``
owns slots ``[b * capacity, (b + 1) * capacity)``.  A record is the key (owner, group): sequences that
share a prompt prefix name the shared groups with the owner's id, so a record they both pick is read once.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np

from .kernels import Backend, resolve_backend
from .native_build import address


class Misses(NamedTuple):
    """Records to read: ``group[i]`` of sequence ``seq[i]`` (the record's owner) goes into flat ``slot[i]``."""

    seq: np.ndarray
    slot: np.ndarray
    group: np.ndarray


def _first_occurrences(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions of each distinct key's first occurrence, ascending; for each entry its key's index there)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.ones(len(keys), dtype=bool)
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    if starts.all():
        every = np.arange(len(keys))
        return every, every
    first = order[starts]
    by_position = np.argsort(first)
    index = np.empty_like(by_position)
    index[by_position] = np.arange(len(first))
    rank = np.empty(len(keys), dtype=np.int64)
    rank[order] = index[np.cumsum(starts) - 1]
    return first[by_position], rank


class Replacement:
    """Which resident a miss evicts: a free slot first, then the lowest ``score``, ties to the oldest insertion.

    ``score`` is the hook.  ``observe`` sees each step's picks, ``forget`` a sequence's reset, for policies
    that keep state of their own.
    """

    def __init__(self, table: SlotTable):
        self.table = table

    def score(self, layer: int, slots: np.ndarray) -> np.ndarray:
        """Eviction priority of the occupied flat ``slots`` of ``layer``: the lowest goes first."""
        raise NotImplementedError

    def observe(self, layer: int, picked: np.ndarray, idle: np.ndarray) -> None:
        """After a step: the flat slots some row ``picked``, and the occupied ones their pools left ``idle``."""

    def forget(self, seq: int) -> None:
        """``seq`` starts a new sequence: whatever was learnt about its records no longer holds."""

    def set_cost(self, layer: int, owner: int, groups, cost) -> None:
        """The cost of reading ``owner``'s ``groups`` again (clustering knows it); a policy may weigh it."""

    def set_prior(self, layer: int, owner: int, groups, counts) -> None:
        """How often ``owner``'s ``groups`` were picked before decoding (the prompt's queries)."""

    def native_rows(self, layer: int) -> tuple[int | None, int | None]:
        """Addresses of ``layer``'s own state that ekv_slots.c keeps for this replacement (None: it keeps none)."""
        return None, None


class Fifo(Replacement):
    """KVSwap's reuse buffer: the oldest insertion goes, a hit does not refresh it."""

    def score(self, layer, slots):
        return self.table.inserted_at[layer, slots]


class Lru(Replacement):
    """The least recently picked goes: a hit refreshes a record, so a recurring working set stays."""

    def score(self, layer, slots):
        return self.table.used_at[layer, slots]


class CostAware(Replacement):
    """Swarm's hot-cluster cache (Eq. 6, section 6.2): the lowest activation frequency x refetch cost goes.

    A record's frequency rises by one each step it is picked and falls by one (not below zero) each step it
    sits resident unpicked, so a record picked again and again outlives one a scan picked once; it survives
    eviction, so a hot record read again comes back with its history.  ``set_cost`` and ``set_prior`` give
    a record's refetch cost (default 1) and a frequency observed before decoding (default 0).
    """

    def __init__(self, table):
        super().__init__(table)
        self.frequency = np.zeros(table.slot_of.shape, dtype=np.float32)
        self.cost = np.ones(table.slot_of.shape, dtype=np.float32)

    def set_cost(self, layer: int, owner: int, groups, cost) -> None:
        self.cost[layer, owner, groups] = cost

    def set_prior(self, layer: int, owner: int, groups, counts) -> None:
        self.frequency[layer, owner, groups] = counts

    def score(self, layer, slots):
        key = (layer, *self.table.key_at(layer, slots))
        return self.frequency[key] * self.cost[key]

    def observe(self, layer, picked, idle):
        self.frequency[(layer, *self.table.key_at(layer, picked))] += 1
        key = (layer, *self.table.key_at(layer, idle))
        self.frequency[key] = np.maximum(self.frequency[key] - 1, 0)

    def forget(self, seq):
        self.frequency[:, seq] = 0
        self.cost[:, seq] = 1

    def native_rows(self, layer):
        return address(self.frequency[layer]), address(self.cost[layer])


REPLACEMENTS = {"fifo": Fifo, "lru": Lru, "cost": CostAware}
NATIVE_ORDERS = {Fifo: 0, Lru: 1, CostAware: 2}  # the replacements ekv_slots.c keeps (its score_kind)


class Slots:
    """Where a layer's selected records sit in memory, and which must be read (the protocol both tables keep).

    ``assign`` places one step's picks of a layer and names the misses; ``held`` says which records already sit
    in slots (read again for free); ``resident`` and ``correct`` serve a second look at the same layer and step
    (the picks rescored with the layer's own query: which sit in memory now, and where the rest go);
    ``share`` pools sequences with a common prefix; ``reset`` starts a row anew; records of layer l live in buffer
    ``buffer_index(l)`` of ``n_buffers(n_layers)``; ``replacement`` is told what clustering learns of records (cost,
    prior picks)."""

    keeps_records = False  # records stay resident past their step (a reuse buffer)
    capacity: int
    hits: np.ndarray
    lookups: np.ndarray
    replacement: Replacement

    def assign(self, layer: int, groups: np.ndarray, valid: np.ndarray,
               owners: np.ndarray | None = None) -> tuple[np.ndarray, Misses]:
        raise NotImplementedError

    def held(self, layer: int, owner: int, groups: np.ndarray) -> np.ndarray:
        """The flat slot holding each of ``owner``'s ``groups`` in ``layer``, -1 where none does."""
        return np.full(len(groups), -1, dtype=np.int64)

    def resident(self, layer: int, groups: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """[B, M] bool: which records (``owners``' ``groups``) sit in ``layer``'s slots now, after its ``assign``."""
        raise NotImplementedError

    def correct(self, layer: int, groups: np.ndarray, valid: np.ndarray,
                owners: np.ndarray) -> tuple[np.ndarray, Misses]:
        """Flat slots [B, M] of corrected picks of ``layer`` after its ``assign`` and the reads it named landed,
        and the misses to read now; the reuse counts are the first look's (a correction's reads are counted apart)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the table's own bookkeeping (what the slots hold is counted apart)."""
        return 0


class SlotTable(Slots):
    """The reuse buffer's bookkeeping: ``capacity`` slots per (layer, sequence), grouped into pools.

    A pool is a set of sequences whose slots hold any of their records, each at most once: alone (the
    default) a sequence is KVSwap's per-sequence reuse buffer; ``share`` pools sequences with a common
    prefix, so a record several of them pick is read once and hit by all.  A record picked again is a hit;
    a miss takes the slot ``replacement`` names, never one holding a record its pool picked in the same
    step (so a pool must hold the distinct records it picks per step).  ``slot_of`` is the reverse map
    (owner, group) -> flat slot or -1, dense so a lookup costs O(M), not O(C).  ``hits`` counts the picks
    that needed no read, a record read once for several rows included.
    """

    keeps_records = True

    def __init__(self, n_layers: int, batch: int, capacity: int, max_groups: int, replacement: str = "fifo",
                 backend: Backend | None = None):
        """``backend``: whose slot assignment it takes (runtime/kernels.py: the native one's or numpy's; None: the
        CPU's)."""
        if replacement not in REPLACEMENTS:
            raise ValueError(f"replacement must be one of {sorted(REPLACEMENTS)}, got {replacement!r}")
        self.capacity = capacity
        self.max_groups = max_groups
        shape = (n_layers, batch, capacity)
        self.group, self.owner, self.inserted, self.used = (np.full(shape, -1, dtype=np.int64) for _ in range(4))
        # the same arrays by flat slot: [layer, seq * capacity + slot]
        self.group_at, self.owner_at, self.inserted_at, self.used_at = (
            a.reshape(n_layers, -1) for a in (self.group, self.owner, self.inserted, self.used))
        self.slot_of = np.full((n_layers, batch, max_groups), -1, dtype=np.int64)
        self.pool = np.arange(batch)  # per sequence, its pool's label: one of the pool's members
        self._seq_of_slot = np.arange(batch * capacity) // capacity
        # each layer's clock in memory (native calls advance it in place): a table orders a layer's slots by it alone,
        # so two threads may assign two layers' slots at once
        self._clocks = np.zeros(n_layers, dtype=np.int64)
        self.hits = np.zeros(batch, dtype=np.int64)
        self.lookups = np.zeros(batch, dtype=np.int64)
        self._lib = (backend or resolve_backend("cpu")).lib("slots")
        self.replacement = REPLACEMENTS[replacement](self)

    @property
    def replacement(self) -> Replacement:
        return self._replacement

    @replacement.setter
    def replacement(self, replacement: Replacement) -> None:
        """The replacement, and with it the assignment: native for one ekv_slots.c keeps (its ``_native_order``),
        numpy's for any other."""
        self._replacement = replacement
        self._native_order = NATIVE_ORDERS.get(type(replacement)) if self._lib is not None else None
        self._assign = self._assign_numpy if self._native_order is None else self._assign_native

    def buffer_index(self, layer: int) -> int:
        return layer

    def native_fields(self, layer: int) -> dict[str, int] | None:
        """What ``ekv_slots_assign`` takes of ``layer``'s tables (runtime/native/ekv_fetch.c's job fields: sizes,
        addresses), for a native caller that counts its picks (and passes each step's owners, or none); None where the
        assignment is numpy's (the torch backend, or a replacement the native code does not keep)."""
        order = self._native_order
        if order is None:
            return None
        frequency, cost = self.replacement.native_rows(layer)
        return {"sequences": len(self.pool), "capacity": self.capacity, "max_groups": self.max_groups,
                "pool": address(self.pool), "group_at": address(self.group_at[layer]),
                "owner_at": address(self.owner_at[layer]), "inserted_at": address(self.inserted_at[layer]),
                "used_at": address(self.used_at[layer]), "slot_of": address(self.slot_of[layer]), "score_kind": order,
                "clock": address(self._clocks[layer:]), "hits": address(self.hits), "lookups": address(self.lookups),
                "frequency": frequency or 0, "cost": cost or 0}

    @staticmethod
    def n_buffers(n_layers: int) -> int:
        return n_layers

    @staticmethod
    def index_bytes(n_layers: int, capacity: int, max_groups: int, replacement: str) -> int:
        """Bytes of the table's own arrays per sequence (what the slots hold is counted apart): four int64 per
        slot, the int64 reverse map per group, and the cost-aware policy's two float32 per group."""
        per_group = 8 + (8 if replacement == "cost" else 0)
        return n_layers * (capacity * 4 * 8 + max_groups * per_group) + capacity * 8

    @property
    def nbytes(self) -> int:
        arrays = [self.group, self.owner, self.inserted, self.used, self.slot_of, self._seq_of_slot]
        arrays += [getattr(self.replacement, name) for name in ("frequency", "cost") if hasattr(self.replacement, name)]
        return sum(a.nbytes for a in arrays)

    def held(self, layer, owner, groups):
        return self.slot_of[layer, owner, groups]

    def key_at(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(owner, group) of the records in flat ``slots`` of ``layer``."""
        return self.owner_at[layer, slots], self.group_at[layer, slots]

    def share(self, seqs: list[int]) -> None:
        """One pool for ``seqs`` and every sequence already pooled with one of them; residents stay put."""
        members = np.isin(self.pool, self.pool[np.asarray(seqs)])
        self.pool[members] = np.flatnonzero(members)[0]

    def resident(self, layer, groups, owners):
        return self.slot_of[layer, owners, groups] >= 0

    def correct(self, layer, groups, valid, owners):
        return self.assign(layer, groups, valid, owners, count=False)

    def assign(self, layer: int, groups: np.ndarray, valid: np.ndarray,
               owners: np.ndarray | None = None, count: bool = True) -> tuple[np.ndarray, Misses]:
        """groups, valid, owners: [B, M] (owners None: each row's own).  Returns flat slots [B, M] and the misses;
        ``count``: the picks count in ``hits`` and ``lookups``."""
        return self._assign(layer, groups, valid, owners, count)

    def _assign_numpy(self, layer: int, groups: np.ndarray, valid: np.ndarray, owners: np.ndarray | None,
                      count: bool) -> tuple[np.ndarray, Misses]:
        """``assign`` in numpy: the reference the native assignment is tested against."""
        rows, cols = np.nonzero(valid)
        owner = rows if owners is None else np.asarray(owners)[rows, cols]
        pool = self.pool[rows]
        if owners is not None and (self.pool[owner] != pool).any():
            bad = np.flatnonzero(self.pool[owner] != pool)[0]
            raise ValueError(f"sequence {rows[bad]} picks a record of sequence {owner[bad]} outside its pool; "
                             "share() them first")
        group = groups[rows, cols]
        found = self.slot_of[layer, owner, group]
        miss = np.flatnonzero(found < 0)
        first, rank = _first_occurrences(owner[miss] * self.max_groups + group[miss])
        new = miss[first]  # the entries that read: each missed record's first picker
        if len(new):
            victims = self._victims(layer, found[found >= 0], pool[new])
            self._place(layer, victims, owner[new], group[new])
            found[miss] = victims[rank]
        slots = np.zeros(groups.shape, dtype=np.int64)
        slots[rows, cols] = found
        self._observe(layer, found, pool)
        if count:
            self.lookups += np.bincount(rows, minlength=len(self.pool))
            self.hits += np.bincount(rows, minlength=len(self.pool)) - np.bincount(rows[new], minlength=len(self.pool))
        return slots, Misses(owner[new], found[new], group[new])

    def _assign_native(self, layer: int, groups: np.ndarray, valid: np.ndarray, owners: np.ndarray | None,
                       count: bool) -> tuple[np.ndarray, Misses]:
        """``assign`` in one native call (runtime/native/ekv_slots.c: the same tables, bit for bit, where numpy takes
        ~40 calls) for fifo, lru and cost.  Where it refuses (a pick outside its pool, a pool too small) it changed
        nothing, and the numpy path raises the error naming the sequences."""
        groups = np.ascontiguousarray(groups, dtype=np.int64)
        valid = np.ascontiguousarray(valid, dtype=bool)
        owners = None if owners is None else np.ascontiguousarray(owners, dtype=np.int64)
        batch, picks = groups.shape
        slots = np.empty((batch, picks), dtype=np.int64)
        new = np.empty((3, batch * picks), dtype=np.int64)  # each new record's owner, slot and group
        tables = (self.group_at[layer], self.owner_at[layer], self.inserted_at[layer], self.used_at[layer],
                  self.slot_of[layer])
        n_new = self._lib.ekv_slots_assign(
            len(self.pool), batch, picks, address(groups), address(valid),
            None if owners is None else address(owners), self.capacity, self.max_groups, address(self.pool),
            *(address(table) for table in tables), self._native_order, address(self._clocks[layer:]), address(slots),
            *(address(row) for row in new), address(self.hits) if count else None,
            address(self.lookups) if count else None, *self.replacement.native_rows(layer))
        if n_new < 0:
            return self._assign_numpy(layer, groups, valid, owners, count)
        return slots, Misses(new[0, :n_new], new[1, :n_new], new[2, :n_new])

    def _victims(self, layer: int, protected: np.ndarray, pools: np.ndarray) -> np.ndarray:
        """A slot of pool ``pools[i]`` for each new record i, none of the flat slots ``protected``: in each pool,
        free slots first, then the residents ``replacement`` ranks lowest."""
        wanted = np.bincount(pools, minlength=len(self.pool))
        kept = np.zeros(self.group_at.shape[1], dtype=bool)
        kept[protected] = True
        pool_of_slot = self.pool[self._seq_of_slot]
        candidates = np.flatnonzero(~kept & (wanted[pool_of_slot] > 0))
        label = pool_of_slot[candidates]
        occupied = self.group_at[layer, candidates] >= 0
        score = np.zeros(len(candidates))
        score[occupied] = self.replacement.score(layer, candidates[occupied])
        order = np.lexsort((candidates, self.inserted_at[layer, candidates], score, occupied, label))
        label = label[order]
        chosen = order[np.arange(len(order)) - np.searchsorted(label, label) < wanted[label]]
        if len(chosen) < len(pools):
            short = np.flatnonzero(wanted > np.bincount(label, minlength=len(self.pool)))[0]
            members = np.flatnonzero(self.pool == short)
            raise ValueError(f"sequences {members.tolist()} pick {wanted[short] + kept[pool_of_slot == short].sum()} "
                             f"distinct records in one step but their pool holds {len(members) * self.capacity}: "
                             "raise the capacity")
        victims = np.empty(len(pools), dtype=np.int64)
        victims[np.argsort(pools, kind="stable")] = candidates[chosen]
        return victims

    def _place(self, layer: int, slots: np.ndarray, owner: np.ndarray, group: np.ndarray) -> None:
        """Evict the records in ``slots`` and put the new ones there (``_observe`` then marks them used)."""
        self._forget_slots(layer, slots)
        self.owner_at[layer, slots], self.group_at[layer, slots] = owner, group
        self.slot_of[layer, owner, group] = slots
        self.inserted_at[layer, slots] = self._clocks[layer] + np.arange(len(slots))
        self._clocks[layer] += len(slots)

    def _forget_slots(self, layer: int, slots: np.ndarray) -> None:
        held = slots[self.group_at[layer, slots] >= 0]
        self.slot_of[(layer, *self.key_at(layer, held))] = -1

    def _drop(self, layer: int, slots: np.ndarray) -> None:
        self._forget_slots(layer, slots)
        for table in (self.group_at, self.owner_at, self.inserted_at, self.used_at):
            table[layer, slots] = -1

    def _observe(self, layer: int, found: np.ndarray, pool: np.ndarray) -> None:
        """Tell ``replacement`` the flat slots picked (``found``, by rows of pools ``pool``) and the residents
        those pools left idle."""
        picked = np.zeros(self.group_at.shape[1], dtype=bool)
        picked[found] = True
        stepped = np.zeros(len(self.pool), dtype=bool)
        stepped[pool] = True
        idle = (self.group[layer] >= 0) & stepped[self.pool][:, None]
        self.used_at[layer, picked] = self._clocks[layer]
        self._clocks[layer] += 1
        self.replacement.observe(layer, np.flatnonzero(picked), np.flatnonzero(idle.ravel() & ~picked))

    def reset(self, seq: int) -> None:
        """``seq`` starts anew: its slots and every record it owns are dropped, and it leaves its pool."""
        for layer in range(len(self.group)):
            owned = np.flatnonzero(self.owner_at[layer] == seq)
            self._drop(layer, np.union1d(owned, seq * self.capacity + np.arange(self.capacity)))
        others = np.flatnonzero((self.pool == self.pool[seq]) & (np.arange(len(self.pool)) != seq))
        if len(others):
            self.pool[others] = others[0]
        self.pool[seq] = seq
        self.hits[seq] = 0
        self.lookups[seq] = 0
        self.replacement.forget(seq)


class PreloadSlots(Slots):
    """No reuse: row ``b``'s pick ``m`` is read into flat slot ``b * capacity + m`` of a buffer shared by
    alternate layers; a record several rows pick in a step is read once, into its first picker's slot.

    Two buffers suffice because layer i+1's fetch overlaps layer i's attention only.  Nothing stays resident
    past its step, so nothing is ``held`` and the replacement has nothing to weigh.  A corrected pick the first
    look did not read takes a slot no corrected pick refers to (a guess the correction dropped): with as many picks
    as slots there is always one, so a correction needs no memory of its own.
    """

    def __init__(self, batch: int, capacity: int):
        self.capacity = capacity
        self.hits = np.zeros(batch, dtype=np.int64)
        self.lookups = np.zeros(batch, dtype=np.int64)
        self.replacement = Replacement(self)
        self._read: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # buffer -> (sorted record keys, their slots)

    def buffer_index(self, layer: int) -> int:
        return layer % 2

    @staticmethod
    def n_buffers(n_layers: int) -> int:
        return min(2, n_layers)

    def share(self, seqs: list[int]) -> None:
        """Nothing to do: every row's picks are already deduplicated against the whole batch's."""

    def assign(self, layer: int, groups: np.ndarray, valid: np.ndarray,
               owners: np.ndarray | None = None) -> tuple[np.ndarray, Misses]:
        batch, m = groups.shape
        slots = np.arange(batch)[:, None] * self.capacity + np.arange(m)
        rows, cols = np.nonzero(valid)
        owner = rows if owners is None else np.asarray(owners)[rows, cols]
        group = groups[rows, cols]
        first, rank = _first_occurrences(owner * (int(group.max(initial=0)) + 1) + group)
        read = slots[rows[first], cols[first]]
        slots[rows, cols] = read[rank]
        self._read[self.buffer_index(layer)] = _key_map(_record_keys(owner[first], group[first]), read)
        self.lookups += np.bincount(rows, minlength=batch)
        self.hits += np.bincount(rows, minlength=batch) - np.bincount(rows[first], minlength=batch)
        return slots, Misses(owner[first], read, group[first])

    def _slots_of(self, layer: int, keys: np.ndarray) -> np.ndarray:
        """The flat slot holding each record key in the layer's buffer (its assign's reads, then its correction's),
        -1 where none does."""
        held, read = self._read.get(self.buffer_index(layer), (None, None))
        if held is None or not len(held):
            return np.full(np.shape(keys), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(held, keys), len(held) - 1)
        return np.where(held[at] == keys, read[at], -1)

    def resident(self, layer, groups, owners):
        return self._slots_of(layer, _record_keys(owners, groups)) >= 0

    def correct(self, layer, groups, valid, owners):
        rows, cols = np.nonzero(valid)
        key = _record_keys(np.asarray(owners)[rows, cols], groups[rows, cols])
        found = self._slots_of(layer, key)
        miss = np.flatnonzero(found < 0)
        first, rank = _first_occurrences(key[miss])
        new = miss[first]
        referred = np.zeros(len(self.hits) * self.capacity, dtype=bool)
        referred[found[found >= 0]] = True
        free = np.flatnonzero(~referred)  # the dropped guesses' slots (and any the first look left empty)
        if len(new) > len(free):
            raise ValueError(f"a correction reads {len(new)} records but {len(free)} preload slots are free: "
                             f"the picks outnumber the slots ({groups.shape[1]} > {self.capacity})")
        found[miss] = free[: len(new)][rank]
        self._read[self.buffer_index(layer)] = _key_map(key, found)  # what the slots hold now
        slots = np.zeros(groups.shape, dtype=np.int64)
        slots[rows, cols] = found
        return slots, Misses(np.asarray(owners)[rows, cols][new], found[new], groups[rows, cols][new])

    def reset(self, seq: int) -> None:
        self.hits[seq] = 0
        self.lookups[seq] = 0


def _key_map(keys: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct record keys, the slot of each): what ``PreloadSlots._slots_of`` searches."""
    held, at = np.unique(keys, return_index=True)
    return held, slots[at]


def _record_keys(owners: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """One int64 per record (owner, group)."""
    return (np.asarray(owners, dtype=np.int64) << 32) | np.asarray(groups, dtype=np.int64)


def replay_hit_rate(trace: Iterable[tuple[int, np.ndarray, np.ndarray]], n_layers: int, batch: int, capacity: int,
                    max_groups: int, replacement: str, owners: list[tuple[int, int] | None] | None = None) -> float:
    """Hits / lookups of a fresh table over recorded picks (offload's ``on_select``), to compare policies.

    ``owners``: per row, None or (owner, n) when its first n groups are the owner's records (as the engine's
    prefix sharing gives); such rows are pooled with their owner.
    """
    table = SlotTable(n_layers, batch, capacity, max_groups, replacement)
    row_owner, shared = np.arange(batch), np.zeros(batch, dtype=np.int64)
    for seq, prefix in enumerate(owners or []):
        if prefix is not None:
            row_owner[seq], shared[seq] = prefix
            table.share([prefix[0], seq])
    for layer, groups, valid in trace:
        table.assign(layer, groups, valid, record_owners(groups, row_owner, shared))
    return float(table.hits.sum() / max(1, table.lookups.sum()))


def record_owners(groups: np.ndarray, owner: np.ndarray, shared_groups: np.ndarray) -> np.ndarray:
    """[B, M]: whose record each pick is: row b's owner for its first ``shared_groups[b]`` groups, else b."""
    return np.where(groups < shared_groups[:, None], owner[:, None], np.arange(len(owner))[:, None])
