"""Which chunks of a stored prefix to load and which to compute, and in what order (SparKV IV-B).

A ``Plan`` gives every chunk (t, l) of a ``ChunkGrid`` to the I/O thread (LOAD) or to the
compute thread (COMPUTE), and gives each thread its order.  ``simulate`` runs the two
threads on predicted costs (what TTFT will be); ``stage_cost`` is the paper's MILP objective
over stages (an upper bound of ``simulate`` for plans whose orders follow their stages,
because within a stage each thread only waits on earlier stages or on its own earlier work).

``greedy_plan`` is the paper's potential-aware greedy: stages of budget Δt, computes first
(a compute may unlock more compute in the same stage), then loads, whose chunks count as
present from the next stage on.  A chunk's priority is 1/cost plus the compute score of
every chunk it makes compute-ready, so a cheap chunk that opens the frontier beats a cheap
dead end.  One change from the paper: a compute score is 1/t_comp times t_load/mean(t_load),
the load it saves.  With uniform loads (the paper's fixed-size chunks) that is the paper's
score; with uneven ones (a partial last chunk, compression) it keeps the greedy from
computing a chunk that was cheap to load (on the small cases of install/ttft_milp it took
the worst gap to the MILP from 61 % to 18 %).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .grid import COMPUTE, LOAD, ChunkGrid, check_order

_TINY_S = 1e-12  # floor of a cost before 1/cost: a free chunk gets a huge, finite priority


@dataclass
class Plan:
    grid: ChunkGrid
    assign: np.ndarray  # int8 [T, L]: LOAD or COMPUTE
    compute_order: list[tuple[int, int]]  # every COMPUTE chunk once, in the compute thread's order
    load_order: list[tuple[int, int]]  # every LOAD chunk once, in issue order
    stages: np.ndarray | None = None  # int [T, L] stage per chunk, where the planner has stages
    name: str = ""

    def summary(self, chunk_bytes: np.ndarray | None = None) -> dict:
        """Counts (and the loaded share of ``chunk_bytes`` [T, L] when given) for logs and reports."""
        out = {"name": self.name, "computed": len(self.compute_order), "loaded": len(self.load_order),
               "n_stages": None if self.stages is None else int(self.stages.max()) + 1}
        if chunk_bytes is not None:
            b = np.asarray(chunk_bytes, dtype=np.float64)
            out["loaded_bytes_frac"] = float(b[self.assign == LOAD].sum() / max(b.sum(), 1e-30))
        return out


def _costs(grid: ChunkGrid, *arrays) -> list[np.ndarray]:
    out = []
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        if a.shape != grid.shape or not np.isfinite(a).all() or (a < 0).any():
            raise ValueError(f"costs must be finite, >= 0 and of shape {grid.shape}, got {a.shape}")
        out.append(a)
    return out


def _validate(plan: Plan) -> None:
    """Each chunk exactly once, in the order of its own thread; computed chunks are layer prefixes."""
    T, L = plan.grid.shape
    a = np.asarray(plan.assign)
    if a.shape != (T, L) or not np.isin(a, (LOAD, COMPUTE)).all():
        raise ValueError(f"assign must be LOAD/COMPUTE of shape {(T, L)}")
    if (np.diff(a.astype(np.int64), axis=1) > 0).any():
        raise ValueError("a computed chunk sits above a loaded one: computes must be layer prefixes")
    for kind, order in ((COMPUTE, plan.compute_order), (LOAD, plan.load_order)):
        want = {(int(t), int(l)) for t, l in np.argwhere(a == kind)}
        got = [(int(t), int(l)) for t, l in order]
        if len(got) != len(want) or set(got) != want:
            raise ValueError(f"{'compute' if kind == COMPUTE else 'load'}_order must list each such chunk once")
    if plan.stages is not None:
        s = np.asarray(plan.stages)
        if s.shape != (T, L) or (s < 0).any():
            raise ValueError("stages must be ints >= 0 of the grid's shape")


def _run(plan: Plan, load_s: np.ndarray, compute_s: np.ndarray) -> tuple[float, list[tuple[str, int, int]]]:
    """Finish time of the last chunk and ("load"|"compute", t, l) events in finishing order."""
    _validate(plan)
    T, L = plan.grid.shape
    done = np.full((T, L), np.nan)  # finish time; NaN = not produced yet
    clock = 0.0
    for t, l in plan.load_order:  # the I/O thread never waits
        clock += load_s[t, l]
        done[t, l] = clock
    free = 0.0
    for t, l in plan.compute_order:
        ready = 0.0
        if l:  # (t, l-1) computed and (t' < t, l-1) present: all of column l-1 up to t
            deps = done[: t + 1, l - 1]
            if np.isnan(deps).any():
                raise ValueError(f"compute ({t}, {l}) needs a chunk the compute thread makes later: deadlock")
            ready = float(deps.max())
        free = max(free, ready) + compute_s[t, l]
        done[t, l] = free
    # ties: loads first (they need nothing), then computes in thread order (their deps come first)
    seq = {c: i for i, c in enumerate(plan.compute_order)}
    ev = sorted([(float(done[t, l]), 0, 0, t, l) for t, l in plan.load_order]
                + [(float(done[t, l]), 1, seq[(t, l)], t, l) for t, l in plan.compute_order])
    return float(done.max()), [("load" if k == 0 else "compute", t, l) for _, k, _, t, l in ev]


def simulate(plan: Plan, load_s, compute_s) -> float:
    """Two-thread makespan in seconds: loads back to back in ``load_order``; each compute starts
    when the compute thread is free and its inputs are finished.  ValueError if the plan is
    invalid or the compute order waits on a later compute (deadlock)."""
    load_s, compute_s = _costs(plan.grid, load_s, compute_s)
    return _run(plan, load_s, compute_s)[0]


def stage_cost(plan: Plan, load_s, compute_s) -> float:
    """Σ_k max(load seconds of stage k, compute seconds of stage k): the stage MILP's objective."""
    if plan.stages is None:
        raise ValueError(f"plan {plan.name!r} has no stages")
    load_s, compute_s = _costs(plan.grid, load_s, compute_s)
    s = np.asarray(plan.stages).ravel()
    isl = (np.asarray(plan.assign) == LOAD).ravel()
    n = int(s.max()) + 1
    per_load = np.bincount(s, weights=np.where(isl, load_s.ravel(), 0.0), minlength=n)
    per_comp = np.bincount(s, weights=np.where(isl, 0.0, compute_s.ravel()), minlength=n)
    return float(np.maximum(per_load, per_comp).sum())


