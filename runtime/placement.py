"""Where each group record of one sequence lives when the KV cache spans several paths (devices).

Per layer and group: up to ``REPLICAS`` copies, each a (path, record index in that path's file).
Groups are placed when first written: by a layout (runtime/cluster.py: co-activated groups
adjacent within a path, clusters dealt over the paths) or, for groups without one, striped
in token order (group g on path g % N).  With one path and no layout, record g sits at
index g: the single-file layout of a plain KVSwap store.
"""
from __future__ import annotations

import numpy as np

REPLICAS = 2
PLACEMENT_BYTES_PER_GROUP = REPLICAS * (4 + 4)  # int32 path and record index per copy, per layer


class Placement:
    """One sequence's placement.  A layer whose groups were only ever striped needs no table (path g % N,
    index g // N); a layer given a layout gets dense tables [max_groups, REPLICAS], so memory is spent
    only where clustering is on."""

    def __init__(self, n_layers: int, max_groups: int, n_paths: int):
        self.n_paths = n_paths
        self.max_groups = max_groups
        self._tables: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * n_layers
        self._striped_end = np.zeros(n_layers, dtype=np.int64)  # groups written while a layer had no table

    @property
    def table_bytes(self) -> int:
        return sum(path.nbytes + index.nbytes for path, index, _ in filter(None, self._tables))

    def _table(self, layer: int):
        if self._tables[layer] is None:
            self._tables[layer] = (np.full((self.max_groups, REPLICAS), -1, dtype=np.int32),
                                   np.full((self.max_groups, REPLICAS), -1, dtype=np.int32),
                                   np.zeros(self.n_paths, dtype=np.int64))
        return self._tables[layer]

    def assign(self, layer: int, per_path: list[np.ndarray]) -> None:
        """Append ``per_path[p]`` (groups, in record order) to path p's file; a group listed on two paths gets
        two copies.  Only a layer's first groups may be given this way, before any is striped: a record
        never moves once written."""
        if len(per_path) != self.n_paths:
            raise ValueError(f"a layout for {len(per_path)} paths given to a store of {self.n_paths}")
        if self._tables[layer] is not None:
            raise ValueError(f"layer {layer} already has a layout: records never move once written")
        path, index, filled = self._table(layer)
        for p, groups in enumerate(per_path):
            groups = np.asarray(groups, dtype=np.int64)
            copy = (path[groups, 0] >= 0).astype(np.int64)  # listed on an earlier path: the replica slot
            if len(np.unique(groups)) != len(groups) or np.any(path[groups, copy] >= 0):
                raise ValueError(f"layer {layer}: a group is listed twice on path {p} or on more than {REPLICAS} paths")
            path[groups, copy] = p
            index[groups, copy] = filled[p] + np.arange(len(groups))
            filled[p] += len(groups)

    def all_striped(self) -> bool:
        """Whether no layer has a table: each group g at path g % N, index g // N."""
        return all(table is None for table in self._tables)

    def stripe(self, layer: int, groups: np.ndarray) -> None:
        """Place new groups in token order: group g on path g % N, after that path's records."""
        if self._tables[layer] is None:  # implicit: index g // N
            if len(groups):
                self._striped_end[layer] = max(self._striped_end[layer], int(np.max(groups)) + 1)
            return
        path, index, filled = self._tables[layer]
        groups = np.asarray(groups, dtype=np.int64)
        groups = groups[path[groups, 0] < 0]
        for p in range(self.n_paths):
            mine = groups[groups % self.n_paths == p]
            path[mine, 0] = p
            index[mine, 0] = filled[p] + np.arange(len(mine))
            filled[p] += len(mine)

    def move(self, layer: int, per_path: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Give the groups of ``per_path[p]`` one new copy each, appended to path p in that order (their old
        records are left as they are, unread); returns the new (path, index) per listed group, in order."""
        if self._tables[layer] is None:  # write the implicit stripe down first: the unmoved groups stay there
            path, index, filled = self._table(layer)
            written = np.arange(self._striped_end[layer])
            path[written, 0], index[written, 0] = written % self.n_paths, written // self.n_paths
            filled[:] = np.bincount(written % self.n_paths, minlength=self.n_paths)
        path, index, filled = self._tables[layer]
        out_path, out_index = [], []
        for p, groups in enumerate(per_path):
            groups = np.asarray(groups, dtype=np.int64)
            new = filled[p] + np.arange(len(groups))
            path[groups], index[groups] = -1, -1
            path[groups, 0], index[groups, 0] = p, new
            filled[p] += len(groups)
            out_path.append(np.full(len(groups), p))
            out_index.append(new)
        return np.concatenate(out_path), np.concatenate(out_index)

    def copies(self, layer: int, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(path, index) int64 [n, REPLICAS] of each group's copies; -1 where a group has fewer."""
        groups = np.asarray(groups, dtype=np.int64)
        if self._tables[layer] is None:
            out_path = np.full((len(groups), REPLICAS), -1, dtype=np.int64)
            out_index = out_path.copy()
            out_path[:, 0], out_index[:, 0] = groups % self.n_paths, groups // self.n_paths
            return out_path, out_index
        path, index, _ = self._tables[layer]
        return path[groups].astype(np.int64), index[groups].astype(np.int64)
