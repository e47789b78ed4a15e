"""HillInfer's hierarchical importance evaluation as a token-level selector (G = 1).

Per layer and sequence every key is in the storage pool (a file of fp16 keys in position order,
what the SmartSSD holds); the CPU pool keeps in host memory the keys of the most recent
importance_rate x N tokens and of the tokens selected most often (the hit table).  Each step:
- the in-storage scorer scores the prefix up to the last token the CPU pool lacks (the recent
  window can outgrow the pool) on an I/O thread, emitting score blocks and per-block top-k,
  while the CPU scores its pool;
- the two are merged, storage scores kept only for tokens outside the CPU pool (each token is
  scored by exactly one pool), and the top importance_rate x N tokens selected; only their KV is fetched;
- hits are counted; storage tokens among the most-hit tokens are promoted into the CPU
  pool and the same number of the lowest-hit non-recent CPU tokens demoted (bidirectional pools).
With importance_rate = 1 every token is selected and decoding equals full attention.

When the in-storage scorer fails (the card's run errors or throws, a buffer sync fails, the csim
returns an error code, or its score blocks fail ``check_result``: short or garbled), its scores
are never used: that call and the rest of the batch are scored on the CPU by the numpy reference
(the same selection, at host speed and host byte counts), with one warning naming the failure;
the next batch tries the card again.  The request fails, with a ScoringError naming both causes,
only when the CPU cannot score the pool either (the pool file is gone or short).  A scorer that
refuses the shape (ValueError: past the kernel's bounds) fails the request: that is configuration.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .config import HillInferConfig, cpu_pool_tokens
from .model import ModelDims
from .scoring import InStorageScorer, KeyPool, NumpyScorer, ScoreBlockError, ScoreResult, check_result
from .selector import Selector

log = logging.getLogger(__name__)


class ScoringError(OSError):
    """Neither the in-storage scorer nor the CPU fallback could score a pool: the request cannot go on."""


def _text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


class HierarchicalSelector(Selector):
    @staticmethod
    def index_bytes(n_layers: int, max_context: int) -> int:
        """Per sequence: the CPU pool's row of each token and its hit count (int64 each), and its token count."""
        return n_layers * (max_context * 2 * 8 + 8)

    def __init__(self, scorer: InStorageScorer, pool_dir: Path, dims: ModelDims, batch: int, max_context: int,
                 hillinfer: HillInferConfig, scaling: float):
        """``hillinfer``: the config section it reads (importance_rate, beta, score_block_tokens)."""
        n_layers, n_kv_heads, head_dim = dims.n_layers, dims.n_kv_heads, dims.head_dim
        self.scorer = scorer
        self.pool_dir = Path(pool_dir)
        self.importance_rate, self.scaling = hillinfer.importance_rate, scaling
        self.block_tokens = hillinfer.score_block_tokens
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.max_selected_tokens = max(1, math.ceil(self.importance_rate * max_context))
        self.cpu_capacity = cpu_pool_tokens(hillinfer.beta, max_context)
        # the CPU pool: fp16 keys in `cpu_capacity` rows per (layer, sequence); row_of maps a position to its row
        self.cpu_keys = torch.zeros(n_layers, batch, self.cpu_capacity, n_kv_heads, head_dim, dtype=torch.float16)
        self.row_of = np.full((n_layers, batch, max_context), -1, dtype=np.int64)
        self.hits = np.zeros((n_layers, batch, max_context), dtype=np.int64)
        self.n_tokens = np.zeros((n_layers, batch), dtype=np.int64)
        self.resident_bytes = self.cpu_keys.numel() * self.cpu_keys.element_size() + self.index_bytes(n_layers, max_context) * batch
        self.bytes_to_host = 0
        self.fallback: str | None = None  # why this batch scores on the CPU instead of the in-storage scorer
        self._cpu = scorer if isinstance(scorer, NumpyScorer) else NumpyScorer()
        self._storage = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ekv-instorage")

    @property
    def in_cpu(self) -> np.ndarray:
        return self.row_of >= 0

    def _pool_path(self, layer: int, seq: int) -> Path:
        return self.pool_dir / f"keys-s{seq}-l{layer}.f16"

    def append(self, layer, seq, first_token, k):
        n = k.shape[1]
        if n == 0:
            return
        rows = k.transpose(0, 1).to("cpu", torch.float16).contiguous()  # [T, H_kv, d]: the pools live on the host
        with open(self._pool_path(layer, seq), "r+b" if first_token else "wb") as f:
            f.seek(first_token * self.n_kv_heads * self.head_dim * 2)
            f.write(rows.numpy().tobytes())
        self.n_tokens[layer, seq] = first_token + n
        self._admit(layer, seq, np.arange(first_token, first_token + n), rows)

    def _recent(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.importance_rate * n)))

    def _admit(self, layer: int, seq: int, positions: np.ndarray, keys: torch.Tensor) -> None:
        """Put ``positions`` into the CPU pool, demoting the lowest-hit tokens outside the recent window for room;
        when there is not room for all, the latest positions win."""
        row_of = self.row_of[layer, seq]
        n = int(self.n_tokens[layer, seq])
        taken = np.flatnonzero(row_of[:n] >= 0)
        shortage = len(taken) + len(positions) - self.cpu_capacity
        if shortage > 0:
            old = taken[(taken < n - self._recent(n)) & ~np.isin(taken, positions)]
            victims = old[np.argsort(self.hits[layer, seq, old], kind="stable")[:shortage]]
            row_of[victims] = -1
        used = np.zeros(self.cpu_capacity, dtype=bool)
        used[row_of[:n][row_of[:n] >= 0]] = True
        free = np.flatnonzero(~used)
        keep = slice(max(0, len(positions) - len(free)), None)
        positions, keys = positions[keep], keys[keep]
        rows = free[: len(positions)]
        row_of[positions] = rows
        self.cpu_keys[layer, seq, rows] = keys

    def select(self, layer, q, n_groups, first=0):  # no sinks: the config gives hillinfer none
        batch = q.shape[0]
        query = q.reshape(batch, self.n_kv_heads, -1, self.head_dim).sum(dim=2).float().cpu().numpy()  # heads summed
        groups = np.zeros((batch, self.max_selected_tokens), dtype=np.int64)
        valid = np.zeros((batch, self.max_selected_tokens), dtype=bool)
        for seq in range(batch):
            n = int(n_groups[seq])
            if n == 0:
                continue
            # storage scores the prefix up to the last token the CPU pool lacks: the prefix before the recent window,
            # or more when the recent window (importance_rate x n) outgrows the pool and some recent tokens live in storage only
            outside = np.flatnonzero(self.row_of[layer, seq, :n] < 0)
            storage_n = int(outside[-1]) + 1 if len(outside) else 0
            k_sel = min(self.max_selected_tokens, max(1, math.ceil(self.importance_rate * n)))
            # each block's top-k_sel holds every storage token of the global top-k_sel; past the backend's top-k bound
            # a block's top-k could drop some, so its full score block is merged instead (k = 0)
            block_k = k_sel if k_sel <= self.scorer.max_top_k else 0
            future = scorer = pool = None
            if storage_n > 0:  # in-storage scoring of the prefix, in parallel with the CPU pool
                pool = KeyPool(self._pool_path(layer, seq), np.arange(storage_n, dtype=np.int32), self.n_kv_heads, self.head_dim)
                scorer = self._cpu if self.fallback else self.scorer
                future = self._storage.submit(scorer.score, pool, query[seq], self.scaling, self.block_tokens, block_k)
            cpu_pos = np.flatnonzero(self.row_of[layer, seq, :n] >= 0)
            keys = self.cpu_keys[layer, seq, self.row_of[layer, seq, cpu_pos]].float()
            cpu_scores = torch.einsum("nhd,hd->n", keys, torch.from_numpy(query[seq])).numpy() * self.scaling
            pos, score = [cpu_pos], [cpu_scores]
            if future is not None:
                result = self._storage_result(future, scorer, pool, query[seq], block_k, layer, seq)
                self.bytes_to_host += result.bytes_to_host
                best = result.block_topk.reshape(-1) if result.block_topk.size else result.scores
                best = best[(best["pos"] >= 0) & (self.row_of[layer, seq, np.maximum(best["pos"], 0)] < 0)]
                pos.append(best["pos"].astype(np.int64))
                score.append(best["score"])
            pos, score = np.concatenate(pos), np.concatenate(score)
            top = pos[np.argsort(-score, kind="stable")[:k_sel]]
            groups[seq, : len(top)] = top
            valid[seq, : len(top)] = True
            self._update_pools(layer, seq, n, top)
        return torch.from_numpy(groups), torch.from_numpy(valid)

    def _storage_result(self, future, scorer: InStorageScorer, pool: KeyPool, query: np.ndarray, block_k: int,
                        layer: int, seq: int) -> ScoreResult:
        """The scorer's checked result; on its failure the CPU's, for this call and the rest of the batch."""
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - whatever the card or csim raised, its scores are not used
            if self.scorer is self._cpu or (scorer is self.scorer and isinstance(exc, ValueError)):
                raise  # the reference's own error, or a shape the backend refuses (configuration)
            if scorer is self._cpu:
                raise self._unscorable(pool, layer, seq, exc) from exc
            failure = exc
        else:
            if scorer is self._cpu:
                return result
            try:
                check_result(result, pool, self.block_tokens, block_k)
                return result
            except ScoreBlockError as exc:
                failure = exc
        self.fallback = f"{self.scorer.backend_label} failed on layer {layer}, sequence {seq} ({_text(failure)})"
        log.warning("HillInfer: the in-storage scorer %s; its scores are discarded and this batch is scored on the CPU "
                    "(the numpy reference: the same selection, at host speed); the next batch tries it again. "
                    "Check the card (xbutil examine, dmesg) or the csim build", self.fallback)
        try:
            return self._cpu.score(pool, query, self.scaling, self.block_tokens, block_k)
        except Exception as exc:  # noqa: BLE001 - the pool itself is unreadable: the request cannot go on
            raise self._unscorable(pool, layer, seq, exc) from exc

    def _unscorable(self, pool: KeyPool, layer: int, seq: int, exc: Exception) -> ScoringError:
        return ScoringError(f"HillInfer cannot score layer {layer} of sequence {seq} on the CPU either ({_text(exc)}), "
                            f"where it went because the in-storage scorer {self.fallback}: the key pool {pool.path} "
                            "is missing or short, so the request is abandoned; check the KV disk and run it again")

    def _update_pools(self, layer: int, seq: int, n: int, selected: np.ndarray) -> None:
        """Hit table; storage tokens among the most-hit tokens are promoted, as many others demoted."""
        hits = self.hits[layer, seq]
        hits[selected] += 1
        hot = np.argsort(-hits[:n], kind="stable")[: max(1, math.ceil(self.importance_rate * n))]
        promote = hot[(self.row_of[layer, seq, hot] < 0) & (hits[hot] > 0)]
        if len(promote):
            keys = np.memmap(self._pool_path(layer, seq), dtype=np.float16, mode="r").reshape(-1, self.n_kv_heads, self.head_dim)
            self._admit(layer, seq, np.sort(promote), torch.from_numpy(np.ascontiguousarray(keys[np.sort(promote)])))

    def stats(self) -> dict:
        return {"scorer_fallback": self.fallback}  # on the CPU: why

    def release(self, seq: int) -> None:
        for layer in range(self.row_of.shape[0]):
            self._pool_path(layer, seq).unlink(missing_ok=True)

    def close(self) -> None:
        self._storage.shutdown(wait=True)
