"""``hillinfer``: HillInfer's hierarchical importance evaluation.  Tokens (G = 1) are scored in storage (the
SmartSSD kernel, or its numpy reference) and on the CPU over a pool of beta / (1 + beta) of the context; the top
``importance_rate`` of them are fetched and stay resident in reuse slots (runtime/hillinfer.py)."""
from __future__ import annotations

import math
from dataclasses import replace

from ..config import cpu_pool_tokens
from ..hillinfer import HierarchicalSelector
from ..scoring import NumpyScorer
from .base import PolicySpec
from .disk import disk_parts, offloaded, open_store


class HillInfer(PolicySpec, name="hillinfer", selects=True, reuses=True, budgeted=False, group_tokens=1):
    """In-storage and CPU token scoring (SmartSSD); the top importance_rate tokens are fetched.

    Sized by importance_rate and beta, not by a KV budget."""

    def effective_config(self, cfg):
        selected = math.ceil(cfg.hillinfer.importance_rate * cfg.max_context)
        pool = cpu_pool_tokens(cfg.hillinfer.beta, cfg.max_context)
        return replace(cfg, G=1, M=selected, C=max(selected, pool), reuse=True, sink_tokens=0, window_tokens=0)

    def memory_parts(self, cfg, dims, kv_itemsize, rank, stride_bytes):
        parts = disk_parts(cfg, dims, kv_itemsize, rank, stride_bytes, predicts=False)
        parts["k_cpu_pool"] = (dims.n_layers * cpu_pool_tokens(cfg.hillinfer.beta, cfg.max_context) * dims.n_kv_heads
                               * dims.head_dim * 2 + HierarchicalSelector.index_bytes(dims.n_layers, cfg.max_context))
        return parts

    def build(self, env, batch, cfg):
        dims = env.model.dims
        store = open_store(env, cfg)
        selector = HierarchicalSelector(env.scorer or NumpyScorer(), store.dir, dims, batch, cfg.max_context,
                                        cfg.hillinfer, env.model.scaling)
        return offloaded(env, batch, cfg, store, selector)

    def budget_geometry(self, fit):
        return {}
