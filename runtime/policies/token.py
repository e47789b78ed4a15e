"""``token``: kvswap at token granularity (G = 1, M*G tokens kept, no reuse buffer): what grouping buys."""
from __future__ import annotations

from dataclasses import replace

from .kvswap import KVSwap


class Token(KVSwap):
    name = "token"
    summary = "kvswap with G = 1 and no reuse buffer (token-level selection)"
    reuses = False
    group_tokens = 1

    def effective_config(self, cfg):
        return replace(cfg, G=1, M=cfg.M * cfg.G, reuse=False).within_context()
