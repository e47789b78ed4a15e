"""HillInfer's hierarchical selector: every token is scored by exactly one pool, so it selects the exact top-k.

The best key (aligned with the query, 200 times the noise's norm) is planted in each region a token can be in: the
storage-only prefix, the recent window held by the CPU pool, the recent tokens that overflowed the CPU pool (when
beta / (1 + beta) < alpha), and a prefix token promoted into the CPU pool; it must be selected at every layer and step.
"""
import math

import numpy as np
import pytest
import torch

from edgekv.platforms.smartssd import CsimScorer
from edgekv.runtime.config import HillInferConfig, cpu_pool_tokens
from edgekv.runtime.model import ModelDims
from edgekv.runtime.hillinfer import HierarchicalSelector
from edgekv.runtime.scoring import NumpyScorer

DIM, LAYERS, STEPS = 8, 2, 3


def _dims() -> ModelDims:
    return ModelDims(n_layers=LAYERS, hidden=DIM, n_heads=1, n_kv_heads=1, head_dim=DIM, vocab=10)
U = np.ones(DIM, dtype=np.float32) / math.sqrt(DIM)
QUERY = torch.from_numpy(U).reshape(1, 1, 1, DIM)
COMBOS = [(0.5, 0.1, 200), (0.1, 0.25, 200), (0.3, 0.3, 130), (0.05, 1.0, 300), (0.1, 0.05, 500), (0.25, 2.0, 257)]


def _regions(alpha, beta, context):
    """{region: planted position} for the regions that exist at this (alpha, beta, context) after the prompt."""
    capacity, recent = cpu_pool_tokens(beta, context + STEPS), min(context, max(1, math.ceil(alpha * context)))
    start = context - recent  # the recent window is [start, context)
    cpu_from = max(0, context - capacity)  # the prompt leaves the latest `capacity` tokens in the CPU pool
    regions = {"cpu-recent": context - 1}
    if cpu_from < start:
        regions["cpu-old"] = cpu_from
    if cpu_from > start:
        regions["recent-overflow"] = start
    if min(start, cpu_from) > 0:
        regions["storage-prefix"] = min(start, cpu_from) // 2
        if capacity - recent >= recent:  # room to demote an older CPU token for every selected storage token
            regions["promoted"] = min(start, cpu_from) // 3
    return regions


CASES = [(a, b, c, region, p) for a, b, c in COMBOS for region, p in _regions(a, b, c).items()]
CASES.append((0.5, 0.1, 200, "recent-overflow", 150))  # the reported case


def _keys(context, plant, seed):
    rng = np.random.default_rng(seed)
    keys = rng.normal(0, 0.1, (LAYERS, context + STEPS, DIM)).astype(np.float32)
    if plant is not None:
        keys[:, plant] = 20 * U
    return keys


def _decode(sel, keys, context, alpha):
    """Prompt, then STEPS decode steps; yields (layer, plant-in-CPU flags, picked, exact top-k) per layer and step."""
    for layer in range(LAYERS):
        sel.append(layer, 0, 0, torch.from_numpy(keys[layer, :context])[None])
    n = context
    for _ in range(STEPS):
        for layer in range(LAYERS):
            in_cpu = sel.in_cpu[layer, 0].copy()
            groups, valid = sel.select(layer, QUERY, torch.tensor([n]))
            scores = keys[layer, :n].astype(np.float16).astype(np.float32) @ U
            exact = np.argsort(-scores, kind="stable")[: math.ceil(alpha * n)]
            yield layer, in_cpu, groups[0][valid[0]].numpy(), exact
        for layer in range(LAYERS):
            sel.append(layer, 0, n, torch.from_numpy(keys[layer, n : n + 1])[None])
        n += 1


@pytest.mark.parametrize("alpha, beta, context, region, plant", CASES, ids=[f"a{a}-b{b}-n{c}-{r}" for a, b, c, r, _ in CASES])
def test_the_best_key_is_selected_in_every_region(tmp_path, alpha, beta, context, region, plant):
    sel = HierarchicalSelector(NumpyScorer(), tmp_path, _dims(), 1, context + STEPS,
                               HillInferConfig(importance_rate=alpha, beta=beta, score_block_tokens=64), scaling=1.0)
    start = context - min(context, max(1, math.ceil(alpha * context)))
    for i, (layer, in_cpu, picked, exact) in enumerate(_decode(sel, _keys(context, plant, seed=plant), context, alpha)):
        if i < LAYERS:  # the first step: the plant is where the region says
            assert in_cpu[plant] == (region in ("cpu-recent", "cpu-old"))
            assert (plant >= start) == (region in ("cpu-recent", "recent-overflow"))
        elif region == "promoted":
            assert in_cpu[plant], "selected once from storage, the plant is promoted into the CPU pool"
        assert plant in picked, f"layer {layer}: the best key at {plant} ({region}) was not selected"
        assert len(set(picked.tolist())) == len(picked), "a position came from both pools"
        assert set(picked.tolist()) == set(exact.tolist())
    sel.close()


@pytest.mark.parametrize("scorer", [NumpyScorer, CsimScorer])
def test_the_exact_top_k_when_k_exceeds_the_kernels_block_top_k(tmp_path, scorer):
    """k = 600 > 256 (the kernel's top-k bound) with all 600 best keys in one 1024-token block."""
    context, alpha = 1200, 0.5
    keys = _keys(context, None, seed=1)
    keys[:, :600] = np.linspace(30, 10, 600, dtype=np.float32)[:, None] * U
    sel = HierarchicalSelector(scorer(), tmp_path, _dims(), 1, context + STEPS,
                               HillInferConfig(importance_rate=alpha, beta=0.01, score_block_tokens=1024), scaling=1.0)
    for layer, _, picked, exact in _decode(sel, keys, context, alpha):
        assert len(picked) == len(exact) and set(picked.tolist()) == set(exact.tolist()), f"layer {layer}"
    sel.close()