def check_plan(plan: Plan) -> None:
    """Raise (ValueError / AssertionError) unless the plan is complete and executable, and, where
    it has stages, unless computes of stage k use only computes of stages <= k and loads of
    stages <= k-1 and both orders follow the stages (what makes stage_cost bound simulate)."""
    ones = np.ones(plan.grid.shape)
    _, events = _run(plan, ones, ones)
    check_order(plan.grid, events)
    if plan.stages is None:
        return
    s, a = np.asarray(plan.stages), np.asarray(plan.assign)
    for order in (plan.compute_order, plan.load_order):
        ks = [s[c] for c in order]
        if any(x > y for x, y in zip(ks, ks[1:])):
            raise ValueError("an order goes back to an earlier stage")
    for t, l in plan.compute_order:
        if l == 0:
            continue
        if s[t, l - 1] > s[t, l]:
            raise ValueError(f"compute ({t}, {l}) is staged before ({t}, {l - 1})")
        for u in range(t):
            limit = s[t, l] if a[u, l - 1] == COMPUTE else s[t, l] - 1
            if s[u, l - 1] > limit:
                raise ValueError(f"compute ({t}, {l}) at stage {s[t, l]} uses ({u}, {l - 1}) too late")


def plan_from_depths(grid: ChunkGrid, depths: Sequence[int], name: str = "") -> Plan:
    """Token chunk t computes layers [0, depths[t]) and loads the rest (0 everywhere: all-load,
    L everywhere: all-compute, falling depths: a staircase whose computes never wait on I/O).

    Two stages at most: loads and the computes that need no load (transitively) in stage 0,
    the other computes in stage 1.  The compute thread runs stage 0 first so it works while
    loads stream; loads go in the order their first compute needs them, unneeded ones last."""
    T, L = grid.shape
    d = np.asarray(depths, dtype=np.int64)
    if d.shape != (T,) or (d < 0).any() or (d > L).any():
        raise ValueError(f"depths must be {T} ints in [0, {L}]")
    assign = (np.arange(L)[None, :] < d[:, None]).astype(np.int8)
    stages = np.zeros((T, L), dtype=np.int64)
    for l in range(1, L):
        for t in range(T):
            if assign[t, l]:
                col = assign[: t + 1, l - 1] == LOAD
                stages[t, l] = 1 if col.any() else stages[: t + 1, l - 1].max()
    comps = [(t, l) for t in range(T) for l in range(L) if assign[t, l]]
    compute_order = sorted(comps, key=lambda c: (stages[c], c[1], c[0]))
    first_need: dict[tuple[int, int], int] = {}
    for i, (t, l) in enumerate(compute_order):
        for u in range(t if l else 0):
            if assign[u, l - 1] == LOAD:
                first_need.setdefault((u, l - 1), i)
    loads = [(t, l) for t in range(T) for l in range(L) if not assign[t, l]]
    load_order = sorted(loads, key=lambda c: (first_need.get(c, len(compute_order)), c[1], c[0]))
    return Plan(grid, assign, compute_order, load_order, stages, name or f"depths{d.tolist()}")


