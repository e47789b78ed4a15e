"""``token``: kvswap at token granularity (G = 1, M*G tokens kept, no reuse buffer): what grouping buys."""
from __future__ import annotations

from dataclasses import replace

from .kvswap import KVSwap


class Token(KVSwap, name="token", reuses=False, group_tokens=1):
    """kvswap with G = 1 and no reuse buffer (token-level selection)."""

    def effective_config(self, cfg):
        return replace(cfg, G=1, M=cfg.M * cfg.G, reuse=False).within_context()
