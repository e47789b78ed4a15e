"""``kvswap``: KVSwap's policy.  The full KV on disk in groups of G tokens; a low-rank K cache in memory predicts
the next layer's top-M groups from its query, read while the current layer computes; a reuse buffer of C slots
per layer keeps recent picks; S sink and W window tokens are always attended (KVSwap §3-4)."""
from __future__ import annotations

import logging

from ..cluster import CoactivationLayout
from ..adapter import KEYS_PER_RANK
from ..selector import SELECTORS
from .base import PolicySpec
from .disk import disk_parts, offloaded, open_store

log = logging.getLogger(__name__)


class KVSwap(PolicySpec, name="kvswap", predicts=True, selects=True, reuses=True):
    """KV on disk in groups, low-rank prediction of the next layer's top-M groups, reuse buffer."""

    def memory_parts(self, cfg, dims, kv_itemsize, rank, stride_bytes):
        return disk_parts(cfg, dims, kv_itemsize, rank, stride_bytes, predicts=True)

    def build(self, env, batch, cfg):
        model = env.model
        store = open_store(env, cfg)
        kind = SELECTORS[cfg.predictor.selector]
        adapter, rank = (env.adapter_for(cfg), env.rank_for(cfg)) if kind.uses_adapter else (None, 0)
        if kind.uses_adapter and adapter is None:
            _warn_fitting(rank)
        selector = kind.for_batch(adapter, rank, model.dims, batch, cfg, env.backend, model.scaling)
        placement = cfg.placement
        placer = CoactivationLayout.from_config(placement, model.scaling, store.layout.stride_bytes) \
            if placement.clustering else None
        return offloaded(env, batch, cfg, store, selector, placer=placer)


_warned = False


def _warn_fitting(rank: int) -> None:
    """Once per process: no adapter file, so the projection is fitted on the batch's own prompt keys."""
    global _warned
    if not _warned:
        log.warning("no adapter file: fitting the low-rank K adapter (rank %d) on this batch's prompt keys, kept once a "
                    "batch gives %d keys per layer; build a calibrated one with edgekv.install for better predictions",
                    rank, KEYS_PER_RANK * rank)
        _warned = True
