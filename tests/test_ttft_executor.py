"""The TTFT executor against full prefill: dependency order, exactness for every plan shape, failed loads.

The loader here serves the KV of a one-pass prefill (what a lossless store holds) from memory;
the store's own reads are tested in test_context_store.py, the engine path in test_ttft.py.
"""
import threading
import time

import numpy as np
import pytest
import torch

from edgekv.runtime.forward import prefill
from edgekv.runtime.ttft.compute import ChunkCompute, PrefixKV
from edgekv.runtime.ttft.executor import DONE, Executor
from edgekv.runtime.ttft.grid import COMPUTE, LOAD, ChunkGrid, check_order
from edgekv.runtime.ttft.plan import plan_from_depths, random_plan

PROMPT_TOKENS, STORED_TOKENS, CHUNK_TOKENS = 300, 272, 64  # 5 token chunks, the last partial (16 tokens)


@pytest.fixture(scope="module")
def model():
    from edgekv.runtime import Engine

    return Engine.from_pretrained("fixture", policy="full", device="cpu").model


@pytest.fixture(scope="module")
def reference(model):
    ids = torch.randint(0, model.dims.vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    kv = PrefixKV(model, len(ids))
    logits = prefill(model, ids, kv.put_prompt)
    return ids, kv, logits


class MemoryLoader:
    """Chunks of the reference KV; ``fail`` raises OSError once per listed chunk, ``delay_s`` paces every load."""

    def __init__(self, grid, kv, fail=(), delay_s=0.0):
        self.grid, self.kv, self.fail, self.delay_s = grid, kv, set(fail), delay_s
        self.loaded = []
        self.lock = threading.Lock()

    def nbytes(self, t, l):
        start, stop = self.grid.span(t)
        return (stop - start) * 1024

    def load(self, t, l):
        time.sleep(self.delay_s)
        with self.lock:
            if (t, l) in self.fail:
                self.fail.discard((t, l))
                raise OSError(f"chunk ({t}, {l}) unreadable")
            self.loaded.append((t, l))
        start, stop = self.grid.span(t)
        k, v = self.kv.layer(l)
        return k[:, start:stop].clone(), v[:, start:stop].clone()


def _run(model, reference, make_executor):
    ids, ref_kv, _ = reference
    grid = ChunkGrid(STORED_TOKENS, CHUNK_TOKENS, model.dims.n_layers)
    kv = PrefixKV(model, len(ids))
    tail = (STORED_TOKENS, len(ids))
    computer = ChunkCompute(model, ids, kv, final_span=tail)
    executor = make_executor(grid, computer)
    stats = executor.run()
    for layer in range(model.dims.n_layers):
        computer.advance(tail, layer)
    return grid, kv, computer.logits(tail), stats


def _plan_executor(plan, loader_kw=None, adapt=False, compute_s=None, link_mib_s=None):
    def make(grid, computer):
        loader = MemoryLoader(grid, _run.ref_kv, **(loader_kw or {}))
        make.loader = loader
        return Executor(grid, computer, loader, plan(grid).compute_order, plan(grid).load_order, assign=plan(grid).assign,
                        compute_s=compute_s, link_mib_s=link_mib_s, adapt=adapt)
    return make


def _assert_exact(reference, kv, logits):
    ids, ref_kv, ref_logits = reference
    torch.testing.assert_close(kv.kv, ref_kv.kv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert int(logits.argmax()) == int(ref_logits.argmax())


SHAPES = {
    "all_load": lambda g: plan_from_depths(g, [0] * g.n_chunks),
    "all_compute": lambda g: plan_from_depths(g, [g.n_layers] * g.n_chunks),
    "layer0_only": lambda g: plan_from_depths(g, [1] * g.n_chunks),
    "staircase": lambda g: plan_from_depths(g, [max(g.n_layers - t, 0) for t in range(g.n_chunks)]),
    "random": lambda g: random_plan(g, np.random.default_rng(5)),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_plan_shape_matches_full_prefill_and_keeps_dependency_order(model, reference, shape):
    _run.ref_kv = reference[1]
    make = _plan_executor(SHAPES[shape])
    grid, kv, logits, stats = _run(model, reference, make)
    check_order(grid, [(kind, t, l) for kind, t, l, _ in stats.events])
    plan = SHAPES[shape](grid)
    assert stats.computed == int((plan.assign == COMPUTE).sum())
    assert sorted(make.loader.loaded) == sorted(map(tuple, np.argwhere(plan.assign == LOAD).tolist()))
    _assert_exact(reference, kv, logits)


def test_cake_claim_mode_meets_in_the_middle(model, reference):
    _run.ref_kv = reference[1]

    def make(grid, computer):
        back = [(t, l) for t in reversed(range(grid.n_chunks)) for l in range(grid.n_layers)]
        return Executor(grid, computer, MemoryLoader(grid, reference[1], delay_s=0.002), grid.chunks(), back)

    grid, kv, logits, stats = _run(model, reference, make)
    check_order(grid, [(kind, t, l) for kind, t, l, _ in stats.events])
    assert stats.loaded + stats.computed == grid.n_chunks * grid.n_layers
    _assert_exact(reference, kv, logits)


def test_a_failed_load_is_recomputed_and_the_answer_is_unchanged(model, reference):
    _run.ref_kv = reference[1]
    depths = lambda g: plan_from_depths(g, [1] * g.n_chunks)  # noqa: E731
    fail = [(2, 2), (4, 1), (0, 3)]
    grid, kv, logits, stats = _run(model, reference, _plan_executor(depths, {"fail": fail}))
    assert stats.failed_loads == len(fail)
    events = [(kind, t, l) for kind, t, l, _ in stats.events]
    for t, l in fail:  # the failed chunk and every loaded layer below it were computed again
        assert ("compute", t, l) in events
        assert all(("compute", t, k) in events for k in range(l))
    _assert_exact(reference, kv, logits)


def test_a_failing_loader_error_other_than_oserror_surfaces_as_itself(model, reference):
    class Broken(MemoryLoader):
        def load(self, t, l):
            raise KeyError("a bug in the loader")

    def make(grid, computer):
        plan = plan_from_depths(grid, [1] * grid.n_chunks)
        return Executor(grid, computer, Broken(grid, reference[1]), plan.compute_order, plan.load_order, assign=plan.assign)

    with pytest.raises(KeyError, match="a bug in the loader"):
        _run(model, reference, make)


def test_a_slow_link_moves_chunks_to_the_compute_thread(model, reference):
    """Planned for a fast link (every layer above 0 loaded), served by a slow one: the idle compute thread takes
    chunks it can compute sooner than they would arrive, up to the per-stage bound."""
    _run.ref_kv = reference[1]
    depths = lambda g: plan_from_depths(g, [1] * g.n_chunks)  # noqa: E731
    grid = ChunkGrid(STORED_TOKENS, CHUNK_TOKENS, model.dims.n_layers)
    make = _plan_executor(depths, {"delay_s": 0.2}, adapt=True, compute_s=np.full(grid.shape, 1e-3), link_mib_s=1000.0)
    _, kv, logits, stats = _run(model, reference, make)
    assert 0 < stats.to_compute <= 4  # one stage in a depth plan: at most max_migrations moves
    assert stats.loaded == grid.n_chunks * (grid.n_layers - 1) - stats.to_compute
    _assert_exact(reference, kv, logits)


def test_an_idle_compute_thread_continues_a_chain_through_loaded_layers(model, reference):
    """Layer 1 of every chunk arrives at once, the layers above it slowly: to take a layer-2 chunk the compute
    thread first computes the loaded layer 1 again (its hidden states never existed), and says so. Layer 0's
    compute waits until every layer 1 is in (on a fast CPU it would otherwise finish first and take layer 1s
    still in flight, which needs no recompute)."""
    _run.ref_kv = reference[1]

    class Staged(MemoryLoader):
        def load(self, t, l):
            self.delay_s = 0.0 if l == 1 else 0.3
            return super().load(t, l)

    def make(grid, computer):
        plan = plan_from_depths(grid, [1] * grid.n_chunks)
        executor = Executor(grid, computer, Staged(grid, reference[1]), plan.compute_order, plan.load_order,
                            assign=plan.assign, compute_s=np.full(grid.shape, 1e-3), link_mib_s=1000.0, adapt=True)
        advance = computer.advance

        def advance_once_layer_one_is_in(span, layer):
            while layer == 0 and not (executor.state[:, 1] == DONE).all():
                time.sleep(0.001)
            return advance(span, layer)

        computer.advance = advance_once_layer_one_is_in
        return executor

    grid, kv, logits, stats = _run(model, reference, make)
    assert stats.to_compute > 0 and stats.recomputed > 0
    assert stats.computed == grid.n_chunks + stats.to_compute  # layer 0 everywhere, plus the stolen ones
    _assert_exact(reference, kv, logits)