def random_plan(grid: ChunkGrid, rng: np.random.Generator) -> Plan:
    """Random depths, a random topological compute order and a random load order (for tests)."""
    T, L = grid.shape
    plan = plan_from_depths(grid, rng.integers(0, L + 1, size=T), name="random")
    left, order = set(plan.compute_order), []
    while left:  # a compute may go once every compute it reads is placed
        ready = sorted(c for c in left if c[1] == 0 or all(
            (u, c[1] - 1) not in left for u in range(c[0] + 1)))
        pick = ready[rng.integers(len(ready))]
        order.append(pick)
        left.remove(pick)
    loads = list(plan.load_order)
    loads = [loads[i] for i in rng.permutation(len(loads))]
    return Plan(grid, plan.assign, order, loads, None, "random")


class _Greedy:
    """State of one greedy run: which chunks are taken, computed, and present for compute now
    (``avail``: computed, or loaded in an earlier stage) or from the next stage (``nxt``).
    ``front_*[l]``: the first token chunk missing from column l; (t', l+1) is compute-ready
    iff (t', l) is computed and t' <= front_avail[l], so only the front chunk of a column can
    make chunks of the layer above ready, and only its score carries a bonus."""

    def __init__(self, grid: ChunkGrid, load_s: np.ndarray, compute_s: np.ndarray):
        self.grid, self.load_s, self.compute_s = grid, load_s, compute_s
        self.T, self.L = T, L = grid.shape
        self.inv_l = 1.0 / np.maximum(load_s, _TINY_S)
        # 1/t_comp, scaled by the load a compute saves relative to the mean load (1 where loads are
        # uniform, as in the paper): computing an expensive-to-load chunk is worth more
        self.inv_c = load_s / max(float(load_s.mean()), _TINY_S) / np.maximum(compute_s, _TINY_S)
        self.taken = np.zeros((T, L), dtype=bool)
        self.computed = np.zeros((T, L), dtype=bool)
        self.avail = np.zeros((T, L), dtype=bool)
        self.nxt = np.zeros((T, L), dtype=bool)
        self.front_avail, self.front_nxt = [0] * L, [0] * L
        self.bonus_c = np.zeros((T, L))  # Σ inv_c over the chunks a compute of (t, l) makes ready
        self.bonus_l = np.zeros((T, L))  # the same for a load of (t, l) (ready from the next stage)
        self.ready = np.zeros((T, L), dtype=bool)
        self.ready[:, 0] = True
        self.stages = np.zeros((T, L), dtype=np.int64)
        self.compute_order: list[tuple[int, int]] = []
        self.load_order: list[tuple[int, int]] = []
        for l in range(L):
            self._rescore(l)

    def _advance(self, present: np.ndarray, front: list[int], l: int) -> None:
        T = self.T
        while front[l] < T and present[front[l], l]:
            front[l] += 1

    def _gain(self, present: np.ndarray, t: int, l: int, compute: bool) -> float:
        """Σ compute score over chunks of layer l+1 that become ready if front chunk (t, l) is added."""
        T = self.T
        gain, u = 0.0, t
        while u < T and (u == t or present[u, l]):
            if not self.taken[u, l + 1] and (self.computed[u, l] or (compute and u == t)):
                gain += self.inv_c[u, l + 1]
            u += 1
        return gain

    def _rescore(self, l: int) -> None:
        T = self.T
        if not 0 <= l < self.L - 1:
            return
        self.bonus_c[:, l] = 0.0
        self.bonus_l[:, l] = 0.0
        t = self.front_avail[l]
        if t < T:
            self.bonus_c[t, l] = self._gain(self.avail, t, l, compute=True)
        t = self.front_nxt[l]
        if t < T:
            self.bonus_l[t, l] = self._gain(self.nxt, t, l, compute=False)

    def _reready(self, l: int) -> None:
        if 1 <= l < self.L:
            self.ready[:, l] = self.computed[:, l - 1] & (np.arange(self.T) <= self.front_avail[l - 1])

    def _pick(self, score: np.ndarray, mask: np.ndarray) -> tuple[int, int]:
        """Highest score; ties to the lowest layer, then the lowest token chunk."""
        i = int(np.argmax(np.where(mask, score, -np.inf).T))
        return i % self.T, i // self.T

    def stage(self, k: int, budget_s: float, strict: bool) -> None:
        """One stage: computes under the budget (re-scored after each pick), then loads.
        ``strict``: a chunk must fit what is left of the budget (the first load of a stage
        that has nothing else always goes, so every stage makes progress); otherwise picks go
        on while the budget is not used up and the last one may overrun it."""
        took_any, load_layers = False, set()
        for compute in (True, False):
            used = 0.0
            cost = self.compute_s if compute else self.load_s
            base, bonus = (self.inv_c, self.bonus_c) if compute else (self.inv_l, self.bonus_l)
            while True:
                mask = ~self.taken & (self.ready if compute else True)
                if strict:
                    fits = cost <= budget_s - used + 1e-12 * budget_s
                    mask = mask & (fits | (not compute and not took_any))
                elif used >= budget_s:
                    break
                if not mask.any():
                    break
                t, l = self._pick(base + bonus, mask)
                used += cost[t, l]
                took_any = True
                self.taken[t, l] = self.nxt[t, l] = True
                self._advance(self.nxt, self.front_nxt, l)
                self.stages[t, l] = k
                if compute:
                    self.computed[t, l] = self.avail[t, l] = True
                    self._advance(self.avail, self.front_avail, l)
                    self.compute_order.append((t, l))
                    self._reready(l + 1)
                else:
                    self.load_order.append((t, l))
                    load_layers.add(l)
                self._rescore(l)
                self._rescore(l - 1)
        self.avail = self.nxt.copy()  # this stage's loads unlock computes from the next stage
        for l in load_layers:  # nothing else changed at the stage boundary
            self._advance(self.avail, self.front_avail, l)
            self._rescore(l)
            self._reready(l + 1)


