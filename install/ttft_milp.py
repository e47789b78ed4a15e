"""The exact stage schedule (SparKV's MILP, solved by HiGHS) to check the runtime's greedy against.

Offline only: the solve grows fast with the grid, so the runtime plans with
``greedy_plan`` and this module measures how far that is from the optimum on small grids.

Model (same stage semantics as the greedy): binaries x_load[c, k], x_comp[c, k]; D_k >= both
threads' seconds in stage k; minimise Σ_k D_k.  Computing (t, l) at stage k needs (t, l-1)
computed at a stage <= k and every (t' < t, l-1) computed at <= k or loaded at <= k-1.

Stage count: 1 + (T-1)(L-1) stages lose nothing.  Take an optimal schedule and merge stage
k+1 into stage k whenever no compute of k+1 reads a load of k: the merged stage costs at
most D_k + D_{k+1} and every dependency still holds.  After that every stage k >= 1 holds a
compute (t >= 1, 1 <= l <= L-1) reading a load of stage k-1; these computes are distinct,
and there are (T-1)(L-1) such chunks.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from edgekv.runtime.ttft.grid import COMPUTE, LOAD, ChunkGrid
from edgekv.runtime.ttft.plan import Plan, check_plan, greedy_plan, plan_from_depths, simulate, stage_cost


def enough_stages(grid: ChunkGrid) -> int:
    T, L = grid.shape
    return 1 + (T - 1) * (L - 1)


def _solve(grid: ChunkGrid, load_s, compute_s, n_stages: int, time_limit_s: float):
    T, L = grid.shape
    N, K = T * L, n_stages
    load_s = np.asarray(load_s, dtype=np.float64).ravel()
    compute_s = np.asarray(compute_s, dtype=np.float64).ravel()

    def xl(i, k):
        return i * K + k

    def xc(i, k):
        return N * K + i * K + k

    def d(k):
        return 2 * N * K + k

    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(terms, lb, ub):
        r = len(lo)
        for c, v in terms:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    for i in range(N):  # every chunk exactly once
        add([(xl(i, k), 1.0) for k in range(K)] + [(xc(i, k), 1.0) for k in range(K)], 1.0, 1.0)
    for k in range(K):  # D_k covers both threads of stage k
        add([(d(k), 1.0)] + [(xl(i, k), -load_s[i]) for i in range(N)], 0.0, np.inf)
        add([(d(k), 1.0)] + [(xc(i, k), -compute_s[i]) for i in range(N)], 0.0, np.inf)
    for k in range(K - 1):  # no empty stage before a used one (cuts symmetric copies)
        add([(xl(i, k), float(N)) for i in range(N)] + [(xc(i, k), float(N)) for i in range(N)]
            + [(xl(i, k + 1), -1.0) for i in range(N)] + [(xc(i, k + 1), -1.0) for i in range(N)], 0.0, np.inf)
    for t in range(T):
        for l in range(1, L):
            i, below = t * L + l, t * L + l - 1
            for k in range(K):
                add([(xc(i, k), 1.0)] + [(xc(below, q), -1.0) for q in range(k + 1)], -np.inf, 0.0)
                for u in range(t):
                    j = u * L + l - 1
                    add([(xc(i, k), 1.0)] + [(xc(j, q), -1.0) for q in range(k + 1)]
                        + [(xl(j, q), -1.0) for q in range(k)], -np.inf, 0.0)
    n_var = 2 * N * K + K
    A = sparse.csr_array((vals, (rows, cols)), shape=(len(lo), n_var))
    cost = np.zeros(n_var)
    cost[2 * N * K:] = 1.0
    integrality = np.ones(n_var)
    integrality[2 * N * K:] = 0
    ub = np.ones(n_var)
    ub[2 * N * K:] = np.inf
    res = milp(cost, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(n_var), ub), options={"time_limit": time_limit_s})
    if res.x is None:
        raise RuntimeError(f"MILP found no schedule: {res.message}")
    x = res.x[: 2 * N * K].reshape(2, N, K) > 0.5
    return res, x


def milp_plan(grid: ChunkGrid, load_s, compute_s, n_stages: int | None = None,
              time_limit_s: float = 60) -> tuple[Plan, float]:
    """The stage schedule of least Σ_k D_k and that sum in seconds.  Orders follow the stages,
    (layer, token chunk) within a stage (a topological order: a compute reads layer l-1 only).
    The plan's name ends in "not proven optimal" when HiGHS stopped at the time limit."""
    K = n_stages or enough_stages(grid)
    res, x = _solve(grid, load_s, compute_s, K, time_limit_s)
    T, L = grid.shape
    stages = np.zeros((T, L), dtype=np.int64)
    assign = np.zeros((T, L), dtype=np.int8)
    for i in range(T * L):
        t, l = divmod(i, L)
        kind, k = (COMPUTE, int(np.argmax(x[1, i]))) if x[1, i].any() else (LOAD, int(np.argmax(x[0, i])))
        assign[t, l], stages[t, l] = kind, k
    key = lambda c: (stages[c], c[1], c[0])  # noqa: E731
    comps = sorted(((t, l) for t in range(T) for l in range(L) if assign[t, l] == COMPUTE), key=key)
    loads = sorted(((t, l) for t in range(T) for l in range(L) if assign[t, l] == LOAD), key=key)
    name = "milp" if res.status == 0 else "milp (time limit: not proven optimal)"
    plan = Plan(grid, assign, comps, loads, stages, name)
    return plan, stage_cost(plan, load_s, compute_s)


