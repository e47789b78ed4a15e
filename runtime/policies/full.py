"""``full``: every token's KV in memory, attended exactly: the reference every other policy is measured against."""
from __future__ import annotations

from ..kv_policy import InMemoryKV
from .base import PolicySpec


class Full(PolicySpec, name="full", on_disk=False, reference=True, budgeted=False):
    """All KV in memory, exact attention (the reference)."""

    def memory_parts(self, cfg, dims, kv_itemsize, rank, stride_bytes):
        return {"kv": dims.n_layers * cfg.max_context * 2 * dims.n_kv_heads * dims.head_dim * kv_itemsize}

    def build(self, env, batch, cfg):
        return InMemoryKV(env.model, batch, cfg.max_context, env.backend)