def _greedy_once(grid: ChunkGrid, load_s: np.ndarray, compute_s: np.ndarray, stage_s: float,
                 strict: bool) -> Plan:
    g = _Greedy(grid, load_s, compute_s)
    k = 0
    while not g.taken.all():
        g.stage(k, stage_s, strict)
        k += 1
    assign = g.computed.astype(np.int8)  # COMPUTE == 1
    return Plan(grid, assign, g.compute_order, g.load_order, merge_stages(assign, g.stages),
                f"greedy(dt={stage_s:.4g}s{', strict' if strict else ''})")


def merge_stages(assign: np.ndarray, stages: np.ndarray) -> np.ndarray:
    """Join each stage to the one before unless one of its computes reads a load made there.

    Merging never costs: max(L_k + L_k+1, C_k + C_k+1) <= D_k + D_k+1, and every compute
    still finds its inputs; the stage order and so both threads' orders stay the same."""
    out = np.zeros_like(stages)
    group = 0
    for k in range(1, int(stages.max()) + 1 if stages.size else 0):
        blocked = any(
            assign[u, l - 1] == LOAD and stages[u, l - 1] < k and out[u, l - 1] == group
            for t, l in zip(*np.nonzero((stages == k) & (assign == COMPUTE))) if l
            for u in range(t))
        group += blocked
        out[stages == k] = group
    return out


# Δt search: neighbouring coarse budgets differ by a factor `step`, then `levels` rounds probe
# step^(±1/2), step^(±1/4), ... around the best.  Grids up to _FINE_MAX_CHUNKS chunks plan in
# milliseconds, so they get the finer search (on the small MILP cases it found better
# budgets); larger ones the coarser, about half the runs (on 6-24 x 12-30 grids it was within
# 1.2 % of the finer one's makespan).
_COARSE, _FINE, _FINE_MAX_CHUNKS = (1.5, 3), (1.25, 5), 64


