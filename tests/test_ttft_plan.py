"""TTFT chunk plans: validity, the two-thread simulation, the greedy against trivial plans and
against the exact stage MILP on grids small enough for CI."""
from __future__ import annotations

import numpy as np
import pytest

from edgekv.install.ttft_milp import milp_plan, shaped_costs, small_cases
from edgekv.runtime.ttft.grid import COMPUTE, LOAD, ChunkGrid
from edgekv.runtime.ttft.plan import (
    Plan, check_plan, greedy_plan, merge_stages, plan_from_depths, random_plan, simulate, stage_cost,
)

GRIDS = [
    ChunkGrid(5, 8, 1),  # one chunk, one layer
    ChunkGrid(100, 32, 1),  # one layer, last chunk partial
    ChunkGrid(10, 16, 5),  # one chunk, odd layer count
    ChunkGrid(70, 16, 3),  # last chunk partial, odd layer count
    ChunkGrid(64, 16, 7),
]


def token_costs(grid: ChunkGrid, load_per_token_s=0.01, compute_per_token_s=0.008, attn_s=0.002):
    """Real-shaped costs scaled by each chunk's token count (the last chunk may be partial)."""
    T, L = grid.shape
    n = np.array([b - a for a, b in map(grid.span, range(T))], dtype=float)[:, None]
    load_s = np.repeat(n * load_per_token_s, L, axis=1)
    compute_s = np.repeat(n * (compute_per_token_s + attn_s * (np.arange(T)[:, None] + 1)), L, axis=1)
    compute_s[:, 0] = n[:, 0] * 1e-4
    return load_s, compute_s


def trivial_s(grid, load_s, compute_s):
    T, L = grid.shape
    return min(simulate(plan_from_depths(grid, [0] * T), load_s, compute_s),
               simulate(plan_from_depths(grid, [L] * T), load_s, compute_s))


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_plans_are_valid_on_odd_grids(grid):
    T, L = grid.shape
    load_s, compute_s = token_costs(grid)
    rng = np.random.default_rng(1)
    plans = [greedy_plan(grid, load_s, compute_s), greedy_plan(grid, load_s, compute_s, stage_s=0.05),
             plan_from_depths(grid, [0] * T), plan_from_depths(grid, [L] * T),
             plan_from_depths(grid, [max(L - t, 0) for t in range(T)]),  # falling staircase
             plan_from_depths(grid, [min(t, L) for t in range(T)])]  # rising: computes wait on loads
    plans += [random_plan(grid, rng) for _ in range(10)]
    for plan in plans:
        check_plan(plan)
        if plan.stages is not None:  # within a stage neither thread waits on the other
            assert simulate(plan, load_s, compute_s) <= stage_cost(plan, load_s, compute_s) + 1e-9
    s = plans[0].summary(chunk_bytes=np.ones(grid.shape))
    assert s["computed"] + s["loaded"] == T * L
    assert s["loaded_bytes_frac"] == pytest.approx(s["loaded"] / (T * L))


def test_trivial_plans_sum_their_thread():
    grid = ChunkGrid(48, 16, 4)
    rng = np.random.default_rng(0)
    load_s, compute_s = rng.uniform(0.1, 1, grid.shape), rng.uniform(0.1, 1, grid.shape)
    assert simulate(plan_from_depths(grid, [0, 0, 0]), load_s, compute_s) == pytest.approx(load_s.sum())
    assert simulate(plan_from_depths(grid, [4, 4, 4]), load_s, compute_s) == pytest.approx(compute_s.sum())
    # falling depths: every compute reads computes only, so the threads never wait on each other
    stairs = plan_from_depths(grid, [3, 2, 1])
    assert simulate(stairs, load_s, compute_s) == pytest.approx(
        max(compute_s[stairs.assign == COMPUTE].sum(), load_s[stairs.assign == LOAD].sum()))


def test_simulate_overlap_by_hand():
    """2x2, token chunk 0 loaded, chunk 1 computed: (1, 1) waits for the load of (0, 0)."""
    grid = ChunkGrid(2, 1, 2)
    load_s = np.array([[1.0, 1.0], [9.0, 9.0]])
    compute_s = np.array([[9.0, 9.0], [0.1, 1.5]])
    plan = plan_from_depths(grid, [0, 2])
    assert plan.load_order == [(0, 0), (0, 1)]  # the chunk a compute waits on goes first
    # compute: (1, 0) in [0, 0.1]; (1, 1) in [max(0.1, 1.0), 2.5]; loads end at 2.0
    assert simulate(plan, load_s, compute_s) == pytest.approx(2.5)
    late = Plan(grid, plan.assign, plan.compute_order, [(0, 1), (0, 0)])
    assert simulate(late, load_s, compute_s) == pytest.approx(3.5)  # (0, 0) arrives at 2.0


