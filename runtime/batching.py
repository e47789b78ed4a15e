"""A decode batch: the one owner of the step pipeline (its policy, its prefills, its decode steps, its stats).

Rows are sequences that join between steps and leave when done (continuous batching): the engine's
``generate`` fills every row, steps until all are done and closes; a server keeps one open and refills a row
as soon as its sequence leaves.  The policy is built once, from the registry (runtime/policies/), for ``rows``
sequences of one solution (its memory plan holds them all); a row's KV files live from its ``join`` to its
``leave``.  A prompt's KV comes through the ``PrefillChain`` (prompt cache -> context store -> compute).
Sampling stays with the caller: a step returns logits.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import RuntimeConfig
from .devices import decode_threads, intra_op_threads
from .errors import RowsFailed
from .hybrid import build_policy
from .transfer import to_device
from .prefill_chain import Prefilled, PrefillChain

STATS_CONFIG_KEYS = ("G", "M", "C", "sigma", "reuse", "rolling_buffer", "max_context", "kv_record_dtype")  # per result


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens or max_context)
    stats: dict = field(default_factory=dict)
    logits: torch.Tensor | None = None  # [generated, vocab] float32, with output_logits=True


class RunningBatch:
    def __init__(self, engine, rows: int, cfg: RuntimeConfig):
        """``engine``: what the batch runs on (its model, policy spec and env, adapters, events, tokenizer and the
        prefill sources it has attached: prompt cache, context store, TTFT options)."""
        self.engine = engine
        self.model = engine.model
        self.rows = rows
        self.cfg = cfg
        self.policy = build_policy(engine.spec, engine.policy_env, rows, cfg)
        self.prefill = PrefillChain(engine.model, engine.prompt_cache, engine.context_store, engine.ttft,
                                    engine.events.emit)
        self.active = np.zeros(rows, dtype=bool)
        self.prompts: list[list[int] | None] = [None] * rows
        self.prefill_s = np.zeros(rows)
        self.steps = 0
        self._closed = False
        self.decode_threads = decode_threads(self.model.device, cfg.io.decode_cpu_threads, engine.spec.on_disk,
                                             self.model.computes_aside)

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

    # ---- prefill -----------------------------------------------------------------------------

    @torch.inference_mode()
    def join(self, row: int, ids: list[int], owner: tuple[int, int] | None = None, keep_kv: bool = False) -> Prefilled:
        """Prefill ``ids`` into ``row`` (free); returns how (the last prompt token's logits [V], its source and
        stats, and its K/V per layer with ``keep_kv``).  ``owner``: (row, groups) whose leading groups ``ids``
        shares (``share_prefix``).  Call ``end_prefill`` before the next ``step``."""
        if self.active[row]:
            raise ValueError(f"row {row} of the batch is taken: leave it first")
        events, policy = self.engine.events, self.policy
        events.emit("prefill_start", seq=row, tokens=len(ids))
        start = time.perf_counter()
        policy.start_sequence(row)
        if owner is not None:
            policy.share_prefix(row, *owner)
        filled = self.prefill(policy, row, ids, keep_kv)
        policy.end_prompt(row, len(ids))
        self.prefill_s[row] = time.perf_counter() - start
        self.prompts[row] = ids
        self.active[row] = True
        events.emit("prefill_end", seq=row, tokens=len(ids))
        return filled

    def end_prefill(self) -> None:
        """The rows joined since the last step are stored: the selector may fit on them, decoding goes on."""
        self.policy.end_prefill()
        self.engine.adapters.keep_fitted(*self.policy.fitted_adapter(), self.cfg)

    # ---- decode ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, active: np.ndarray | None = None, rows_fail_alone: bool = False
             ) -> torch.Tensor:
        """One decode step: ``tokens`` [rows] are the inputs (any value in a row not ``active``); logits [rows, V].
        ``active`` defaults to the rows joined and not left.  Per layer, top to bottom: the policy selects and
        fetches the next layer's KV (overlapping this layer), this layer attends, and after the last layer the
        step's tokens are appended (and full groups flushed).  A flush that fails for some rows only raises the
        first failed row's error, the whole step failed; with ``rows_fail_alone``, ``RowsFailed`` with the step's
        logits instead: the other rows go on from them, the failed ones leave."""
        active = self.active.copy() if active is None else active
        events, model, policy = self.engine.events, self.model, self.policy
        full = np.flatnonzero(active & (policy.lengths >= self.cfg.max_context))
        if len(full):  # the step's token would be written past the row's KV (a disk policy's K_lr, a full cache)
            raise ValueError(f"row {int(full[0])} holds max_context={self.cfg.max_context} tokens, so a step has no "
                             "room for its token: leave the row (its result is complete), or open the batch with a "
                             "larger max_context")
        events.emit("decode_step_start", step=self.steps, active=int(active.sum()))
        with intra_op_threads(self.decode_threads):
            x = model.embed(to_device(tokens[:, None], model.device))
            rope = model.rope(to_device(policy.lengths, model.device)[:, None])
            policy.prefetch(0, x, rope, active)
            for layer in range(model.dims.n_layers):
                if layer + 1 < model.dims.n_layers:
                    policy.prefetch(layer + 1, x, rope, active)
                q, k, v = model.qkv(layer, x, rope)
                x = model.finish_layer(layer, x, policy.attend(layer, q, k, v))
            logits = model.logits(x[:, 0])
            partial = None
            try:
                policy.end_step(active)
            except RowsFailed as failed:
                if not rows_fail_alone:
                    raise failed.first
                failed.logits, partial = logits, failed  # the step is whole for the other rows: it ends as any does
        events.emit("decode_step_end", step=self.steps, active=int(active.sum()))
        self.steps += 1
        if partial is not None:
            raise partial
        return logits

    # ---- results and release -----------------------------------------------------------------

    def result(self, row: int, generated: list[int], stops: set[int], decode_s: float):
        """The row's GenerationResult, its stats as of now (the policy's, and the batch's configuration)."""
        engine, cfg = self.engine, self.cfg
        prompt, decode_tokens = self.prompts[row], len(generated) - 1
        policy_stats = self.policy.stats(row)
        stats = {
            "policy": engine.policy_name,
            "prompt_tokens": len(prompt),
            "generated_tokens": len(generated),
            "prefill_s": float(self.prefill_s[row]),
            "decode_s": float(decode_s),
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            **policy_stats,
            "io_stall_share": policy_stats["io_stall_s"] / decode_s if decode_s > 0 else 0.0,
            "batch_size": self.rows,
            "synthetic_weights": self.model.synthetic,  # random weights (synth:NAME): timings count, tokens do not
            "reader": engine.reader.name if engine.reader else None,
            "decode_threads": self.decode_threads or torch.get_num_threads(),  # torch's intra-op threads, on the CPU
            "config": {k: v for k, v in cfg.to_dict().items() if k in STATS_CONFIG_KEYS} | {"rank": engine.adapters.rank(cfg)},
        }
        text = engine.tokenizer.decode(generated, skip_special_tokens=True) if engine.tokenizer else ""
        finish = "stop" if generated[-1] in stops else "length"
        return GenerationResult(generated, text, finish, stats)

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
