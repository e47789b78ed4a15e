"""In-storage importance scoring: the interface the runtime calls and the numpy reference.

A pool is a file of fp16 keys, token-major [n][H_kv][d], plus the token position of each
row (HillInfer's SmartSSD KV pool).  A scorer returns score blocks <pos, score> for every
pooled token (score = scale * sum over KV heads of q_h . k_h, where q_h sums the query heads
of KV head h) and, per block of ``block_tokens``, that block's top-k; the host merges them.
Backends that score in storage report how many bytes crossed to the host.  ``check_result`` is
what a consumer runs before trusting a backend's blocks: a kernel that stopped early or wrote
garbage is refused (``ScoreBlockError``), never ranked.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCORE_ENTRY = np.dtype([("pos", "<i4"), ("score", "<f4")])
# what a backend's score buffers hold before the kernel writes them: an entry left unwritten is refused
UNWRITTEN = np.array((-1, np.nan), dtype=SCORE_ENTRY)


class ScoreBlockError(RuntimeError):
    """A scorer's result cannot be the kernel's answer (short, garbled or inconsistent): it must not be used."""


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


def check_result(result: ScoreResult, pool: KeyPool, block_tokens: int, top_k: int) -> None:
    """Raise ScoreBlockError unless the result is well formed: one entry per pooled token echoing its position
    (pool positions are distinct), no NaN score, and each block's top-k made of that block's own entries (their
    scores as in the score blocks), every entry better than its lowest in the top-k, padded with (-1, -inf) past
    the block's tokens.  Structure, not arithmetic: scores wrong alike in both outputs would pass."""
    n, scores, top = pool.n_tokens, result.scores, result.block_topk
    where = f"scores of {pool.path} ({n} tokens)"
    if scores.dtype != SCORE_ENTRY or scores.shape != (n,):
        raise ScoreBlockError(f"{where}: {scores.shape} entries of {scores.dtype} returned, not ({n},) of {SCORE_ENTRY}")
    wrong = np.flatnonzero(scores["pos"] != pool.positions)
    if wrong.size:
        raise ScoreBlockError(f"{where}: entry {wrong[0]} holds position {scores['pos'][wrong[0]]}, not "
                              f"{pool.positions[wrong[0]]} ({wrong.size} entries wrong): a short or garbled score block")
    nan = np.flatnonzero(np.isnan(scores["score"]))
    if nan.size:
        raise ScoreBlockError(f"{where}: {nan.size} NaN scores, the first at entry {nan[0]}: a garbled score block")
    if not top_k:
        if top.size:
            raise ScoreBlockError(f"{where}: a block top-k of shape {top.shape} where none was asked")
        return
    n_blocks = -(-n // block_tokens)
    if top.dtype != SCORE_ENTRY or top.shape != (n_blocks, top_k):
        raise ScoreBlockError(f"{where}: a block top-k of shape {top.shape}, not ({n_blocks}, {top_k})")
    sizes = np.minimum(block_tokens, n - np.arange(n_blocks) * block_tokens)
    filled = np.arange(top_k)[None, :] < np.minimum(top_k, sizes)[:, None]
    pad = top[~filled]
    if ((pad["pos"] != -1) | (pad["score"] != -np.inf)).any():
        raise ScoreBlockError(f"{where}: a block top-k is padded with something other than (-1, -inf)")
    entries, rows = top[filled], np.nonzero(filled)[0]
    positions = pool.positions
    if (np.diff(positions) == 1).all():  # a run of positions (HillInfer's pools): an entry's index is its offset
        idx = (entries["pos"].astype(np.int64) - int(positions[0])).clip(0, n - 1)
    else:
        order = np.argsort(positions, kind="stable")
        idx = order[np.searchsorted(positions[order], entries["pos"]).clip(0, n - 1)]
    own = (positions[idx] == entries["pos"]) & (idx // block_tokens == rows) & (scores["score"][idx] == entries["score"])
    if not own.all():
        raise ScoreBlockError(f"{where}: block {rows[np.argmin(own)]}'s top-k holds an entry that is not one of its "
                              "tokens with its score: a garbled top-k")
    per_row = np.full(filled.shape, -1, dtype=np.int64)
    per_row[filled] = idx
    per_row.sort(axis=1)
    repeats = (per_row[:, 1:] == per_row[:, :-1]) & (per_row[:, 1:] >= 0)
    if repeats.any():
        raise ScoreBlockError(f"{where}: block {int(np.argmax(repeats.any(axis=1)))}'s top-k repeats a token: "
                              "a garbled top-k")
    padded = np.full(n_blocks * block_tokens, -np.inf, dtype=np.float32)
    padded[:n] = scores["score"]
    padded = padded.reshape(n_blocks, block_tokens)
    chosen = np.where(filled, top["score"], np.inf)
    lowest = chosen.min(axis=1, keepdims=True)
    beaten = (padded > lowest).sum(axis=1) != (np.where(filled, top["score"], -np.inf) > lowest).sum(axis=1)
    if beaten.any():
        raise ScoreBlockError(f"{where}: block {int(np.argmax(beaten))}'s top-k leaves out a better token of the block: "
                              "not the block's top-k")


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
