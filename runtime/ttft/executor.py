"""Run a chunk plan: loads on an I/O thread, computes on the calling thread, dependencies enforced.

Each chunk is claimed by exactly one path.  In ``plan`` mode the planner's assignment holds
unless the run drifts from it (runtime adaptation, SparKV IV-D):
  * the compute thread, blocked on a load, takes a load-assigned chunk it can compute now
    when the wait it expects (bytes still ahead of the awaited load / the measured link rate)
    is longer than that chunk's compute (predicted x measured compute speed);
  * the I/O thread, out of loads, takes the top computed layer of the last token chunk
    still pending when loading it ends before the compute thread would reach it;
at most ``max_migrations`` moves per path per plan stage (default: 5 % of the chunks, at least 4).  A load that fails (the store
raised) is recomputed: its token chunk's layers up to it move to the compute path, and the
answer is unchanged.  In ``claim`` mode (Cake's bidirectional baseline) both paths walk
their own order over all chunks and the first to claim a chunk takes it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .compute import ChunkCompute
from .grid import COMPUTE, LOAD, ChunkGrid, compute_ready

PENDING, CLAIMED, DONE = 0, 1, 2
RATE_WINDOW = 4  # loads the measured link rate averages over: recent enough to see a drop within a stage


class ChunkLoader(Protocol):
    def load(self, t: int, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [H_kv, n, d] of chunk (t, l); raises OSError when the chunk cannot be read."""

    def nbytes(self, t: int, l: int) -> int:
        """Bytes the load of (t, l) moves."""


@dataclass
class RunStats:
    wall_s: float = 0.0
    compute_busy_s: float = 0.0
    load_busy_s: float = 0.0
    compute_wait_s: float = 0.0
    loaded: int = 0
    computed: int = 0
    bytes_loaded: int = 0
    to_compute: int = 0  # load-assigned chunks the compute thread took (adaptation)
    to_load: int = 0  # compute-assigned chunks the I/O thread took (adaptation)
    failed_loads: int = 0
    recomputed: int = 0  # loaded chunks computed again on the way to a stolen one
    events: list = field(default_factory=list)  # ("load" | "compute", t, l, finished_s) in finishing order

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "events"}


