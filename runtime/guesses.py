"""Which guess a corrected layer attends and when it corrects (``correction: corrected``, runtime/offload/correction.py): the
bookkeeping of the speculate-then-correct loop, apart from the code that reads and attends.  ``ProbeSchedule`` says
which rows correct a layer at a step (``correction_recall``), ``GuessSources`` where each row's guess of a layer comes
from (``guess_from_before``), ``in_rows`` how much of a correction a guess held.  Both keep a row's state apart from
the others': at temperature 0 a request's tokens are the same whatever else is in its batch."""
from __future__ import annotations

import numpy as np

PROBE_STEPS = 8  # steps a layer whose guess held up goes uncorrected before it is corrected and measured again
PROBE_STEPS_MAX = 64  # ... doubled after each probe it passes in a row, up to this


class ProbeSchedule:
    """Which rows correct a layer at a step, with ``correction_recall`` < 1.  A row's layer whose guess held up goes
    uncorrected for ``PROBE_STEPS`` steps, twice as long after each probe it passes in a row (at most
    ``PROBE_STEPS_MAX``); one whose guess fell short corrects every step until it holds up again.  A steady layer is
    then probed a few times a hundred steps instead of every ninth (each probe pays the rescoring and a synchronous
    read), and a layer whose guess slips is corrected again within ``PROBE_STEPS_MAX`` steps.  Each row keeps its own
    schedule, measured on its own picks and started when its sequence starts: a request's picks (so its tokens, to
    the bit) do not depend on the rows beside it."""

    def __init__(self, n_layers: int, batch: int = 1):
        self._until = np.zeros((n_layers, batch), dtype=np.int64)  # [layer, row] -> the first step it corrects again
        self._skip = np.full((n_layers, batch), PROBE_STEPS, dtype=np.int64)  # steps uncorrected after a passed probe

    def reset(self, seq: int | None = None) -> None:
        """Row ``seq``'s schedule (None: every row's) starts again: each layer corrects at the next step."""
        rows = slice(None) if seq is None else seq
        self._until[:, rows] = 0
        self._skip[:, rows] = PROBE_STEPS

    def due(self, layer: int, step: int) -> np.ndarray:
        """[B] bool: the rows that correct ``layer`` at ``step``."""
        return step >= self._until[layer]

    def measured(self, layer: int, step: int, held, rows=True) -> None:
        """``rows`` ([B] bool, or one for all) corrected ``layer`` at ``step``; ``held`` ([B] bool, or one for all): its
        guess had at least ``correction_recall`` of the picks."""
        shape = self._until[layer].shape
        rows, held = np.broadcast_to(rows, shape), np.broadcast_to(held, shape)
        failed, passed = rows & ~held, rows & held
        skip = self._skip[layer]
        skip[failed] = PROBE_STEPS
        self._until[layer, passed] = step + skip[passed]
        skip[passed] = np.minimum(2 * skip[passed], PROBE_STEPS_MAX)


class GuessSources:
    """Where each row's guess of a layer comes from, with ``guess_from_before``: the layer-ahead prediction, or the
    layer's own corrected picks of the step before.  At the first layers the prediction from the layer below is poor
    (SmolLM2 8K: 0.47-0.65 of the corrected picks at layers 1 and 2) while a layer's picks change little from step to
    step (0.84-0.90 there).  A row's layer corrected at two steps in a row switches to its picks of the step before
    when they held more than the prediction did; it switches back when they hold less than the prediction last did.
    Only a layer that corrects every step may: uncorrected, those picks would go stale.  Each row decides on its own
    picks (as ``ProbeSchedule`` does)."""

    def __init__(self, n_layers: int, batch: int = 1):
        self._picks: list[np.ndarray | None] = [None] * n_layers  # layer -> its last corrected picks [B, M], -1: none
        self._made_at = np.full((n_layers, batch), -2, dtype=np.int64)  # the step each row's were made at
        self._ahead_share = np.zeros((n_layers, batch))  # the prediction's share of the corrected picks, when measured
        self._from_before = np.zeros((n_layers, batch), dtype=bool)

    def reset(self, seq: int | None = None) -> None:
        """Row ``seq`` (None: every row) predicts again."""
        rows = slice(None) if seq is None else seq
        self._made_at[:, rows] = -2
        self._from_before[:, rows] = False

    def before(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(the rows [B] that guess ``layer`` with their corrected picks of the step before, those picks [B, M]), or
        None where every row predicts."""
        rows = self._from_before[layer]
        return (rows.copy(), self._picks[layer]) if rows.any() else None

    def corrected(self, layer: int, step: int, groups: np.ndarray, valid: np.ndarray, guessed: np.ndarray,
                  corrects_next, rows=True) -> None:
        """``rows`` ([B] bool, or one for all) corrected ``layer`` at ``step`` to ``groups``/``valid`` [B, M], of which
        their guess held ``guessed``; ``corrects_next`` ([B] bool, or one for all): they correct at the next step too."""
        shape = self._made_at[layer].shape
        rows, corrects_next = np.broadcast_to(rows, shape), np.broadcast_to(corrects_next, shape)
        counted = np.maximum(1, valid.sum(axis=1))
        share = guessed.sum(axis=1) / counted
        from_before = self._from_before[layer]
        staying = rows & from_before
        fresh = rows & ~from_before
        if self._picks[layer] is None:
            self._picks[layer] = np.full(groups.shape, -1, dtype=np.int64)
        held_before = (valid & in_rows(groups, self._picks[layer])).sum(axis=1) / counted
        switching = fresh & corrects_next & (self._made_at[layer] == step - 1) & (held_before > share)
        from_before[staying] = (corrects_next & (share >= self._ahead_share[layer]))[staying]
        self._ahead_share[layer, fresh] = share[fresh]
        from_before[switching] = True
        self._picks[layer][rows] = np.where(valid, groups, -1)[rows]
        self._made_at[layer, rows] = step


def in_rows(groups: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """[B, M] bool: which of ``groups`` row b's ``picks`` (-1: none) hold too."""
    rows = np.arange(len(groups))[:, None]
    held = np.sort(((rows << 32) | picks)[picks >= 0])  # a sorted search: np.isin costs twice as much at M = 205
    if len(held) == 0:
        return np.zeros(groups.shape, dtype=bool)
    keys = (rows << 32) | groups
    return held[np.minimum(np.searchsorted(held, keys), len(held) - 1)] == keys
