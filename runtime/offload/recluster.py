"""Co-activation layout over several KV paths (Swarm): a prompt's groups placed by the picks of its last queries
before they are written, and each sequence's decode picks of its first ``recluster_steps`` steps clustered again,
the picked groups written once more in that order (runtime/cluster.py finds the layouts)."""
from __future__ import annotations

import threading

import numpy as np
import torch

from ..disk_store import DiskKVStore


class Recluster:
    """The stage of a disk policy built with a placer (``placement.clustering``)."""

    def __init__(self, placer, store: DiskKVStore, slots, slot_memory, n_layers: int, batch: int, recluster_steps: int,
                 group_tokens: int, picked_groups: int, sink_groups: int, window_groups: int):
        self.placer, self.store, self.slots, self.slot_memory = placer, store, slots, slot_memory
        self.n_layers, self.recluster_steps, self.G, self.picked_groups = n_layers, recluster_steps, group_tokens, \
            picked_groups
        self.sink_groups, self.window_groups = sink_groups, window_groups
        self.prompt_queries = placer.n_queries
        self.decode_steps = np.zeros(batch, dtype=np.int64)
        self._observed: dict[int, torch.Tensor] = {}  # layer -> the prompt's last queries, until its KV comes
        self._picks: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}  # (owner, layer) -> (step, groups)
        self._lock = threading.Lock()  # picks are kept by whichever thread takes them

    def start_sequence(self, seq: int) -> None:
        self.decode_steps[seq] = 0
        self._picks = {key: kept for key, kept in self._picks.items() if key[0] != seq}

    def observe(self, layer: int, q: torch.Tensor) -> None:
        self._observed[layer] = q

    def lay_out(self, layer: int, seq: int, k: torch.Tensor, n_full: int, borrows: bool) -> None:
        """Place the prompt's groups by co-activation before they are written (a borrower of another sequence's
        prefix writes only its own tail: striped); the picks seen also seed the cost-aware reuse buffer (activation
        frequency, refetch cost)."""
        q = self._observed.pop(layer, None)
        if q is None or borrows:
            return
        end = max(self.sink_groups, n_full - self.window_groups)
        per_path, activation, cost = self.placer(q, k, self.G, self.picked_groups, self.sink_groups, end,
                                                 self.store.n_paths)
        self.store.place(seq, layer, per_path)
        groups = np.arange(n_full)
        self.slots.replacement.set_prior(layer, seq, groups, activation)
        self.slots.replacement.set_cost(layer, seq, groups, cost)

    def keep(self, layer: int, groups: np.ndarray, valid: np.ndarray, owners_of, active: np.ndarray) -> None:
        """The step's picks per record owner (``owners_of(groups)``), until that owner's layers are clustered again."""
        if not (self.decode_steps[active] < self.recluster_steps).any():
            return
        owners = owners_of(groups)
        with self._lock:
            for b in np.flatnonzero(valid.any(axis=1)).tolist():
                for owner in np.unique(owners[b][valid[b]]).tolist():
                    if self.decode_steps[owner] < self.recluster_steps:
                        mine = valid[b] & (owners[b] == owner)
                        self._picks.setdefault((owner, layer), []).append((int(self.decode_steps[owner]),
                                                                           groups[b][mine]))

    def end_step(self, active: np.ndarray, n_groups: np.ndarray) -> None:
        """Between steps (no read in flight): the sequences whose decode picks are due are clustered again."""
        self.decode_steps[active] += 1
        for seq in np.flatnonzero(active & (self.decode_steps == self.recluster_steps)) if self.recluster_steps else ():
            self._recluster(int(seq), int(n_groups[seq]))

    def _recluster(self, seq: int, n_groups: int) -> None:
        """Cluster each layer's decode picks of ``seq`` and write the picked groups once more in that order over the
        KV paths (a stored context's groups too: its queries say how to lay them out).  With a reuse buffer only
        the groups it holds move (the picks that are still hot; no read), without one every picked group is read
        and moved."""
        for layer in range(self.n_layers):
            kept = self._picks.pop((seq, layer), [])
            if not kept:
                continue
            picks = np.zeros((self.recluster_steps, n_groups), dtype=bool)
            for step, groups in kept:
                picks[step, groups] = True
            per_path, cost = self.placer.refine(picks, self.store.n_paths)
            if self.slots.keeps_records:  # with reuse, move what the slots hold: written, never read again
                per_path = [groups[self.slots.held(layer, seq, groups) >= 0] for groups in per_path]
            self.store.relocate(seq, layer, per_path, lambda groups: self._resident_records(layer, seq, groups))
            moved = np.concatenate(per_path)
            self.slots.replacement.set_cost(layer, seq, moved, cost[moved])

    def _resident_records(self, layer: int, owner: int, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(held mask, records [held, stride]) of ``owner``'s groups that sit in this layer's reuse slots."""
        slots = self.slots.held(layer, owner, groups)
        held = slots >= 0
        return held, self.slot_memory.records(self.slots.buffer_index(layer), slots[held])
