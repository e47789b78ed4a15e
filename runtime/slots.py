"""Where each selected group sits in memory: the reuse buffer's slot table, or a plain preload buffer.

Both answer one question per layer and step: given the selected groups of every
sequence, which slot holds each, and which (sequence, slot, group) must be read from disk.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Misses(NamedTuple):
    """Groups to read: ``group[i]`` of sequence ``seq[i]`` goes into ``slot[i]``."""

    seq: np.ndarray
    slot: np.ndarray
    group: np.ndarray


class SlotTable:
    """KVSwap's reuse buffer bookkeeping: ``capacity`` slots per (layer, sequence), FIFO replacement.

    A group selected again is a hit and is not read.  A miss takes the oldest slot that
    holds no group selected in the same step, so the step's own hits are never evicted
    (requires capacity >= groups selected per step).  ``slot_of`` is the reverse map
    (group -> slot, -1 if absent), so a lookup costs O(M), not O(C).
    """

    def __init__(self, n_layers: int, batch: int, capacity: int, max_groups: int):
        self.capacity = capacity
        self.group = np.full((n_layers, batch, capacity), -1, dtype=np.int64)
        self.inserted = np.full((n_layers, batch, capacity), -1, dtype=np.int64)
        self.slot_of = np.full((n_layers, batch, max_groups), -1, dtype=np.int64)
        self._clock = 0
        self.hits = np.zeros(batch, dtype=np.int64)
        self.lookups = np.zeros(batch, dtype=np.int64)

    def buffer_index(self, layer: int) -> int:
        return layer

    @staticmethod
    def n_buffers(n_layers: int) -> int:
        return n_layers

    def assign(self, layer: int, groups: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, Misses]:
        """groups, valid: [B, M].  Returns slots [B, M] and the misses to read."""
        slots = np.zeros(groups.shape, dtype=np.int64)
        missed = []
        for b in range(groups.shape[0]):
            cols = np.flatnonzero(valid[b])
            where = self.slot_of[layer, b, groups[b, cols]]
            hit = where >= 0
            slots[b, cols[hit]] = where[hit]
            self.lookups[b] += len(cols)
            self.hits[b] += int(hit.sum())
            need = cols[~hit]
            if len(need):
                slots[b, need] = self._replace(layer, b, where[hit], groups[b, need])
                missed.append((b, slots[b, need], groups[b, need]))
        if not missed:
            empty = np.zeros(0, dtype=np.int64)
            return slots, Misses(empty, empty, empty)
        return slots, Misses(
            np.concatenate([np.full(len(s), b) for b, s, _ in missed]),
            np.concatenate([s for _, s, _ in missed]),
            np.concatenate([g for _, _, g in missed]),
        )

    def _replace(self, layer: int, b: int, protected: np.ndarray, new_groups: np.ndarray) -> np.ndarray:
        """FIFO: put ``new_groups`` into the oldest slots not in ``protected``; returns those slots."""
        age = self.inserted[layer, b].copy()
        age[protected] = np.iinfo(np.int64).max
        victims = np.argsort(age, kind="stable")[: len(new_groups)]
        evicted = self.group[layer, b, victims]
        self.slot_of[layer, b, evicted[evicted >= 0]] = -1
        self.group[layer, b, victims] = new_groups
        self.slot_of[layer, b, new_groups] = victims
        self.inserted[layer, b, victims] = self._clock + np.arange(len(new_groups))
        self._clock += len(new_groups)
        return victims

    def reset(self, seq: int) -> None:
        self.group[:, seq] = -1
        self.inserted[:, seq] = -1
        self.slot_of[:, seq] = -1
        self.hits[seq] = 0
        self.lookups[seq] = 0


class PreloadSlots:
    """No reuse: every selected group is read into slot ``m`` of a buffer shared by alternate layers.

    Two buffers suffice because layer i+1's fetch overlaps layer i's attention only.
    """

    def __init__(self, batch: int, capacity: int):
        self.capacity = capacity
        self.hits = np.zeros(batch, dtype=np.int64)
        self.lookups = np.zeros(batch, dtype=np.int64)

    def buffer_index(self, layer: int) -> int:
        return layer % 2

    @staticmethod
    def n_buffers(n_layers: int) -> int:
        return min(2, n_layers)

    def assign(self, layer: int, groups: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, Misses]:
        batch, m = groups.shape
        slots = np.tile(np.arange(m, dtype=np.int64), (batch, 1))
        seq, col = np.nonzero(valid)
        self.lookups += valid.sum(axis=1)
        return slots, Misses(seq, col, groups[seq, col])

    def reset(self, seq: int) -> None:
        self.hits[seq] = 0
        self.lookups[seq] = 0
