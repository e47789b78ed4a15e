"""Where each selected group sits in memory: the reuse buffer's slot table, or a plain preload buffer.

Both answer one question per layer and step: given the selected groups of every
sequence, which slot holds each, and which (sequence, slot, group) must be read from disk.
"""
from __future__ import annotations

import numpy as np


class SlotTable:
    """KVSwap's reuse buffer bookkeeping: ``capacity`` slots per (layer, sequence), FIFO replacement.

    A group selected again is a hit and is not read.  A miss takes the oldest slot that
    holds no group selected in the same step, so the step's own hits are never evicted
    (requires capacity >= groups selected per step).
    """

    def __init__(self, n_layers: int, batch: int, capacity: int):
        self.capacity = capacity
        self.group = np.full((n_layers, batch, capacity), -1, dtype=np.int64)
        self.inserted = np.full((n_layers, batch, capacity), -1, dtype=np.int64)
        self._clock = 0
        self.hits = np.zeros(batch, dtype=np.int64)
        self.lookups = np.zeros(batch, dtype=np.int64)

    def buffer_index(self, layer: int) -> int:
        return layer

    def assign(self, layer: int, groups: np.ndarray, valid: np.ndarray):
        """groups, valid: [B, M].  Returns slots [B, M] and misses as (seq, slot, group) triples."""
        batch, m = groups.shape
        slots = np.zeros((batch, m), dtype=np.int64)
        misses = []
        for b in range(batch):
            table = self.group[layer, b]
            wanted = groups[b][valid[b]]
            cols = np.flatnonzero(valid[b])
            hit_mask = np.isin(wanted, table)
            where = {int(g): s for s, g in enumerate(table) if g >= 0}
            self.lookups[b] += len(wanted)
            self.hits[b] += int(hit_mask.sum())
            for col, g in zip(cols[hit_mask], wanted[hit_mask]):
                slots[b, col] = where[int(g)]
            need = wanted[~hit_mask]
            if len(need):
                protected = np.isin(table, wanted)
                age = np.where(protected, np.iinfo(np.int64).max, self.inserted[layer, b])
                victims = np.argsort(age, kind="stable")[: len(need)]
                for col, g, s in zip(cols[~hit_mask], need, victims):
                    table[s] = g
                    self.inserted[layer, b, s] = self._clock
                    self._clock += 1
                    slots[b, col] = s
                    misses.append((b, int(s), int(g)))
        return slots, misses

    def reset(self, seq: int) -> None:
        self.group[:, seq] = -1
        self.inserted[:, seq] = -1
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

    def assign(self, layer: int, groups: np.ndarray, valid: np.ndarray):
        batch, m = groups.shape
        slots = np.broadcast_to(np.arange(m, dtype=np.int64), (batch, m))
        b_idx, cols = np.nonzero(valid)
        self.lookups += valid.sum(axis=1)
        return slots, [(int(b), int(c), int(groups[b, c])) for b, c in zip(b_idx, cols)]

    def reset(self, seq: int) -> None:
        self.hits[seq] = 0
        self.lookups[seq] = 0