def shaped_costs(grid: ChunkGrid, load_chunk_s: float, dense_s: float, attn_per_chunk_s: float,
                 embed_s: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """Costs shaped like real ones: a load costs the same for every chunk; compute of (t, 0) is
    embedding + projection (tiny); compute of (t, l >= 1) runs a layer whose attention reads
    t+1 chunks, so it grows with t."""
    T, L = grid.shape
    load_s = np.full((T, L), load_chunk_s)
    compute_s = np.empty((T, L))
    compute_s[:, 0] = embed_s
    compute_s[:, 1:] = (dense_s + attn_per_chunk_s * (np.arange(T) + 1.0))[:, None]
    return load_s, compute_s


def small_cases(seed: int = 0) -> list[tuple[str, ChunkGrid, np.ndarray, np.ndarray]]:
    """(name, grid, load_s, compute_s): real-shaped costs on small grids at three I/O speeds,
    then random cost draws."""
    cases = []
    shapes = {"slow-io": 2.0, "balanced": 1.0, "fast-io": 0.5}  # load seconds per chunk
    for T, L in ((2, 3), (3, 3), (4, 3), (3, 4)):
        grid = ChunkGrid(T * 16, 16, L)
        for tag, load in shapes.items():
            cases.append((f"{T}x{L} {tag}", grid, *shaped_costs(grid, load, 0.5, 0.25)))
    rng = np.random.default_rng(seed)
    for j, (T, L) in enumerate(((2, 3), (3, 3), (4, 3), (3, 4), (3, 3), (4, 3))):
        grid = ChunkGrid(T * 16, 16, L)
        load_s = rng.uniform(0.2, 2.0, size=(T, L))
        compute_s = rng.uniform(0.2, 2.0, size=(T, L))
        compute_s[:, 0] *= rng.uniform(0.0, 0.1)
        cases.append((f"{T}x{L} random#{j}", grid, load_s, compute_s))
    return cases


def extra_cases(n: int, seed: int = 123) -> list[tuple[str, ChunkGrid, np.ndarray, np.ndarray]]:
    """n real-shaped cases with drawn I/O and compute speeds (every other one with a half last
    chunk) and n fully random ones, on grids of 6-12 chunks: a wider check than small_cases."""
    rng = np.random.default_rng(seed)
    dims = ((2, 3), (3, 3), (4, 3), (3, 4), (2, 4), (4, 2))
    shaped, rand = [], []
    for i in range(n):
        T, L = dims[i % len(dims)]
        grid = ChunkGrid(T * 16, 16, L)
        load_s, compute_s = shaped_costs(grid, rng.uniform(0.3, 3.0), rng.uniform(0.2, 1.0), rng.uniform(0.05, 0.5))
        if i % 2:
            load_s[-1] *= 0.5
            compute_s[-1] *= 0.5
        shaped.append((f"{T}x{L} shaped#{i}", grid, load_s, compute_s))
        load_s, compute_s = rng.uniform(0.2, 2.0, (T, L)), rng.uniform(0.2, 2.0, (T, L))
        compute_s[:, 0] *= rng.uniform(0.0, 0.1)
        rand.append((f"{T}x{L} random+{i}", grid, load_s, compute_s))
    return shaped + rand


def compare_greedy(cases, time_limit_s: float = 60, verbose: bool = True) -> list[dict]:
    """Greedy stage cost vs the MILP optimum (gap %), and both plans' simulated makespans
    (gap %) beside all-load and all-compute."""
    rows = []
    for name, grid, load_s, compute_s in cases:
        greedy = greedy_plan(grid, load_s, compute_s)
        check_plan(greedy)
        start = time.perf_counter()
        exact, opt_s = milp_plan(grid, load_s, compute_s, time_limit_s=time_limit_s)
        milp_wall_s = time.perf_counter() - start
        check_plan(exact)
        T, L = grid.shape
        g_s = stage_cost(greedy, load_s, compute_s)
        g_sim, m_sim = simulate(greedy, load_s, compute_s), simulate(exact, load_s, compute_s)
        rows.append(dict(
            case=name, T=T, L=L, greedy_stage_s=g_s, milp_opt_s=opt_s,
            gap_pct=100.0 * (g_s - opt_s) / opt_s, milp_optimal=exact.name == "milp",
            greedy_sim_s=g_sim, milp_sim_s=m_sim, sim_gap_pct=100.0 * (g_sim - m_sim) / m_sim,
            all_load_sim_s=simulate(plan_from_depths(grid, [0] * T), load_s, compute_s),
            all_compute_sim_s=simulate(plan_from_depths(grid, [L] * T), load_s, compute_s),
            greedy_plan=greedy.name, greedy_computed=len(greedy.compute_order),
            milp_computed=len(exact.compute_order), milp_wall_s=milp_wall_s))
    if verbose:
        print(f"{'case':<20}{'greedy':>8}{'milp':>8}{'gap%':>7}{'g-sim':>8}{'m-sim':>8}{'gap%':>7}"
              f"{'load':>7}{'comp':>7}{'milp s':>8}")
        for r in rows:
            flag = "" if r["milp_optimal"] else " (milp not proven)"
            miss = "  MISS" if r["gap_pct"] > 5.0 else ""
            print(f"{r['case']:<20}{r['greedy_stage_s']:8.3f}{r['milp_opt_s']:8.3f}{r['gap_pct']:7.2f}"
                  f"{r['greedy_sim_s']:8.3f}{r['milp_sim_s']:8.3f}{r['sim_gap_pct']:7.2f}{r['all_load_sim_s']:7.2f}"
                  f"{r['all_compute_sim_s']:7.2f}{r['milp_wall_s']:8.2f}{miss}{flag}")
        gaps = np.array([r["gap_pct"] for r in rows])
        print(f"{len(rows)} cases: stage-cost gap max {gaps.max():.2f} %, mean {gaps.mean():.2f} %, "
              f"{int((gaps > 5).sum())} above 5 %")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the comparison rows to this file")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random cost draws")
    ap.add_argument("--time-limit-s", type=float, default=60.0, help="HiGHS limit per case")
    ap.add_argument("--extra", type=int, default=0, help="also n drawn real-shaped and n random cases")
    args = ap.parse_args(argv)
    cases = small_cases(args.seed) + (extra_cases(args.extra) if args.extra else [])
    rows = compare_greedy(cases, time_limit_s=args.time_limit_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
