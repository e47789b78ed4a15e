"""Continuous batching: one thread owns the engine; requests join the running batch at step boundaries.

Each loop turn: rows whose client left are freed, queued requests are prefilled into free rows (up to the
batch's rows, FIFO), then one decode step runs for every row.  A sequence leaves the moment it is done and its
KV files go with it.  The batch is built with the solution for (rows, context) where context covers the
requests waiting when it is built; a request needing a longer context than the running batch holds waits
(and holds the queue behind it) until the batch drains, and the next batch is built for it.  The HTTP side
talks to this thread only through ``submit`` / ``cancel`` and each job's ``notify`` callback.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from edgekv.runtime.errors import DiskError, RowsFailed
from edgekv.runtime.sampling import Sampler

from .metrics import ServerMetrics
from .text import TextStream

log = logging.getLogger(__name__)

PENDING_SAVES_MAX = 4  # prompts whose KV waits for the context store writer; more are not saved (memory)


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"{waiting} requests are waiting (the queue limit): retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ServerClosing(Exception):
    pass


@dataclass
class Job:
    """One request's sequence.  ``notify(kind, data)`` is called from the scheduler thread with ``"text"``
    ({"text", "tokens"}), then ``"done"`` ({"finish_reason", "completion_tokens", "stats"}) or ``"error"``
    ({"status", "message"}); the HTTP side makes it thread-safe."""

    ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: set[int]
    text: TextStream
    notify: Callable[[str, dict], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    save_prompt: bool = False  # keep the prompt's KV in the context store (a chat: its next turn starts with it)
    request_id: str = "-"  # the response's id: what the server's log files a failure under
    first_at: float | None = None
    last_at: float | None = None  # when its latest token came
    generated: list[int] = field(default_factory=list)

    @property
    def context_tokens(self) -> int:
        return len(self.ids) + self.max_tokens


class Scheduler:
    def __init__(self, engine, metrics: ServerMetrics, max_queue: int, rows: int | None = None,
                 save_prompts: bool = False):
        self.engine = engine
        engine.pin_adapter()  # one projection for every request: none's prompt shapes another's picks
        self.metrics = metrics
        self.max_queue = max_queue
        self.rows = rows or engine.config.max_batch
        self.batch = None  # a runtime RunningBatch, built when requests come
        self.jobs: dict[int, Job] = {}  # row -> its job
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._closing_at: float | None = None  # drain: jobs still running then end with an error event
        self._recent_s: collections.deque[float] = collections.deque(maxlen=32)  # durations, for Retry-After
        self._saves = ThreadPoolExecutor(1, thread_name_prefix="edgekv-save") if save_prompts else None
        self._save_slots = threading.BoundedSemaphore(PENDING_SAVES_MAX)
        self._thread = threading.Thread(target=self._loop, name="edgekv-scheduler", daemon=True)

    # ---- the HTTP side -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping or self._closing_at is not None:
                raise ServerClosing("the server is shutting down: retry on another instance or after it restarts")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(len(self._queue), self._retry_after_s())
            self._queue.append(job)
            self.metrics.waiting.set(len(self._queue))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client left: its row is freed before the next step (a queued job is dropped when reached)."""
        job.cancelled.set()
        with self._cv:
            self._cv.notify()

    def drain(self, grace_s: float) -> None:
        """Shutdown began: no new job is taken; jobs not done within ``grace_s`` end with an error event."""
        with self._cv:
            self._closing_at = time.monotonic() + grace_s
            self._cv.notify()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Jobs still queued or running end with an error event; the batch's KV files are removed."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self._shutdown()

    def _retry_after_s(self) -> int:
        """Seconds until the queue has likely moved by one batch: the mean recent request time."""
        mean = sum(self._recent_s) / len(self._recent_s) if self._recent_s else 1.0
        return max(1, round(mean * len(self._queue) / self.rows))

    # ---- the loop ----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._queue or self.jobs):
                        self._cv.wait()
                    if self._stopping:
                        return
                try:
                    self._turn()
                except Exception as exc:  # e.g. a KV file that cannot be closed: the rows running end, serving goes on
                    log.exception("scheduler: %s", exc)
                    self._fail_running(exc)
        finally:
            self._shutdown()

    def _turn(self) -> None:
        """Free the rows of clients that left, fill free rows from the queue, run one step."""
        if self._closing_at is not None and time.monotonic() >= self._closing_at:
            self._fail_all(ServerClosing("the server shut down before this request finished"), 503)
            self._close_batch()
            return
        self._free_cancelled()
        self._admit()
        if self.jobs:
            self._step()

    def _free_cancelled(self) -> None:
        for row, job in list(self.jobs.items()):
            if job.cancelled.is_set():
                self._leave(row, job)
                self.metrics.cancelled.inc()

    def _next_job(self) -> Job | None:
        with self._cv:
            while self._queue and self._queue[0].cancelled.is_set():
                self._queue.popleft()
                self.metrics.cancelled.inc()
            self.metrics.waiting.set(len(self._queue))
            return self._queue[0] if self._queue else None

    def _admit(self) -> None:
        joined = False
        while (job := self._next_job()) is not None:
            if self.batch is not None and not self.jobs and self._solution_changes(job):
                self._close_batch()  # idle: the next requests get their own solution
            if self.batch is not None and job.context_tokens > self.batch.max_context:
                break  # the running batch cannot hold it: drain, then build one that can
            if self.batch is None and not self._open_batch(job):
                continue
            free = self.batch.free_rows()
            if not free:
                break
            with self._cv:
                self._queue.popleft()
                self.metrics.waiting.set(len(self._queue))
            joined |= self._join(free[0], job)
        if joined:
            self.batch.end_prefill()

    def _open_batch(self, job: Job) -> bool:
        """A batch for the requests at the head of the queue; one that cannot be built fails the head request."""
        with self._cv:
            context = max(j.context_tokens for j in list(self._queue)[: self.rows])
        try:
            self.batch = self.engine.open_batch(self.rows, context)
            return True
        except Exception as exc:
            log.error("cannot open a batch for %d tokens: %s", context, exc)
            with self._cv:
                self._queue.remove(job)
            self._fail(job, exc)
            return False

    def _solution_changes(self, job: Job) -> bool:
        return self.engine.batch_config(self.rows, job.context_tokens) != self.batch.cfg

    def _join(self, row: int, job: Job) -> bool:
        keep = job.save_prompt and self._saves is not None
        try:
            filled = self.batch.join(row, job.ids, keep_kv=keep)
        except Exception as exc:  # this prompt's prefill failed (its store chunk, its disk write): the others go on
            log.warning("prefill failed: %s", exc)
            self.batch.leave(row)
            self._fail(job, exc)
            return False
        self.jobs[row] = job
        self._rows_changed()
        self.metrics.prompt_tokens.inc(len(job.ids))
        self.metrics.prompt_tokens_stored.inc(filled.stats.get("stored_tokens", 0))
        if keep:
            self._save_prompt(job.ids, filled.kv)
        self._next_token(row, job, filled.logits[None].float())
        return True

    def _step(self) -> None:
        tokens = torch.zeros(self.rows, dtype=torch.long)
        for row, job in self.jobs.items():
            tokens[row] = job.generated[-1]
        stall_before, start = self.batch.io_stall_s, time.perf_counter()
        try:
            logits = self.batch.step(tokens, rows_fail_alone=True)
        except RowsFailed as failed:  # some rows' records could not be written: those rows end, the others go on
            logits = failed.logits
            for row, exc in failed.rows.items():
                job = self.jobs[row]
                self._leave(row, job)
                self._fail(job, exc)
        except Exception as exc:  # the step's state is lost for every row: they end with this error, the batch closes
            log.error("decode step failed: %s", exc)
            self._fail_running(exc)
            return
        self.metrics.step(time.perf_counter() - start, self.batch.io_stall_s - stall_before)
        for row, job in list(self.jobs.items()):
            self._next_token(row, job, logits[row : row + 1])

    def _next_token(self, row: int, job: Job, logits: torch.Tensor) -> None:
        """Sample this row's token and give it out.  What fails here is this request's own (its sampling, its
        text): it ends this row only, the batch's other rows never see it."""
        try:
            token = int(job.sampler(logits)[0])
            self._take(row, job, token)
        except Exception as exc:
            log.exception("request %s: its token could not be given out", job.request_id)
            if self.jobs.get(row) is job:
                self._leave(row, job)
            self._fail(job, exc)

    def _take(self, row: int, job: Job, token: int) -> None:
        """One generated token: its text goes out; a stop token, a stop string or max_tokens ends the job."""
        now = time.monotonic()
        if job.first_at is None:
            job.first_at = now
            self.metrics.ttft.observe(now - job.arrived)
        else:
            self.metrics.inter_token.observe(now - job.last_at)
        job.last_at = now
        job.generated.append(token)
        self.metrics.generation_tokens.inc()
        text = job.text.push(token)
        finish = "stop" if token in job.stop_ids or job.text.stopped else (
            "length" if len(job.generated) >= job.max_tokens else None)
        if finish is not None:
            text += job.text.finish()
        if text or job.text.tokenizer is None:  # no tokenizer (the fixture): an empty chunk per token shows progress
            job.notify("text", {"text": text, "tokens": len(job.generated)})
        if finish is not None:
            stats = self._leave(row, job)
            decode_s = now - job.first_at
            if len(job.generated) > 1 and decode_s > 0:
                self.metrics.decode_rate.observe((len(job.generated) - 1) / decode_s)
            self._recent_s.append(now - job.arrived)
            job.notify("done", {"finish_reason": finish, "completion_tokens": len(job.generated), "stats": stats})

    def _leave(self, row: int, job: Job) -> dict:
        decode_s = time.monotonic() - job.first_at if job.first_at else 0.0
        # a row whose first token failed has no result: its prefill read nothing a decode step counts
        stats = self.batch.result(row, job.generated, job.stop_ids, decode_s).stats if job.generated else {}
        self.batch.leave(row)
        self.jobs.pop(row, None)
        self._rows_changed()
        self.metrics.sequence_done(stats)
        return stats

    def _rows_changed(self) -> None:
        """What the gauges show changes only when a sequence joins or leaves: set here, not every step."""
        self.metrics.running.set(len(self.jobs))
        self.metrics.kv_resident_bytes.set(self.batch.resident_bytes)

    # ---- failures and shutdown ---------------------------------------------------------------

    @staticmethod
    def _fail(job: Job, exc: BaseException, status: int = 500) -> None:
        """The client hears what it can act on: that the server is closing (503), that the KV disk is full (507)
        or cannot be used (503), in the sentence the log has, or that its request failed and under which id the
        server's log names the cause (paths and exception types stay in the log)."""
        if isinstance(exc, ServerClosing):
            message = str(exc)
        elif isinstance(exc, DiskError):
            status, message = 507 if exc.full else 503, f"{exc} (request {job.request_id})"
            log.warning("request %s failed (%d): %s", job.request_id, status, exc)
        else:
            log.warning("request %s failed: %s: %s", job.request_id, type(exc).__name__, exc)
            message = f"the server could not finish this request; its log says why (request {job.request_id})"
        job.notify("error", {"status": status, "message": message})

    def _fail_running(self, exc: BaseException) -> None:
        """The running rows end with ``exc``; the batch is dropped (its files removed), queued requests go on."""
        for job in self.jobs.values():
            self._fail(job, exc)
        self.jobs.clear()
        self.metrics.running.set(0)
        batch, self.batch = self.batch, None
        if batch is not None:
            batch.abort()

    def _fail_all(self, exc: BaseException, status: int = 500) -> None:
        with self._cv:
            waiting, self._queue = list(self._queue), collections.deque()
        for job in [*self.jobs.values(), *waiting]:
            self._fail(job, exc, status)
        self.jobs.clear()
        self.metrics.running.set(0)
        self.metrics.waiting.set(0)

    def _close_batch(self) -> None:
        batch, self.batch = self.batch, None
        if batch is not None:
            batch.close()

    def _shutdown(self) -> None:
        self._fail_all(ServerClosing("the server shut down before this request finished"), 503)
        try:
            self._close_batch()
        finally:
            if self._saves is not None:
                self._saves.shutdown(wait=True)

    # ---- multi-turn reuse --------------------------------------------------------------------

    def _save_prompt(self, ids: list[int], kv: list) -> None:
        """Keep a prompt's KV in the context store (in the background): a chat's next turn starts with this
        prompt, so its prefill loads it and computes only what is new."""
        if not self._save_slots.acquire(blocking=False):
            log.info("context store writer busy: this prompt's KV is not saved")
            return
        self._saves.submit(self._put, ids, kv)

    def _put(self, ids: list[int], kv: list) -> None:
        try:
            self.engine.context_store.put(ids, kv)
        except Exception as exc:  # a full disk or a damaged store costs the next turn its reuse, never this reply
            log.warning("context store: prompt not saved: %s", exc)
        finally:
            self._save_slots.release()
