"""Speculate, then correct (``correction: corrected``): the layer-ahead guess buys overlap, and once the layer's own
query is known the groups are scored again over the same K_lr; the corrected picks the guess (or the reuse buffer)
already holds are attended where they sit, and only the rest are read before attention, at most ``correction_reads``
per sequence.  Uncapped, a step attends exactly the groups the oracle selector would pick.  With
``correction_recall`` below 1 a layer whose guess held at least that share of its corrected picks is left
uncorrected for a while, then corrected (and measured) again (``ProbeSchedule``): most layers' guesses are good, and a
correction's rescoring and its synchronous reads cost as much where it changes little as where it changes much."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..config import PredictorConfig
from ..fetch_plan import CallsPlanner
from ..forward import merge_attention
from ..guesses import GuessSources, ProbeSchedule, in_rows
from .attention import GatheredAttention
from .io import ReadIO


class CorrectionReads(NamedTuple):
    """A correction's reads in flight, and a flat slot none of them writes (what the other part's gather may read
    in place of the slots still landing)."""

    future: Future
    safe_slot: int


class Correction:
    """The correction stage of a disk policy that guesses a layer ahead.  ``pick(layer, q)``: the selector's picks
    from a query on the host now; ``owners_of(groups)``: whose record each pick is; ``slots``: the policy's
    ``Slots``."""

    def __init__(self, n_layers: int, batch: int, reads_cap: int, predictor: PredictorConfig, planner: CallsPlanner,
                 io: ReadIO, slots, pick: Callable, owners_of: Callable):
        self.reads_cap, self.overlap, self.recall = reads_cap, predictor.correction_overlap, \
            predictor.correction_recall
        self.planner, self.io, self.slots, self._pick, self._owners_of = planner, io, slots, pick, owners_of
        self.steps = 0  # decode steps of the batch (what the probes count)
        self._probes = ProbeSchedule(n_layers)
        self._sources = GuessSources(n_layers) if predictor.guess_from_before else None
        self._guess = np.zeros((batch, 0), dtype=np.int64)  # the attended layer's guessed picks, -1 where none
        self._gates: dict[int, threading.Event] = {}  # layer -> set once its correction read (the next may read)
        self.records = np.zeros(batch, dtype=np.int64)  # records a correction read, per sequence
        self.correction_s = 0.0  # rescoring and the reads it waited for, on the compute thread
        self.recall_counts = np.zeros(2, dtype=np.int64)  # corrected picks the guess had, corrected picks
        self.layer_steps = np.zeros(2, dtype=np.int64)  # layer-steps corrected, layer-steps attended

    def reset(self) -> None:
        """A new prompt: every layer's guess is measured again."""
        self._probes.reset()
        if self._sources is not None:
            self._sources.reset()

    def before(self, layer: int) -> np.ndarray | None:
        """``layer``'s own corrected picks of the step before, where it guesses with those (``guess_from_before``)."""
        return self._sources.before(layer) if self._sources is not None else None

    def end_step(self) -> None:
        self.steps += 1

    def due(self, layer: int) -> bool:
        """Whether ``layer`` corrects its guess this step."""
        return self._probes.due(layer, self.steps)

    def gate(self, layer: int, before_in_flight: bool) -> threading.Event | None:
        """The gate of ``layer``'s reads when the layer before corrects this step (its reads go first, ``ReadIO.read``);
        ``before_in_flight``: the layer before has not attended yet."""
        if before_in_flight and self.due(layer - 1):
            self._gates[layer - 1] = threading.Event()
            return self._gates[layer - 1]
        return None

    def open_gate(self, layer: int) -> None:
        """``layer`` is done with its reads: the next layer's may start."""
        gate = self._gates.pop(layer, None)
        if gate is not None:
            gate.set()

    def open_gates(self) -> None:
        """No correction is coming: queued reads may start (and finish)."""
        for gate in self._gates.values():
            gate.set()

    def landed(self, groups: np.ndarray, valid: np.ndarray) -> None:
        """The guess of the layer about to attend."""
        self._guess = np.where(valid, groups, -1)

    def rescore(self, layer: int, q: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
        """The layer's picks scored again with its own query where it corrects this step (while the guess's reads may
        still be landing), else None."""
        correcting = self.due(layer)
        self.layer_steps += [correcting, 1]
        if not correcting:
            return None
        started = time.perf_counter()
        picks = self._pick(layer, q)
        self.correction_s += time.perf_counter() - started
        return picks

    def attend(self, layer: int, q: torch.Tensor, corrected: tuple[np.ndarray, np.ndarray],
               attention: GatheredAttention, resident: torch.Tensor) -> torch.Tensor:
        """The layer's attention over its corrected picks; with ``correction_overlap`` the picks in memory are
        attended while the correction's reads land, then those, the two parts merged by log-sum-exp."""
        slots, valid, late = self._correct(layer, *corrected)
        if late is None:
            return attention(layer, q, slots, valid, resident)
        reads, arriving = late
        parts = [attention.part(layer, q, np.where(arriving, reads.safe_slot, slots), valid & ~arriving, resident)]
        started = time.perf_counter()
        self.io.wait(layer, reads.future)
        self.correction_s += time.perf_counter() - started
        self.open_gate(layer)
        columns = np.argsort(~arriving, axis=1, kind="stable")[:, : int(arriving.sum(axis=1).max())]
        parts.append(attention.part(layer, q, np.take_along_axis(slots, columns, 1),
                                    np.take_along_axis(arriving, columns, 1)))
        return merge_attention(parts, q.dtype)

    def _correct(self, layer: int, groups: np.ndarray, valid: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, tuple[CorrectionReads, np.ndarray] | None]:
        """``groups``/``valid``: the picks scored again with the layer's own query; those in memory (the guess's, or
        still in the reuse slots) are attended where they are and the rest read now, at most ``reads_cap`` per
        sequence (past the cap, the guess's other picks stand in).  Returns the corrected (slots, valid) and, with
        ``correction_overlap`` while reads are pending, (the reads, which picks they bring [B, M]); else the reads
        have landed."""
        started = time.perf_counter()
        guessed = valid & in_rows(groups, self._guess)  # the corrected picks the guess had
        from_before = self.before(layer) is not None
        if self.recall < 1:  # a guess from the step before goes stale uncorrected: it keeps correcting
            self._probes.measured(layer, self.steps, not from_before and valid.any()
                                  and guessed.sum() >= self.recall * valid.sum())
        if self._sources is not None:
            self._sources.corrected(layer, self.steps, groups, valid, guessed, self._probes.due(layer, self.steps + 1))
        owners = self._owners_of(groups)
        missing = valid & ~self.slots.resident(layer, groups, owners)
        over = missing & (np.cumsum(missing, axis=1) > self.reads_cap)
        if over.any():  # past the cap the guess's picks stand in: each one the guess had
            groups, valid = _fill_from_guess(groups, valid, over, self._guess)
            owners = self._owners_of(groups)
            missing &= ~over  # the guess's picks standing in are in memory
            guessed = (guessed & ~over) | (valid & over)
        self.recall_counts += [int(guessed.sum()), int(valid.sum())]
        plan = self.planner.correct(layer, groups, valid, owners)
        late = None
        gate = self._gates.get(layer)  # the next layer's read, waiting for this one's (opened again at attention)
        if len(plan.misses.seq):
            future = self.io.submit_fix(layer, self.slots.buffer_index(layer), plan.misses, plan.reads)
            if gate is not None:  # it starts as this one lands, not once this layer has attended
                future.add_done_callback(lambda _: gate.set())
            self.records += np.bincount(plan.misses.seq, minlength=len(self.records))
            safe_slot = _free_slot(plan.misses.slot) if self.overlap else -1
            if 0 <= safe_slot < len(self.records) * self.slots.capacity:
                late = CorrectionReads(future, safe_slot), missing
            else:  # one attention once they land (no overlap asked, or every slot is landing)
                self.io.wait(layer, future)
        elif gate is not None:
            gate.set()
        self.correction_s += time.perf_counter() - started
        return plan.slots, valid, late

    def stats(self, seq: int) -> dict:
        recalled, corrected = self.recall_counts
        corrected_layers, attended = self.layer_steps
        return {"kv_correction_records": int(self.records[seq]), "correction_s": self.correction_s,
                "guess_recall": float(recalled / corrected) if corrected else None,
                "corrected_layer_share": float(corrected_layers / attended) if attended else None}


def _free_slot(written: np.ndarray) -> int:
    """The lowest flat slot not among ``written``."""
    taken = np.zeros(len(written) + 1, dtype=bool)
    taken[written[written <= len(written)]] = True
    return int(np.argmin(taken))


def _fill_from_guess(groups: np.ndarray, valid: np.ndarray, over: np.ndarray, guess: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Corrected picks past the cap of extra reads (``over``) give way to the guess's picks the correction
    dropped (in memory already), the guess's best first; with none left a pick is dropped."""
    groups, valid = groups.copy(), valid & ~over
    for b in np.flatnonzero(over.any(axis=1)):
        spare = guess[b][(guess[b] >= 0) & ~np.isin(guess[b], groups[b][valid[b]])]
        at = np.flatnonzero(over[b])[: len(spare)]
        groups[b, at], valid[b, at] = spare[: len(at)], True
    return groups, valid
