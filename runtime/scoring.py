"""In-storage importance scoring: the interface the runtime calls and the numpy reference.

A pool is a file of fp16 keys, token-major [n][H_kv][d], plus the token position of each
row (HillInfer's SmartSSD KV pool).  A scorer returns score blocks <pos, score> for every
pooled token (score = scale * sum over KV heads of q_h . k_h, where q_h sums the query heads
of KV head h) and, per block of ``block_tokens``, that block's top-k; the host merges them.
Backends that score in storage report how many bytes crossed to the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCORE_ENTRY = np.dtype([("pos", "<i4"), ("score", "<f4")])


@dataclass(frozen=True)
class KeyPool:
    path: Path
    positions: np.ndarray  # int32 [n]
    n_kv_heads: int
    head_dim: int
    offset_bytes: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.positions)

    @property
    def key_bytes(self) -> int:
        return self.n_kv_heads * self.head_dim * 2


@dataclass
class ScoreResult:
    scores: np.ndarray  # SCORE_ENTRY [n], the score blocks in pool order
    block_topk: np.ndarray  # SCORE_ENTRY [n_blocks, k] best first (empty when k = 0)
    bytes_to_host: int  # what crossed from storage to the host
    bytes_from_storage: int  # what the scorer read from the pool

    def topk(self, k: int) -> np.ndarray:
        """Positions of the k best tokens, merged from the block top-ks (or all scores)."""
        source = self.block_topk.reshape(-1) if self.block_topk.size else self.scores
        order = np.argsort(-source["score"], kind="stable")[:k]
        return source["pos"][order]


class InStorageScorer:
    """Interface: score one query against a pool; ``name`` says where the scoring ran.

    ``emulated``: the scoring ran on the host, not in storage, so its speed and byte counts are host figures, never
    the card's.  ``max_top_k``: the largest per-block top-k the backend computes (the kernel's static bound)."""

    name = "abstract"
    emulated = True
    max_top_k = 1 << 30

    @property
    def backend_label(self) -> str:
        return f"{self.name} (emulated)" if self.emulated else self.name

    def score(self, pool: KeyPool, query: np.ndarray, scale: float, block_tokens: int = 1024, top_k: int = 0) -> ScoreResult:
        raise NotImplementedError


def write_pool(path: Path, keys: np.ndarray) -> None:
    """keys [n, H_kv, d] -> the pool file (fp16, token-major)."""
    np.ascontiguousarray(keys, dtype=np.float16).tofile(path)


def score_keys(keys: np.ndarray, positions: np.ndarray, query: np.ndarray, scale: float, block_tokens: int,
               top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel computes, on keys [n, H_kv, d] in memory: the score blocks and each block's top-k, best first,
    padded to k with (-1, -inf); one owner for the reference scorer and test doubles of the card."""
    n = len(positions)
    values = np.einsum("nhd,hd->n", keys.astype(np.float32), query.astype(np.float32)) * scale
    scores = np.empty(n, dtype=SCORE_ENTRY)
    scores["pos"], scores["score"] = positions, values
    blocks = []
    for start in range(0, n, block_tokens) if top_k else []:
        block = scores[start : start + block_tokens]
        best = block[np.argsort(-block["score"], kind="stable")[:top_k]]
        blocks.append(np.pad(best, (0, top_k - len(best)), constant_values=np.array((-1, -np.inf), SCORE_ENTRY)))
    return scores, np.stack(blocks) if blocks else np.empty((0, 0), dtype=SCORE_ENTRY)


class NumpyScorer(InStorageScorer):
    """The reference: the host reads every key and scores in fp32 (what host-side scoring costs)."""

    name = "numpy"

    def score(self, pool, query, scale, block_tokens=1024, top_k=0):
        n = pool.n_tokens
        keys = np.fromfile(pool.path, dtype=np.float16, count=n * pool.n_kv_heads * pool.head_dim,
                           offset=pool.offset_bytes).reshape(n, pool.n_kv_heads, pool.head_dim)
        scores, block_topk = score_keys(keys, pool.positions, query, scale, block_tokens, top_k)
        read = n * pool.key_bytes
        return ScoreResult(scores, block_topk, read, read)
