"""Prompt KV kept after prefill and replayed into any KV policy, so one prompt is computed once.

Side-by-side runs (the bench: every policy on the same prompts) would otherwise recompute the
same O(S^2) prefill per policy; with a shared cache each policy receives the identical K/V
through its own ``store_prompt`` (its disk writes and K_lr included), only the compute is
skipped.  A cache belongs to one model: keys are the token ids alone.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PromptKV:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: post-RoPE k and v [H_kv, T, d]
    logits: torch.Tensor  # last-token logits [V]
    queries: list[torch.Tensor] | None = None  # per layer the last post-RoPE queries [H, n, d], for a policy wanting them

    def has_queries(self, n: int) -> bool:
        """Whether it can replay the last ``n`` queries (all of a shorter prompt) to a policy asking for them."""
        if n == 0:
            return True
        return self.queries is not None and self.queries[0].shape[1] >= min(n, self.kv[0][0].shape[1])


class PromptKVCache:
    def __init__(self):
        self._entries: dict[str, PromptKV] = {}

    @staticmethod
    def key(ids: list[int]) -> str:
        return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()

    def get(self, ids: list[int]) -> PromptKV | None:
        return self._entries.get(self.key(ids))

    def put(self, ids: list[int], entry: PromptKV) -> None:
        self._entries[self.key(ids)] = entry

    def __len__(self) -> int:
        return len(self._entries)