def test_simulate_refuses_bad_plans():
    grid = ChunkGrid(3, 1, 3)
    ones = np.ones(grid.shape)
    good = plan_from_depths(grid, [3, 3, 3])
    order = list(good.compute_order)
    order.remove((1, 2))
    order.insert(order.index((0, 1)), (1, 2))  # (1, 2) reads (0, 1), computed only later
    for bad in (
        Plan(grid, good.assign, order, []),  # deadlock
        Plan(grid, good.assign, good.compute_order[:-1], []),  # a chunk never produced
        Plan(grid, good.assign, good.compute_order + [(0, 0)], []),  # a chunk twice
        Plan(grid, np.array([[0, 1, 1]] * 3, dtype=np.int8), [], []),  # computes above a load
    ):
        with pytest.raises(ValueError):
            simulate(bad, ones, ones)
        with pytest.raises(ValueError):
            check_plan(bad)
    with pytest.raises(ValueError):
        simulate(good, ones, -ones)


def test_merge_stages_keeps_load_boundaries():
    """A stage joins the one before unless a compute of it reads a load made there."""
    assign = np.array([[LOAD, LOAD], [COMPUTE, COMPUTE], [COMPUTE, COMPUTE]], dtype=np.int8)
    # stage 1 holds layer-0 computes (read nothing): joins stage 0; stage 2's (1, 1) reads the
    # load of (0, 0), now in the merged stage 0: stays apart
    stages = np.array([[0, 0], [1, 2], [1, 2]])
    assert merge_stages(assign, stages).tolist() == [[0, 0], [0, 1], [0, 1]]
    # stage 2's (2, 1) reads (0, 0) from stage 0, not stage 1: joins stage 1
    stages = np.array([[0, 0], [0, 1], [2, 2]])
    assert merge_stages(assign, stages).tolist() == [[0, 0], [0, 1], [1, 1]]


COST_SHAPES = {
    "slow-io": (2.0, 0.5, 0.25), "balanced": (1.0, 0.5, 0.25), "fast-io": (0.5, 0.5, 0.25),
    "compute-bound": (0.05, 2.0, 1.0),  # loading wins almost everywhere
}


@pytest.mark.parametrize("shape", COST_SHAPES)
@pytest.mark.parametrize("T,L", [(1, 4), (3, 3), (6, 5), (12, 8)])
def test_greedy_beats_trivial_plans(shape, T, L):
    grid = ChunkGrid(T * 16, 16, L)
    load_s, compute_s = shaped_costs(grid, *COST_SHAPES[shape])
    plan = greedy_plan(grid, load_s, compute_s)
    check_plan(plan)
    assert simulate(plan, load_s, compute_s) <= trivial_s(grid, load_s, compute_s) + 1e-9


def test_greedy_beats_trivial_plans_on_random_costs():
    rng = np.random.default_rng(7)
    for _ in range(20):
        grid = ChunkGrid(int(rng.integers(1, 80)), 16, int(rng.integers(1, 6)))
        load_s = rng.uniform(0.0, 2.0, grid.shape)
        compute_s = rng.uniform(0.0, 2.0, grid.shape) * rng.choice([0.1, 1.0, 10.0])
        plan = greedy_plan(grid, load_s, compute_s)
        check_plan(plan)
        assert simulate(plan, load_s, compute_s) <= trivial_s(grid, load_s, compute_s) + 1e-9


# The real-shaped small cases of install/ttft_milp whose MILP solves in well under a second,
# plus the random draws the greedy matches.  "3x4 random#3" misses (greedy 17.6 % above the
# optimum: the optimum computes a chunk that is cheap to load to reach one that is dear to load,
# two steps the greedy's one-step potential does not see); it stays here as a known miss.
CASES = {name: case for name, *case in small_cases()}
WITHIN_5PCT = ["2x3 slow-io", "2x3 balanced", "2x3 fast-io", "3x3 slow-io", "3x3 balanced",
               "3x3 fast-io", "3x4 balanced", "2x3 random#0", "3x3 random#1", "3x3 random#4"]


@pytest.mark.parametrize("name", WITHIN_5PCT + [
    pytest.param("3x4 random#3", marks=pytest.mark.xfail(strict=True, reason="known greedy miss: 17.6 %")),
])
def test_greedy_within_5pct_of_milp(name):
    grid, load_s, compute_s = CASES[name]
    exact, opt_s = milp_plan(grid, load_s, compute_s, time_limit_s=30)
    assert exact.name == "milp"  # proven optimal
    check_plan(exact)
    assert simulate(exact, load_s, compute_s) <= opt_s + 1e-9
    for objective in ("makespan", "stage"):
        greedy = greedy_plan(grid, load_s, compute_s, objective=objective)
        g_s = stage_cost(greedy, load_s, compute_s)
        assert opt_s <= g_s + 1e-9  # the greedy's stages are a feasible MILP point
        assert g_s <= 1.05 * opt_s, objective


def test_milp_on_a_tiny_grid_by_hand():
    """2x2 with compute cheap except (1, 1): compute (0, *) and (1, 0) in stage 0 while (1, 1)
    loads; one stage of max(1 + 0.01 * 3, 1) seconds."""
    grid = ChunkGrid(2, 1, 2)
    load_s = np.ones((2, 2))
    compute_s = np.array([[0.01, 1.0], [0.01, 5.0]])
    plan, opt_s = milp_plan(grid, load_s, compute_s)
    assert opt_s == pytest.approx(1.02)
    assert plan.assign.tolist() == [[COMPUTE, COMPUTE], [COMPUTE, LOAD]]
    assert stage_cost(greedy_plan(grid, load_s, compute_s), load_s, compute_s) == pytest.approx(1.02)
