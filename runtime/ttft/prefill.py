"""A prompt's prefill when a prefix of it is in the context store: the four ways side by side.

``full_prefill`` computes everything in one pass (no store); ``load_only`` loads every stored
chunk, then computes the rest; ``bidirectional`` is Cake's schedule (compute from the front,
load from the back, meet where they meet); ``edgekv`` plans each chunk's path with SparKV's
potential-aware greedy from predicted costs and adapts while it runs.  Every way ends with
the prompt's unstored tail computed over the full prefix, which gives the first token's logits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..disk_store import aligned_zeros
from ..model import DecoderModel
from .compute import ChunkCompute, PrefixKV
from .executor import Executor
from .grid import COMPUTE, ChunkGrid
from .costs import ComputeCostModel, load_s
from .plan import plan_from_depths, quick_plan

METHODS = ("full_prefill", "load_only", "bidirectional", "edgekv")
FULL_CHUNK_TOKENS = 512  # query chunk of a full prefill without a store


@dataclass
class TTFTOptions:
    """How a prompt with a stored prefix is prefilled; ``Engine.ttft`` holds one."""

    method: str = "edgekv"
    compute_costs: object | None = None  # a ttft.costs model from the install step; None: calibrated on first use
    link_mib_s: float | None = None  # the store's read rate to plan with; None: the rate measured by the last request
    adapt: bool = True  # move chunks between the paths when the run drifts from the plan
    observed_link_mib_s: float | None = None  # what the last request's loads achieved

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown TTFT method {self.method!r}; choose one of {list(METHODS)}")
        if self.link_mib_s is not None and not self.link_mib_s > 0:
            raise ValueError(f"link_mib_s must be > 0, got {self.link_mib_s}")


@dataclass
class StoredPrefill:
    logits: torch.Tensor  # last prompt token [V]
    kv: PrefixKV  # every layer's K/V of the whole prompt
    method: str
    stats: dict = field(default_factory=dict)


class StoreLoader:
    """Reads chunk (t, l) of a stored prefix into K/V tensors; an aligned buffer per thread and size."""

    def __init__(self, store, prefix, dtype: torch.dtype):
        self.store, self.refs, self.layout = store, prefix.chunks, store.layout
        if self.layout.dtype != dtype:
            raise ValueError(f"the store holds {self.layout.dtype} KV but the model runs {dtype}")
        self._buffers: dict[int, np.ndarray] = {}

    def nbytes(self, t: int, l: int) -> int:
        return self.store.read_bytes_per_chunk_layer(self.refs[t])

    def load(self, t: int, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        ref, lay = self.refs[t], self.layout
        n_groups = ref.n_tokens // lay.group_tokens
        if n_groups not in self._buffers:  # only the I/O thread loads: one buffer per chunk size
            self._buffers[n_groups] = aligned_zeros((n_groups, lay.stride_bytes), lay.align_bytes)
        out = self._buffers[n_groups]
        self.store.read(ref, l, out)
        rec = lay.typed(out)  # [n, 2, H_kv, G, d]
        k, v = (rec[:, i].transpose(0, 1).reshape(lay.n_kv_heads, ref.n_tokens, lay.head_dim) for i in (0, 1))
        return k, v


def run_prefill(model: DecoderModel, ids: list[int], store, prefix, options: TTFTOptions) -> StoredPrefill:
    """Prefill ``ids`` whose first ``prefix.n_tokens`` are stored, the way ``options.method`` says."""
    method = options.method
    started = time.perf_counter()
    kv = PrefixKV(model, len(ids))
    if method == "full_prefill" or prefix is None:
        logits = compute_all(model, ids, kv, store.chunk_tokens if store is not None else FULL_CHUNK_TOKENS)
        return StoredPrefill(logits, kv, "full_prefill", {"ttft_s": time.perf_counter() - started, "stored_tokens": 0})
    grid = ChunkGrid(prefix.n_tokens, store.chunk_tokens, model.dims.n_layers)
    loader = StoreLoader(store, prefix, model.dtype)
    tail = (prefix.n_tokens, len(ids))
    computer = ChunkCompute(model, ids, kv, final_span=tail)
    stats: dict = {"stored_tokens": prefix.n_tokens}
    if method == "edgekv" and options.compute_costs is None:  # once per engine, not counted as planning
        options.compute_costs = calibrate(model, grid.chunk_tokens, grid.n_tokens)
    planned = time.perf_counter()
    if method == "bidirectional":
        front = grid.chunks()
        back = [(t, l) for t in reversed(range(grid.n_chunks)) for l in range(grid.n_layers)]
        executor = Executor(grid, computer, loader, front, back)
    else:
        link = options.link_mib_s or options.observed_link_mib_s
        if method == "load_only":
            plan, compute_s = plan_from_depths(grid, [0] * grid.n_chunks, name="load_only"), None
        else:
            if link is None:
                link = _probe_link_mib_s(loader, grid)
            compute_s = options.compute_costs.compute_s(grid)
            chunk_bytes = [loader.nbytes(t, 0) for t in range(grid.n_chunks)]
            plan = quick_plan(grid, load_s(grid, chunk_bytes, link), compute_s)
        stats["plan_s"] = time.perf_counter() - planned
        stats["planned_compute"] = int((plan.assign == COMPUTE).sum())
        stats["planned_link_mib_s"] = link
        executor = Executor(grid, computer, loader, plan.compute_order, plan.load_order, assign=plan.assign,
                            compute_s=compute_s, link_mib_s=link, stages=plan.stages,
                            adapt=options.adapt and method == "edgekv")
    run = executor.run()
    if run.load_busy_s > 0:
        options.observed_link_mib_s = run.bytes_loaded / run.load_busy_s / 2**20
    for layer in range(model.dims.n_layers):
        computer.advance(tail, layer)
    logits = computer.logits(tail)
    stats |= run.to_json() | {"ttft_s": time.perf_counter() - started}
    return StoredPrefill(logits, kv, method, stats)


@torch.inference_mode()
def calibrate(model: DecoderModel, chunk_tokens: int, context: int) -> ComputeCostModel:
    """A cost model from three timed chunks, for an engine without the install step's profile.

    Layer 0 at one length; layer >= 1 at the first and the last chunk position, which fixes the
    per-token and the per-query-key-pair seconds (the install profile fits all four features).
    """
    n = min(chunk_tokens, context)
    last = max(context - n, 0)
    ids = [0] * (last + n)
    kv = PrefixKV(model, len(ids))
    computer = ChunkCompute(model, ids, kv)

    def timed(span, layer):
        best = float("inf")
        for _ in range(2):  # the first run of a shape pays for allocation
            if layer:
                computer.advance(span, layer - 1)
            started = time.perf_counter()
            computer.advance(span, layer)
            best = min(best, time.perf_counter() - started)
            computer.drop(span)
        return best

    t0 = timed((0, n), 0)
    first, final = timed((0, n), 1), timed((last, last + n), 1)
    pairs_first, pairs_last = n * n, n * (last + n)
    per_pair = max(final - first, 0.0) / max(pairs_last - pairs_first, 1)
    per_token = max(first - per_pair * pairs_first, 0.0) / n
    return ComputeCostModel((0.0, t0 / n), (0.0, per_token, per_pair, 0.0), kind="calibrated")


def compute_all(model: DecoderModel, ids: list[int], kv: PrefixKV, chunk_tokens: int) -> torch.Tensor:
    """Full prefill, chunked: the same arithmetic as one pass (as fast: 37.0 s against 36.9 s at 8K on
    SmolLM2 here), with attention never wider than chunk x prompt, so a long prompt's score matrix
    never holds prompt x prompt entries per head."""
    spans = [(a, min(a + chunk_tokens, len(ids))) for a in range(0, len(ids), chunk_tokens)]
    computer = ChunkCompute(model, ids, kv, final_span=spans[-1])
    for layer in range(model.dims.n_layers):
        for span in spans:
            computer.advance(span, layer)
    return computer.logits(spans[-1])


def _probe_link_mib_s(loader: StoreLoader, grid: ChunkGrid) -> float:
    """No rate known yet: time one chunk read (the top layer of the last chunk, which plans load anyway)."""
    t, l = grid.n_chunks - 1, grid.n_layers - 1
    started = time.perf_counter()
    loader.load(t, l)
    return loader.nbytes(t, l) / max(time.perf_counter() - started, 1e-6) / 2**20
