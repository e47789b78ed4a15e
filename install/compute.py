"""Compute profiler: T_model for one representative transformer block (KVSwap Appendix A.3).

A decode step of one block costs its dense work (q/k/v, attention over the M*G selected
tokens plus the rolling buffer, o-proj, MLP), the predictor (low-rank scores over the S
tokens of K_lr, ReduceMax, top-M) and the reuse-buffer bookkeeping (slot table lookups).
Each part is timed with the runtime's own code on the real model at sampled (b, S, rank, C);
``t_model_ms`` interpolates between samples and multiplies by the layer count.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from edgekv.runtime.forward import decode_attention
from edgekv.runtime.config import PredictorConfig
from edgekv.runtime.devices import decode_threads, intra_op_threads
from edgekv.runtime.model import DecoderModel, ModelDims
from edgekv.runtime.selector import LowRankSelector
from edgekv.runtime.slots import SlotTable


@dataclass
class ComputeProfile:
    fingerprint: dict
    n_layers: int
    block_ms: list = field(default_factory=list)  # [batch, attended_tokens, ms]
    predict_ms: list = field(default_factory=list)  # [batch, context, rank, ms]
    reuse_ms: list = field(default_factory=list)  # [batch, picked_groups, ms]
    seconds: float = 0.0
    h2d_gib_s: float | None = None  # pinned host -> device copies (a GPU's missed records cross it); None: no bus

    def t_model_ms(self, batch: int, context: int, rank: int, picked_groups: int, group_tokens: int,
                   reuse: bool = True) -> float:
        """Per decode step, all layers: dense block + predictor + reuse bookkeeping."""
        block = _interp2(self.block_ms, batch, picked_groups * group_tokens + group_tokens)
        ranks = sorted({r for _, _, r, _ in self.predict_ms})
        near = min(ranks, key=lambda r: abs(np.log2(r) - np.log2(rank)))
        predict = _interp2([(b, s, ms) for b, s, r, ms in self.predict_ms if r == near], batch, context)
        slots = _interp2(self.reuse_ms, batch, picked_groups) if reuse else 0.0
        return self.n_layers * (block + predict + slots)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ComputeProfile":
        return cls(**data)


def _interp2(rows, x: float, y: float) -> float:
    """Bilinear interpolation (linear extrapolation at the edges) over rows of (x, y, value)."""
    xs = sorted({r[0] for r in rows})

    def along_y(x0):
        pts = sorted((r[1], r[2]) for r in rows if r[0] == x0)
        return _lin([p[0] for p in pts], [p[1] for p in pts], y)

    return _lin(xs, [along_y(x0) for x0 in xs], x)


def _lin(xs, ys, x) -> float:
    if len(xs) == 1:
        return float(ys[0])
    i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return float(max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0)))


def _time_ms(fn, device: torch.device, repeats: int = 7) -> float:
    """Median wall time of ``fn`` after one warm-up call (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


@torch.inference_mode()
def time_block(model: DecoderModel, batch: int, tokens: int) -> float:
    """One decode step of layer 0 over ``tokens`` attended KV entries."""
    d = model.dims
    x = torch.randn(batch, 1, d.hidden, dtype=model.dtype, device=model.device)
    rope = model.rope(torch.full((batch, 1), tokens, device=model.device))
    k = torch.randn(batch, d.n_kv_heads, tokens, d.head_dim, dtype=model.dtype, device=model.device)
    mask = torch.ones(batch, 1, 1, tokens, dtype=torch.bool, device=model.device)

    def step():
        q, _, _ = model.qkv(0, x, rope)
        model.finish_layer(0, x, decode_attention(model, q, k, k, mask))

    return _time_ms(step, model.device)


@torch.inference_mode()
def time_predictor(model: DecoderModel, batch: int, context: int, rank: int, group_tokens: int, picked_groups: int,
                   klr_dtype: str) -> float:
    """Layer-ahead prediction for one layer: q-proj of the next layer, scores over K_lr, the top groups."""
    d = model.dims
    one_layer = ModelDims(1, d.hidden, d.n_heads, d.n_kv_heads, d.head_dim, d.vocab)
    selector = LowRankSelector(None, rank, one_layer, batch, context, group_tokens, picked_groups,
                               PredictorConfig(klr_dtype=klr_dtype), model.device, scaling=model.scaling)
    selector.adapter = [torch.randn(d.n_kv_heads * d.head_dim, rank, dtype=selector.dtype, device=model.device)]
    selector.k_lr.copy_(torch.randint(-127, 128, selector.k_lr.shape) if selector.quantized else torch.randn(selector.k_lr.shape))
    selector.k_scale.fill_(0.01)
    x = torch.randn(batch, 1, d.hidden, dtype=model.dtype, device=model.device)
    rope = model.rope(torch.full((batch, 1), context, device=model.device))
    n_groups = torch.full((batch,), context // group_tokens)
    return _time_ms(lambda: selector.select(0, model.query(0, x, rope), n_groups), model.device)


def time_reuse(batch: int, picked_groups: int, max_groups: int) -> float:
    """Slot-table bookkeeping for one layer: a lookup per picked group and sequence, about 1/4 of them misses."""
    table = SlotTable(1, batch, 2 * picked_groups, max_groups)
    rng = np.random.default_rng(0)
    valid = np.ones((batch, picked_groups), dtype=bool)
    picks = [np.stack([rng.choice(max_groups, picked_groups, replace=False) for _ in range(batch)]) for _ in range(8)]
    rounds = itertools.cycle(picks)  # a new set of picks each call, so lookups hit and miss as in decode
    return _time_ms(lambda: table.assign(0, next(rounds), valid), torch.device("cpu"))


def profile_compute(model: DecoderModel, fingerprint: dict, batches, contexts, ranks, mg_const: int,
                    klr_dtype: str = "bfloat16", progress=None) -> ComputeProfile:
    """Sample every part at the given batch sizes, contexts and ranks, on the threads a disk policy's decode step
    computes with (on the CPU it leaves one core to its reads: ``runtime.devices.decode_threads``)."""
    start = time.perf_counter()
    profile = ComputeProfile(fingerprint, model.dims.n_layers)
    tick = progress or (lambda: None)
    with intra_op_threads(decode_threads(model.device, None, reads_kv=True)):
        for b in batches:
            for tokens in _block_tokens(mg_const):
                profile.block_ms.append([b, tokens, time_block(model, b, tokens)])
                tick()
            for groups in _reuse_groups(mg_const):
                profile.reuse_ms.append([b, groups, time_reuse(b, groups, max(contexts) + groups)])
                tick()
            for context in contexts:
                for rank in ranks:
                    profile.predict_ms.append([b, context, rank,
                                               time_predictor(model, b, context, rank, 4, mg_const // 4, klr_dtype)])
                    tick()
    profile.h2d_gib_s = time_h2d(model.device)
    profile.seconds = round(time.perf_counter() - start, 1)
    return profile


def time_h2d(device: torch.device, mib: int = 64, repeats: int = 3) -> float | None:
    """GiB/s of a pinned host -> device copy (how fast a GPU's missed records reach its slots); None on the CPU."""
    if device.type != "cuda":
        return None
    host = torch.empty(mib * 2**20, dtype=torch.uint8).pin_memory()
    dest = torch.empty_like(host, device=device)
    dest.copy_(host, non_blocking=True)
    seconds = min(_time_ms(lambda: dest.copy_(host, non_blocking=True), device) for _ in range(repeats)) / 1e3
    return mib / 1024 / seconds


def _block_tokens(mg_const: int) -> list[int]:
    return sorted({64, mg_const + 16, 2 * mg_const + 16})


def _reuse_groups(mg_const: int) -> list[int]:
    return sorted({max(1, mg_const // 16), max(1, mg_const // 4), mg_const})


def n_compute_samples(batches, contexts, ranks, mg_const: int) -> int:
    per_batch = len(_block_tokens(mg_const)) + len(_reuse_groups(mg_const)) + len(contexts) * len(ranks)
    return len(batches) * per_batch
