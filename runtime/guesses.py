"""Which guess a corrected layer attends and when it corrects (``correction: corrected``, runtime/offload/correction.py): the
bookkeeping of the speculate-then-correct loop, apart from the code that reads and attends.  ``ProbeSchedule`` says
which layers correct at a step (``correction_recall``), ``GuessSources`` where each layer's guess comes from
(``guess_from_before``), ``in_rows`` how much of a correction a guess held."""
from __future__ import annotations

import numpy as np

PROBE_STEPS = 8  # steps a layer whose guess held up goes uncorrected before it is corrected and measured again
PROBE_STEPS_MAX = 64  # ... doubled after each probe it passes in a row, up to this


class ProbeSchedule:
    """Which layers correct at a step, with ``correction_recall`` < 1.  A layer whose guess held up goes uncorrected
    for ``PROBE_STEPS`` steps, twice as long after each probe it passes in a row (at most ``PROBE_STEPS_MAX``); one
    whose guess fell short corrects every step until it holds up again.  A steady layer is then probed a few times a
    hundred steps instead of every ninth (each probe pays the rescoring and a synchronous read), and a layer whose
    guess slips is corrected again within ``PROBE_STEPS_MAX`` steps."""

    def __init__(self, n_layers: int):
        self._until = np.zeros(n_layers, dtype=np.int64)  # layer -> the first step it corrects again
        self._skip = np.full(n_layers, PROBE_STEPS, dtype=np.int64)  # layer -> steps uncorrected after a passed probe

    def reset(self) -> None:
        self._until[:] = 0
        self._skip[:] = PROBE_STEPS

    def due(self, layer: int, step: int) -> bool:
        return step >= self._until[layer]

    def measured(self, layer: int, step: int, held: bool) -> None:
        """``layer`` corrected at ``step``; ``held``: its guess had at least ``correction_recall`` of the picks."""
        if not held:
            self._skip[layer] = PROBE_STEPS
            return
        self._until[layer] = step + self._skip[layer]
        self._skip[layer] = min(2 * self._skip[layer], PROBE_STEPS_MAX)


class GuessSources:
    """Where each layer's guess comes from, with ``guess_from_before``: the layer-ahead prediction, or the layer's own
    corrected picks of the step before.  At the first layers the prediction from the layer below is poor (SmolLM2
    8K: 0.47-0.65 of the corrected picks at layers 1 and 2) while a layer's picks change little from step to step
    (0.84-0.90 there).  A layer corrected at two steps in a row switches to its picks of
    the step before when they held more than the prediction did; it switches back when they hold less than the
    prediction last did.  Only a layer that corrects every step may: uncorrected, those picks would go stale."""

    def __init__(self, n_layers: int):
        self._picks: list[np.ndarray | None] = [None] * n_layers  # layer -> its last corrected picks [B, M], -1: none
        self._made_at = np.full(n_layers, -2, dtype=np.int64)  # the step they were made at
        self._ahead_share = np.zeros(n_layers)  # the prediction's share of the corrected picks, when last measured
        self._from_before = np.zeros(n_layers, dtype=bool)

    def reset(self) -> None:
        self._picks = [None] * len(self._picks)
        self._made_at[:] = -2
        self._from_before[:] = False

    def before(self, layer: int) -> np.ndarray | None:
        """The picks ``layer`` guesses with this step (its corrected picks of the step before), or None: predict."""
        return self._picks[layer] if self._from_before[layer] else None

    def corrected(self, layer: int, step: int, groups: np.ndarray, valid: np.ndarray, guessed: np.ndarray,
                  corrects_next: bool) -> None:
        """``layer`` corrected at ``step`` to ``groups``/``valid`` [B, M], of which its guess held ``guessed``;
        ``corrects_next``: it corrects at the next step too."""
        share = guessed.sum() / max(1, valid.sum())
        if self._from_before[layer]:
            self._from_before[layer] = corrects_next and share >= self._ahead_share[layer]
        else:
            self._ahead_share[layer] = share
            if corrects_next and self._made_at[layer] == step - 1:
                before = (valid & in_rows(groups, self._picks[layer])).sum() / max(1, valid.sum())
                self._from_before[layer] = before > share
        self._picks[layer] = np.where(valid, groups, -1)
        self._made_at[layer] = step


def in_rows(groups: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """[B, M] bool: which of ``groups`` row b's ``picks`` (-1: none) hold too."""
    rows = np.arange(len(groups))[:, None]
    held = np.sort(((rows << 32) | picks)[picks >= 0])  # a sorted search: np.isin costs twice as much at M = 205
    if len(held) == 0:
        return np.zeros(groups.shape, dtype=bool)
    keys = (rows << 32) | groups
    return held[np.minimum(np.searchsorted(held, keys), len(held) - 1)] == keys
