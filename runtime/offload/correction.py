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
        self._probes = ProbeSchedule(n_layers, batch)
        self._sources = GuessSources(n_layers, batch) if predictor.guess_from_before else None
        self._guess = np.zeros((batch, 0), dtype=np.int64)  # the attended layer's guessed picks, -1 where none
        self._guess_slots = self._guess  # ... and their flat slots
        self._correcting = np.zeros(batch, dtype=bool)  # the rows correcting the attended layer
        self._gates: dict[int, threading.Event] = {}  # layer -> set once its correction read (the next may read)
        self.records = np.zeros(batch, dtype=np.int64)  # records a correction read, per sequence
        self.correction_s = 0.0  # rescoring and the reads it waited for, on the compute thread
        self.recall_counts = np.zeros(2, dtype=np.int64)  # corrected picks the guess had, corrected picks
        self.layer_steps = np.zeros(2, dtype=np.int64)  # layer-steps corrected, layer-steps attended

    def reset(self, seq: int) -> None:
        """A new prompt in row ``seq``: its every layer's guess is measured again (the other rows' stand)."""
        self._probes.reset(seq)
        if self._sources is not None:
            self._sources.reset(seq)

    def before(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(the rows [B] that guess ``layer`` with their own corrected picks of the step before, those picks [B, M])
        (``guess_from_before``), or None where every row predicts."""
        return self._sources.before(layer) if self._sources is not None else None

    def end_step(self) -> None:
        self.steps += 1

    def due(self, layer: int, active: np.ndarray) -> np.ndarray:
        """[B] bool: the ``active`` rows that correct their guess of ``layer`` this step."""
        return self._probes.due(layer, self.steps) & active

    def gate(self, layer: int, before_in_flight: bool, active: np.ndarray) -> threading.Event | None:
        """The gate of ``layer``'s reads when the layer before corrects this step (its reads go first, ``ReadIO.read``);
        ``before_in_flight``: the layer before has not attended yet."""
        if before_in_flight and self.due(layer - 1, active).any():
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

    def landed(self, groups: np.ndarray, valid: np.ndarray, slots: np.ndarray) -> None:
        """The guess of the layer about to attend, and its flat slots."""
        self._guess, self._guess_slots = np.where(valid, groups, -1), slots

    def rescore(self, layer: int, q: torch.Tensor, active: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The layer's picks scored again with its own query where a row corrects it this step (while the guess's
        reads may still be landing), else None."""
        self._correcting = self.due(layer, active)
        self.layer_steps += [int(self._correcting.sum()), int(active.sum())]
        if not self._correcting.any():
            return None
        started = time.perf_counter()
        picks = self._pick(layer, q)
        self.correction_s += time.perf_counter() - started
        return picks

    def attend(self, layer: int, q: torch.Tensor, corrected: tuple[np.ndarray, np.ndarray],
               attention: GatheredAttention, resident: torch.Tensor) -> torch.Tensor:
        """The layer's attention over its corrected picks (a row not correcting it this step: over its guess);
        with ``correction_overlap`` the picks in memory are attended while the correction's reads land, then those,
        the two parts merged by log-sum-exp.  A row's numbers are its own whatever the rows beside it: the late part
        spans ``reads_cap`` picks in every row, and a row none of whose picks arrive late is attended in one piece, as
        it would be alone."""
        slots, valid, late = self._correct(layer, *corrected)
        if late is None:
            return attention(layer, q, slots, valid, resident)
        reads, arriving = late
        parts = [attention.part(layer, q, np.where(arriving, reads.safe_slot, slots), valid & ~arriving, resident)]
        whole = ~arriving.any(axis=1)
        in_one = attention(layer, q, slots, valid, resident) if whole.any() else None
        started = time.perf_counter()
        self.io.wait(layer, reads.future)
        self.correction_s += time.perf_counter() - started
        self.open_gate(layer)
        columns = np.argsort(~arriving, axis=1, kind="stable")[:, : self.reads_cap]
        parts.append(attention.part(layer, q, np.take_along_axis(slots, columns, 1),
                                    np.take_along_axis(arriving, columns, 1)))
        merged = merge_attention(parts, q.dtype)
        if in_one is None:
            return merged
        whole = torch.from_numpy(whole).to(merged.device)[:, None, None, None]
        return torch.where(whole, in_one, merged)

    def _correct(self, layer: int, groups: np.ndarray, valid: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, tuple[CorrectionReads, np.ndarray] | None]:
        """``groups``/``valid``: the picks scored again with the layer's own query; in the rows correcting it, those
        in memory (the guess's, or still in the reuse slots) are attended where they are and the rest read now, at
        most ``reads_cap`` per sequence (past the cap, the guess's other picks stand in); the other rows attend their
        guess as it landed.  Returns the (slots, valid) attended and, with ``correction_overlap`` while reads are
        pending, (the reads, which picks they bring [B, M]); else the reads have landed."""
        started = time.perf_counter()
        rows = self._correcting
        valid = valid & rows[:, None]
        guessed = valid & in_rows(groups, self._guess)  # the corrected picks the guess had
        before = self.before(layer)
        from_before = before[0] if before is not None else np.zeros(len(rows), dtype=bool)
        if self.recall < 1:  # a guess from the step before goes stale uncorrected: it keeps correcting
            self._probes.measured(layer, self.steps, ~from_before & valid.any(axis=1)
                                  & (guessed.sum(axis=1) >= self.recall * valid.sum(axis=1)), rows)
        if self._sources is not None:
            self._sources.corrected(layer, self.steps, groups, valid, guessed, self._probes.due(layer, self.steps + 1),
                                    rows)
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
        guessing = ~rows[:, None]
        return (np.where(guessing, self._guess_slots, plan.slots), np.where(guessing, self._guess >= 0, valid),
                late)

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
