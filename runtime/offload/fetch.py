"""A layer's picks on their way to attention (``LayerFetch``): how they are launched and reach the host, and whose
records they name."""
from __future__ import annotations

import enum
from concurrent.futures import Future

import numpy as np
import torch

from ..fetch_plan import FetchPlan
from ..selector import Selector
from ..slots import record_owners


class Stage(enum.IntEnum):
    """Set by the compute thread alone; where an I/O thread takes picks still being made, their taking is part of the
    reading job, so such a fetch goes from picked to reading."""

    PICKED = 0  # launched: on a GPU a copy to the host queued, on a CPU maybe still scored beside the compute
    PLANNED = 1  # on the host: slots assigned and the misses' reads planned (``FetchPlan``)
    READING = 2  # the reads submitted to an I/O thread
    LANDED = 3  # waited for: attention may read the slots


class LayerFetch:
    """One layer's fetch of a step, from its picks to its landed reads; ``future`` is the I/O thread's job (its
    reads, and the taking itself where an I/O thread takes the picks)."""

    __slots__ = ("layer", "picks", "active", "stage", "groups", "valid", "plan", "future")

    def __init__(self, layer: int, picks: "HostPicks | ScoredPicks", active: np.ndarray):
        self.layer, self.picks, self.active, self.stage = layer, picks, active, Stage.PICKED
        self.groups: np.ndarray | None = None  # [B, M] (0 where none) once taken
        self.valid: np.ndarray | None = None  # [B, M]: a pick, in a row active when it was made
        self.plan: FetchPlan | None = None
        self.future: Future | None = None


class HostPicks:
    """A layer's picks [B, M] (-1: none) on their way to the host: on a GPU one copy into pinned memory queued behind
    the selection, with an event, so ``result`` waits for that copy and never for work queued after it."""

    def __init__(self, picks: torch.Tensor, active: np.ndarray):
        self.active, self._event = active, None  # the rows decoding when the picks were made
        if picks.device.type == "cuda":
            self._host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
            self._host.copy_(picks, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(picks.device))
        else:
            self._host = picks

    def ready(self) -> bool:
        """Whether ``result`` would not wait."""
        return self._event is None or self._event.query()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """groups [B, M] (0 where none) and valid [B, M] (a pick, in an active row)."""
        if self._event is not None:
            self._event.synchronize()  # the layer's one wait for the device
        return _on_host(self._host.numpy(), self.active)


class ScoredPicks:
    """A layer's picks still being made beside the compute thread (``Selector.launch`` on a CPU), taken as
    ``HostPicks`` are."""

    def __init__(self, picking, active: np.ndarray):
        self.picking, self.active = picking, active

    def ready(self) -> bool:
        return self.picking.ready()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return _on_host(self.picking.host(), self.active)


class PicksFromBefore:
    """A layer's picks where some rows guess with their own corrected picks of the step before (``guess_from_before``)
    and the others with the layer-ahead ``predicted`` picks: each row's guess is its own, whatever its neighbours'."""

    def __init__(self, predicted: HostPicks | ScoredPicks, rows: np.ndarray, before: np.ndarray):
        """``rows`` [B]: those taking ``before`` [B, M] (-1: none)."""
        self.predicted, self.active, self._rows, self._before = predicted, predicted.active, rows, before

    def ready(self) -> bool:
        return self.predicted.ready()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        groups, valid = self.predicted.result()
        before_groups, before_valid = _on_host(self._before, self.active)
        rows = self._rows[:, None]
        return np.where(rows, before_groups, groups), np.where(rows, before_valid, valid)


def _on_host(picks: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Picks [B, M] (-1: none) as groups (0 where none) and valid (a pick, in an ``active`` row)."""
    return np.maximum(picks, 0), (picks >= 0) & active[:, None]


def launch_picks(selector: Selector, layer: int, q: torch.Tensor | None, outside_window: np.ndarray, sink_groups: int,
                 active: np.ndarray, post: bool = False) -> HostPicks | ScoredPicks:
    """The selector's picks for ``layer`` from query ``q`` among the groups past the sinks and before the window, on
    their way to the host; ``post``: the selector may post its scoring to the helper thread (``Selector.launch``) and
    still be making them when this returns."""
    outside = torch.from_numpy(outside_window)
    if post:
        picking = selector.launch(layer, q, outside, first=sink_groups)
        if not picking.ready():
            return ScoredPicks(picking, active)
        groups, valid = picking.result()
    else:
        groups, valid = selector.select(layer, q, outside, first=sink_groups)
    return HostPicks(torch.where(valid, groups, -1), active)


class PrefixOwners:
    """Whose records a sequence's picks name: its own, or for its first ``shared_groups`` groups those of the sequence
    whose prompt prefix it shares (``share_prefix``), so a record both pick is read once."""

    def __init__(self, batch: int):
        self.owner = np.arange(batch)  # per sequence, whose its shared leading groups are (itself: none shared)
        self.shared_groups = np.zeros(batch, dtype=np.int64)

    def reset(self, seq: int) -> None:
        self.owner[seq], self.shared_groups[seq] = seq, 0

    def share(self, seq: int, owner: int, n_groups: int) -> None:
        self.owner[seq], self.shared_groups[seq] = owner, n_groups

    def of(self, groups: np.ndarray) -> np.ndarray:
        """[B, M]: whose record each pick is."""
        return record_owners(groups, self.owner, self.shared_groups)

    def where_shared(self, groups: np.ndarray) -> np.ndarray | None:
        """``of``, or None while no sequence borrows (each row's own records: what the planners take fastest)."""
        return self.of(groups) if self.shared_groups.any() else None