class Executor:
    def __init__(self, grid: ChunkGrid, compute: ChunkCompute, loader: ChunkLoader, compute_order, load_order,
                 assign: np.ndarray | None = None, compute_s: np.ndarray | None = None, link_mib_s: float | None = None,
                 stages: np.ndarray | None = None, adapt: bool = True, max_migrations: int | None = None):
        """``assign`` None means claim mode (both orders cover every chunk); else plan mode with that assignment."""
        self.grid = grid
        self.compute = compute
        self.loader = loader
        self.claim_mode = assign is None
        self.assign = np.full(grid.shape, -1, np.int8) if assign is None else assign.copy()
        self.compute_order = list(compute_order)
        self.load_order = list(load_order)
        self.compute_s = compute_s if compute_s is not None else np.zeros(grid.shape)
        self.link_bytes_s = (link_mib_s or 0.0) * 2**20
        self.stages = stages
        self.adapt = adapt and not self.claim_mode
        self.max_migrations = max_migrations or max(4, grid.n_chunks * grid.n_layers // 20)  # per path and stage
        self.state = np.full(grid.shape, PENDING, np.int8)
        self.computed = np.zeros(grid.shape, bool)
        self.present = np.zeros(grid.shape, bool)
        self.stats = RunStats()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._moves: dict[tuple[str, int], int] = {}
        self._compute_speed = 1.0  # measured / predicted compute time
        self._loading: tuple[int, int, float] | None = None  # (t, l, started) of the load in flight
        self._recent: list[tuple[int, float]] = []  # (bytes, seconds) per finished load: the measured link rate
        self._through: dict[int, list[int]] = {}  # token chunk -> loaded layers to compute again before a stolen one

    # ---- shared state (callers hold self._cv) ----------------------------------------------

    def _ready(self, t: int, l: int) -> bool:
        return compute_ready(t, l, self.computed, self.present)

    def _finish(self, kind: str, t: int, l: int) -> None:
        self.state[t, l] = DONE
        self.present[t, l] = True
        if kind == "compute":
            self.computed[t, l] = True
            self.stats.computed += 1
        else:
            self.stats.loaded += 1
        self.stats.events.append((kind, t, l, time.perf_counter() - self._t0))
        if (self.state[t] == DONE).all():  # no later failure can need this token chunk's hidden states
            self.compute.drop(self.grid.span(t))
        self._cv.notify_all()

    def _budget(self, path: str, t: int, l: int) -> bool:
        """One more migration allowed in this chunk's stage for this path?"""
        key = (path, int(self.stages[t, l]) if self.stages is not None else 0)
        if self._moves.get(key, 0) >= self.max_migrations:
            return False
        self._moves[key] = self._moves.get(key, 0) + 1
        return True

    # ---- the I/O thread ------------------------------------------------------------------------

    def _next_load(self) -> tuple[int, int] | None:
        for t, l in self.load_order:
            if self.state[t, l] == PENDING and (self.claim_mode or self.assign[t, l] == LOAD):
                return t, l
        return self._steal_for_load() if self.adapt else None

    def _steal_for_load(self) -> tuple[int, int] | None:
        """The top pending computed layer of the last token chunk, when loading it beats computing to it."""
        pending = [(t, l) for t, l in self.compute_order if self.state[t, l] == PENDING and self.assign[t, l] == COMPUTE]
        if not pending or self.link_bytes_s <= 0:
            return None
        t, l = pending[-1]
        if l + 1 < self.grid.n_layers and self.assign[t, l + 1] == COMPUTE:
            return None  # not the top computed layer of its token chunk
        ahead_s = sum(self.compute_s[c] for c in pending[:-1]) * self._compute_speed
        if self.loader.nbytes(t, l) / self.link_bytes_s >= ahead_s or not self._budget("load", t, l):
            return None
        self.assign[t, l] = LOAD
        self.stats.to_load += 1
        return t, l

    def _io_loop(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._error is not None:
                        return
                    nxt = self._next_load()
                    if nxt is None:
                        if (self.state != DONE).any() and self.adapt:
                            self._cv.wait(0.005)  # the compute thread may still leave work to steal
                            if (self.state == DONE).all():
                                return
                            continue
                        return
                    t, l = nxt
                    self.state[t, l] = CLAIMED
                    started = time.perf_counter()
                    self._loading = (t, l, started)
                try:
                    k, v = self.loader.load(t, l)
                    start, _ = self.grid.span(t)
                    self.compute.kv.put(l, start, k, v)
                except OSError:
                    with self._cv:
                        self._loading = None
                        self.stats.failed_loads += 1
                        self._recompute(t, l)
                    continue
                with self._cv:
                    self._loading = None
                    spent = time.perf_counter() - started
                    self.stats.load_busy_s += spent
                    nbytes = self.loader.nbytes(t, l)
                    self.stats.bytes_loaded += nbytes
                    self._recent.append((nbytes, spent))
                    recent = self._recent[-RATE_WINDOW:]
                    self.link_bytes_s = sum(b for b, _ in recent) / max(sum(s for _, s in recent), 1e-9)
                    self._finish("load", t, l)
        except BaseException as exc:  # surfaces on the compute thread as itself
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _recompute(self, t: int, l: int) -> None:
        """A failed load: token chunk t computes every layer up to l, the loaded ones again (they hold no
        hidden states).  Its computed layers are a prefix (one may be in flight), so the rest starts above them."""
        self.state[t, l] = PENDING
        first = next(k for k in range(l + 1) if not self.computed[t, k] and not
                     (self.state[t, k] == CLAIMED and self.assign[t, k] == COMPUTE))
        redo = [(t, k) for k in range(first, l + 1)]
        for c in redo:
            self.assign[c] = COMPUTE
            self.state[c] = PENDING  # present stays as it was: loaded KV is still valid for other chunks
        self.compute_order = redo + [c for c in self.compute_order if c not in redo]
        self._cv.notify_all()

    # ---- the compute thread -------------------------------------------------------------------

    def _next_compute(self) -> tuple[int, int] | None | str:
        """The first ready chunk in compute order, None when none is left, "wait" when the pending ones wait on loads."""
        first_blocked = None
        for t, l in self.compute_order:
            if self.state[t, l] != PENDING:
                continue
            if not self.claim_mode and self.assign[t, l] != COMPUTE:
                continue
            if self.claim_mode and l > 0 and not self.computed[t, l - 1]:
                continue  # its lower layers were loaded: the I/O thread takes the rest of this token chunk
            if self._ready(t, l):
                return t, l
            first_blocked = first_blocked or (t, l)
        if not self.adapt:
            return "wait" if first_blocked else None
        return self._steal_for_compute(first_blocked) or ("wait" if first_blocked else None)

    def _steal_for_compute(self, blocked: tuple[int, int] | None) -> tuple[int, int] | None:
        """The lowest token chunk whose next load-assigned layer the compute thread can reach now, when the wait
        for the blocked chunk's inputs (or, with no computing left, for the last load) is longer than reaching it.

        Reaching it may pass through layers already loaded (their KV holds no hidden states): those are
        computed again on the way, as Cake's compute thread would have, and their cost is counted."""
        wait_s = self._expected_wait_s(*blocked) if blocked else self._expected_wait_s(None, None)
        for t in range(self.grid.n_chunks):
            depth = int(np.argmin(self.computed[t])) if not self.computed[t].all() else self.grid.n_layers
            if depth < self.grid.n_layers and self.state[t, depth] == CLAIMED and self.assign[t, depth] == COMPUTE:
                continue  # its chain is being computed right now
            target = next((l for l in range(depth, self.grid.n_layers)
                           if self.state[t, l] == PENDING and self.assign[t, l] == LOAD), None)
            if target is None or any(self.state[t, l] != DONE for l in range(depth, target)):
                continue
            if any(l > 0 and not self.present[:t, l - 1].all() for l in range(depth, target + 1)):
                continue
            cost_s = float(self.compute_s[t, depth:target + 1].sum()) * self._compute_speed
            if cost_s < wait_s and self._budget("compute", t, target):
                self.assign[t, target] = COMPUTE
                self._through[t] = list(range(depth, target))
                self.stats.to_compute += 1
                return t, target
        return None

    def _expected_wait_s(self, t: int | None, l: int | None) -> float:
        """Bytes the I/O thread moves before every input of (t, l) is present (every pending load when t is None),
        at the measured link rate."""
        if self.link_bytes_s <= 0:
            return 0.0
        if t is None:
            needed = {c for c in self.load_order if self.state[c] == PENDING and self.assign[c] == LOAD}
        else:
            needed = {(tt, l - 1) for tt in range(t) if not self.present[tt, l - 1]}
        ahead = 0
        for c in self.load_order:
            if not needed:
                break
            if self.state[c] == PENDING and self.assign[c] == LOAD:
                ahead += self.loader.nbytes(*c)
            needed.discard(c)
        if self._loading is not None:
            lt, ll, started = self._loading
            ahead += max(0.0, self.loader.nbytes(lt, ll) - (time.perf_counter() - started) * self.link_bytes_s)
        return ahead / self.link_bytes_s

    def run(self) -> RunStats:
        self._t0 = time.perf_counter()
        io = threading.Thread(target=self._io_loop, name="ekv-ttft-io", daemon=True)
        io.start()
        try:
            while True:
                with self._cv:
                    while True:
                        if self._error is not None:
                            raise self._error
                        nxt = self._next_compute()
                        if nxt is None and (self.state == DONE).all():
                            break
                        if isinstance(nxt, tuple):
                            break
                        waited = time.perf_counter()
                        self._cv.wait(0.05)
                        self.stats.compute_wait_s += time.perf_counter() - waited
                    if nxt is None:
                        break
                    t, l = nxt
                    self.state[t, l] = CLAIMED
                    through = self._through.pop(t, [])
                spent = device_seconds(self.compute.model.device, lambda: [
                    self.compute.advance(self.grid.span(t), k) for k in [*through, l]])
                with self._cv:
                    self.computed[t, through] = True
                    self.stats.recomputed += len(through)
                    self.stats.compute_busy_s += spent
                    predicted = self.compute_s[t, [*through, l]].sum()
                    if predicted > 0:
                        self._compute_speed = 0.7 * self._compute_speed + 0.3 * spent / predicted
                    self._finish("compute", t, l)
        finally:
            with self._cv:
                if self._error is None and (self.state != DONE).any():
                    self._error = RuntimeError("the TTFT run stopped early")
                self._cv.notify_all()
            io.join()
        self.stats.wall_s = time.perf_counter() - self._t0
        return self.stats


def device_seconds(device, work) -> float:
    """Seconds ``work()`` takes on ``device``: on a GPU between two CUDA events (the launches return at once; the
    plan's compute rates must be the kernels'), on the CPU by the clock."""
    if device.type != "cuda":
        started = time.perf_counter()
        work()
        return time.perf_counter() - started
    import torch

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    work()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3