def stage_budgets_s(grid: ChunkGrid, load_s, compute_s, step: float = _COARSE[0]) -> list[float]:
    """Coarse Δt candidates: the larger thread total over n = 1, step, step², ... <= T·L
    stages, plus the two ends: everything in one stage (all-compute) and less than the
    cheapest chunk (under the strict rule: one load per stage, i.e. all-load but free chunks)."""
    load_s, compute_s = _costs(grid, load_s, compute_s)
    top = float(load_s.sum() + compute_s.sum())
    if top <= 0:
        return [1.0]  # every chunk is free: any budget gives a zero makespan
    total = max(float(load_s.sum()), float(compute_s.sum()))
    both = np.concatenate([load_s.ravel(), compute_s.ravel()])
    floor = 0.5 * float(both[both > 0].min())
    out, n = [top], 1.0
    while total / n >= floor and n <= grid.n_chunks * grid.n_layers:
        out.append(total / n)
        n *= step
    return out + [floor]


def fluid_stage_s(load_s, compute_s) -> float:
    """Δt near the best for real-shaped costs: S·C / (S + C), the makespan if every chunk's work could be split
    between the two threads in proportion (S, C: all-load and all-compute totals).  The best Δt found by the
    full search sits within 0.7-1x of it on SmolLM2-shaped grids (16 x 30 chunks, 25-800 MiB/s)."""
    total_load, total_compute = float(np.sum(load_s)), float(np.sum(compute_s))
    return total_load * total_compute / max(total_load + total_compute, 1e-12)


def quick_plan(grid: ChunkGrid, load_s, compute_s) -> Plan:
    """The greedy at Δt = 0.7 and 1x the fluid estimate, both budget rules (4 runs): what a request can
    afford to plan (about 15 ms per run for 16 x 30 chunks in CPython, against ~1 s for the full search)."""
    load_s, compute_s = _costs(grid, load_s, compute_s)
    fluid = fluid_stage_s(load_s, compute_s)
    if not fluid > 0:
        return greedy_plan(grid, load_s, compute_s)
    plans = [_greedy_once(grid, load_s, compute_s, f * fluid, strict) for f in (0.7, 1.0) for strict in (False, True)]
    return min(plans, key=lambda p: (_run(p, load_s, compute_s)[0], stage_cost(p, load_s, compute_s)))


def greedy_plan(grid: ChunkGrid, load_s, compute_s, stage_s: float | None = None,
                objective: str = "makespan") -> Plan:
    """The potential-aware greedy, run under both budget rules (overrun / strict).

    With ``stage_s`` given, only that budget (2 runs); otherwise every ``stage_budgets_s``
    candidate and rounds of refinement around the best (about 2·log_step(T·L) + 20 runs: under
    a second in CPython for a 20 x 28 grid).  Best means the lower ``simulate`` makespan (what TTFT
    sees), then the lower stage cost; ``objective="stage"`` swaps the two (to compare with the
    stage MILP on its own terms)."""
    if objective not in ("makespan", "stage"):
        raise ValueError(f"objective must be 'makespan' or 'stage', got {objective!r}")
    load_s, compute_s = _costs(grid, load_s, compute_s)
    step, levels = _FINE if grid.n_chunks * grid.n_layers <= _FINE_MAX_CHUNKS else _COARSE
    best: dict[bool, tuple] = {}

    def run(dt: float, strict: bool) -> None:
        if not dt > 0:
            raise ValueError(f"stage budget must be > 0 s, got {dt}")
        plan = _greedy_once(grid, load_s, compute_s, dt, strict)
        key = (round(_run(plan, load_s, compute_s)[0], 12), round(stage_cost(plan, load_s, compute_s), 12))
        key = key if objective == "makespan" else key[::-1]
        if strict not in best or key < best[strict][0]:
            best[strict] = (key, dt, plan)

    for strict in (False, True):
        for dt in ([stage_s] if stage_s is not None else stage_budgets_s(grid, load_s, compute_s, step)):
            run(dt, strict)
        if stage_s is None:  # the key is not monotone in Δt: probe both sides, move to the better
            for i in range(1, levels + 1):
                dt0 = best[strict][1]
                for f in (step ** 0.5 ** i, step ** -0.5 ** i):
                    run(dt0 * f, strict)
    return min(best.values(), key=lambda b: b[0])[2]
