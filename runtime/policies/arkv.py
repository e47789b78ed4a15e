"""``arkv``: ARKV's tri-state cache in memory under ``max_kv_mem_mib``: each token original, quantized or
evicted (runtime/arkv.py).  A budget that holds the whole cache leaves nothing to tailor: it runs ``full``."""
from __future__ import annotations

import torch

from ..arkv import GROUP_TOKENS, ArkvGeometry, ArkvKV
from ..memory import BudgetError, MIB
from .base import PolicySpec
from .full import Full


class Arkv(PolicySpec, name="arkv", on_disk=False):
    """In memory under the budget: tokens original, quantized or evicted by attention statistics."""

    def memory_parts(self, cfg, dims, kv_itemsize, rank, stride_bytes):
        geo = ArkvGeometry(cfg, dims, kv_itemsize)
        if geo.fits_all:  # nothing to tailor: it runs `full`
            return Full().memory_parts(cfg, dims, kv_itemsize, rank, stride_bytes)
        if geo.arena_bytes < geo.min_arena_bytes:
            need_mib = geo.min_arena_bytes * dims.n_layers * cfg.max_batch / MIB
            raise BudgetError(
                f"policy 'arkv' needs at least {need_mib:.2f} MiB of KV memory for max_batch={cfg.max_batch} (per layer: "
                f"arkv_window_tokens={cfg.arkv.arkv_window_tokens} + 1 + {GROUP_TOKENS} tokens in original precision and one "
                f"quantized group) but max_kv_mem_mib is {cfg.max_kv_mem_mib:g} MiB; raise max_kv_mem_mib or lower "
                "arkv_window_tokens or max_batch"
            )
        return {"window_original": dims.n_layers * geo.window_bytes,
                "tokens_original_or_quantized": dims.n_layers * (geo.arena_bytes - geo.window_bytes)}

    def build(self, env, batch, cfg):
        model = env.model
        if ArkvGeometry(cfg, model.dims, torch.empty(0, dtype=model.dtype).element_size()).fits_all:
            return Full().build(env, batch, cfg)
        return ArkvKV(model, batch, cfg, env.backend)
