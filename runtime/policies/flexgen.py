"""``flexgen``: the whole layer read from disk every step (FlexGen's offloading, no selection, no prediction)."""
from __future__ import annotations

import math
from dataclasses import replace

from ..selector import AllGroupsSelector
from .base import PolicySpec
from .disk import disk_parts, offloaded, open_store


class FlexGen(PolicySpec, name="flexgen", budgeted=False):
    """Every group of every layer read from disk each step (no selection)."""

    def effective_config(self, cfg):
        return replace(cfg, M=math.ceil(cfg.max_context / cfg.G), reuse=False, sink_tokens=0, window_tokens=0)

    def memory_parts(self, cfg, dims, kv_itemsize, rank, stride_bytes):
        return disk_parts(cfg, dims, kv_itemsize, rank, stride_bytes, predicts=False)

    def build(self, env, batch, cfg):
        store = open_store(env, cfg)
        return offloaded(env, batch, cfg, store, AllGroupsSelector(cfg.max_groups, env.model.device), predict=False)
