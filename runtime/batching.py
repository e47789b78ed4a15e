"""A decode batch whose rows sequences join between steps and leave when done (continuous batching).

The engine's ``generate`` fills every row, steps until all are done and closes; a server keeps one
open and refills a row as soon as its sequence leaves.  The policy is built once for ``rows``
sequences from one solution (its memory plan holds them all); a row's KV files live from its
``join`` to its ``leave``.  Sampling stays with the caller: a step returns logits.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from .config import RuntimeConfig


class RunningBatch:
    def __init__(self, engine, rows: int, cfg: RuntimeConfig):
        self.engine = engine
        self.rows = rows
        self.cfg = cfg
        self.policy = engine._make_policy(rows, cfg)
        self.active = np.zeros(rows, dtype=bool)
        self.prompts: list[list[int] | None] = [None] * rows
        self.prefill_s = np.zeros(rows)
        self.steps = 0
        self._closed = False

    @property
    def max_context(self) -> int:
        return self.cfg.max_context

    @property
    def io_stall_s(self) -> float:
        """Seconds the decode steps of this batch waited for KV reads, since it opened."""
        return self.policy.io_stall_s

    @property
    def resident_bytes(self) -> int:
        return self.policy.resident_bytes

    def free_rows(self) -> list[int]:
        return [int(r) for r in np.flatnonzero(~self.active)]

    @torch.inference_mode()
    def join(self, row: int, ids: list[int], owner: tuple[int, int] | None = None) -> torch.Tensor:
        """Prefill ``ids`` into ``row`` (free); returns the last prompt token's logits [V].  ``owner``: (row, groups)
        whose leading groups ``ids`` shares (``share_prefix``).  Call ``end_prefill`` before the next ``step``."""
        if self.active[row]:
            raise ValueError(f"row {row} of the batch is taken: leave it first")
        events, policy = self.engine.events, self.policy
        events.emit("prefill_start", seq=row, tokens=len(ids))
        start = time.perf_counter()
        policy.start_sequence(row)
        if owner is not None:
            policy.share_prefix(row, *owner)
        logits = self.engine._prefill(policy, row, ids)
        policy.end_prompt(row, len(ids))
        self.prefill_s[row] = time.perf_counter() - start
        self.prompts[row] = ids
        self.active[row] = True
        events.emit("prefill_end", seq=row, tokens=len(ids))
        return logits

    def end_prefill(self) -> None:
        """The rows joined since the last step are stored: the selector may fit on them, decoding goes on."""
        self.policy.end_prefill()
        self.engine._keep_fitted_adapter(self.policy, self.cfg)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, active: np.ndarray | None = None) -> torch.Tensor:
        """One decode step: ``tokens`` [rows] are the inputs (any value in a row not ``active``); logits [rows, V].
        ``active`` defaults to the rows joined and not left."""
        active = self.active.copy() if active is None else active
        events = self.engine.events
        events.emit("decode_step_start", step=self.steps, active=int(active.sum()))
        logits = self.engine._decode_step(self.policy, tokens, active)
        self.policy.end_step(active)
        events.emit("decode_step_end", step=self.steps, active=int(active.sum()))
        self.steps += 1
        return logits

    def result(self, row: int, generated: list[int], stops: set[int], decode_s: float):
        """The row's GenerationResult (its stats as of now)."""
        return self.engine._result(self.policy, self.cfg, row, self.prompts[row], generated, stops,
                                   float(self.prefill_s[row]), decode_s)

    def leave(self, row: int) -> None:
        """The row's sequence is done: its KV files are removed now, the row takes the next join."""
        self.active[row] = False
        self.prompts[row] = None
        self.policy.release_sequence(row)

    def close(self) -> None:
        """Wait for reads in flight, then release every row (files included); the first error is raised after."""
        if self._closed:
            return
        self._closed = True
        try:
            self.policy.close()
        finally:
            for row in range(self.rows):
                self.policy.release_sequence(row)
            self.active[:] = False

    def abort(self) -> None:
        """``close`` after a failed step: the step's own error surfaces, not one of a read abandoned with it."""
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()
