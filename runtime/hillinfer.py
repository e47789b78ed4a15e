"""HillInfer's hierarchical importance evaluation as a token-level selector (G = 1).

Per layer and sequence every key is in the storage pool (a file of fp16 keys in position order,
what the SmartSSD holds); the CPU pool keeps in host memory the keys of the most recent
alpha*N tokens and of the tokens selected most often (the hit table).  Each step:
- the in-storage scorer scores the storage-only tokens (the prefix before the recent window) on
  an I/O thread, emitting score blocks and per-block top-k, while the CPU scores its pool;
- the two are merged and the top alpha*N tokens selected; only their KV is fetched;
- hits are counted; storage tokens among the top-alpha hit tokens are promoted into the CPU
  pool and the same number of the lowest-hit non-recent CPU tokens demoted (bidirectional pools).
With alpha = 1 every token is selected and decoding equals full attention.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .scoring import InStorageScorer, KeyPool
from .selector import Selector


class HierarchicalSelector(Selector):
    def __init__(self, scorer: InStorageScorer, pool_dir: Path, n_layers: int, batch: int, max_context: int,
                 n_kv_heads: int, head_dim: int, alpha: float, beta: float, scaling: float, block_tokens: int = 1024):
        self.scorer = scorer
        self.pool_dir = Path(pool_dir)
        self.alpha, self.scaling, self.block_tokens = alpha, scaling, block_tokens
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.M = max(1, math.ceil(alpha * max_context))
        # CPU pool capacity M_c = beta / (1 + beta) of the context (HillInfer Eq. 1: M_c / M_s ~ f_c / f_s)
        self.cpu_capacity = max(1, math.ceil(beta / (1 + beta) * max_context))
        self.cpu_keys = torch.zeros(n_layers, batch, max_context, n_kv_heads, head_dim, dtype=torch.float16)
        self.in_cpu = np.zeros((n_layers, batch, max_context), dtype=bool)
        self.hits = np.zeros((n_layers, batch, max_context), dtype=np.int64)
        self.n_tokens = np.zeros((n_layers, batch), dtype=np.int64)
        self.resident_bytes = self.cpu_capacity * n_layers * batch * n_kv_heads * head_dim * 2
        self.bytes_to_host = 0
        self._storage = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ekv-instorage")

    def _pool_path(self, layer: int, seq: int) -> Path:
        return self.pool_dir / f"keys-s{seq}-l{layer}.f16"

    def append(self, layer, seq, first_token, k):
        n = k.shape[1]
        if n == 0:
            return
        rows = k.transpose(0, 1).to(torch.float16).contiguous()  # [T, H_kv, d]
        with open(self._pool_path(layer, seq), "r+b" if first_token else "wb") as f:
            f.seek(first_token * self.n_kv_heads * self.head_dim * 2)
            f.write(rows.numpy().tobytes())
        end = first_token + n
        self.n_tokens[layer, seq] = end
        self.cpu_keys[layer, seq, first_token:end] = rows
        self.in_cpu[layer, seq, first_token:end] = True
        self._trim(layer, seq)

    def _recent(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.alpha * n)))

    def _trim(self, layer: int, seq: int) -> None:
        """Keep the CPU pool within capacity: demote the lowest-hit tokens outside the recent window."""
        n = int(self.n_tokens[layer, seq])
        cpu = np.flatnonzero(self.in_cpu[layer, seq, :n])
        excess = len(cpu) - self.cpu_capacity
        if excess > 0:
            old = cpu[cpu < n - self._recent(n)]
            victims = old[np.argsort(self.hits[layer, seq, old], kind="stable")[:excess]]
            self.in_cpu[layer, seq, victims] = False

    def select(self, layer, q, n_groups):
        batch = q.shape[0]
        query = q.reshape(batch, self.n_kv_heads, -1, self.head_dim).sum(dim=2).float().cpu().numpy()  # heads summed
        groups = np.zeros((batch, self.M), dtype=np.int64)
        valid = np.zeros((batch, self.M), dtype=bool)
        for seq in range(batch):
            n = int(n_groups[seq])
            if n == 0:
                continue
            storage_n = n - self._recent(n)
            k_sel = min(self.M, max(1, math.ceil(self.alpha * n)))
            future = None
            if storage_n > 0:  # in-storage scoring of the prefix, in parallel with the CPU pool
                pool = KeyPool(self._pool_path(layer, seq), np.arange(storage_n, dtype=np.int32), self.n_kv_heads, self.head_dim)
                future = self._storage.submit(self.scorer.score, pool, query[seq], self.scaling, self.block_tokens,
                                              min(k_sel, 256))
            cpu_pos = np.flatnonzero(self.in_cpu[layer, seq, :n])
            keys = self.cpu_keys[layer, seq, cpu_pos].float()
            cpu_scores = torch.einsum("nhd,hd->n", keys, torch.from_numpy(query[seq])).numpy() * self.scaling
            pos, score = [cpu_pos], [cpu_scores]
            if future is not None:
                result = future.result()
                self.bytes_to_host += result.block_topk.nbytes
                best = result.block_topk.reshape(-1) if result.block_topk.size else result.scores
                best = best[(best["pos"] >= 0) & ~self.in_cpu[layer, seq, np.maximum(best["pos"], 0)]]
                pos.append(best["pos"].astype(np.int64))
                score.append(best["score"])
            pos, score = np.concatenate(pos), np.concatenate(score)
            top = pos[np.argsort(-score, kind="stable")[:k_sel]]
            groups[seq, : len(top)] = top
            valid[seq, : len(top)] = True
            self._update_pools(layer, seq, n, top)
        return torch.from_numpy(groups), torch.from_numpy(valid)

    def _update_pools(self, layer: int, seq: int, n: int, selected: np.ndarray) -> None:
        """Hit table; promote storage tokens among the top-alpha hit tokens, demote as many (equal numbers)."""
        hits = self.hits[layer, seq]
        hits[selected] += 1
        hot = np.argsort(-hits[:n], kind="stable")[: max(1, math.ceil(self.alpha * n))]
        promote = hot[~self.in_cpu[layer, seq, hot] & (hits[hot] > 0)]
        if len(promote):
            keys = np.memmap(self._pool_path(layer, seq), dtype=np.float16, mode="r").reshape(-1, self.n_kv_heads, self.head_dim)
            self.cpu_keys[layer, seq, promote] = torch.from_numpy(np.ascontiguousarray(keys[promote]))
            self.in_cpu[layer, seq, promote] = True
            self._trim(layer, seq)

    def release(self, seq: int) -> None:
        for layer in range(self.in_cpu.shape[0]):
            self._pool_path(layer, seq).unlink(missing_ok=True)

    def close(self) -> None:
        self._storage.shutdown(wait=True)
