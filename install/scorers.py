"""Scoring throughputs for HillInfer's pool split: beta ~ f_cpu / f_ssd with M_cpu < M_0 (Eq. 1).

f_cpu: the CPU pool's scorer (keys in host memory, the selector's own einsum); f_ssd: the
in-storage scorer on a pool file (the FPGA on the card, else its g++ C-simulation, whose rate is
the host's and is labelled emulated).  Both in tokens per second over the same keys and query.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from edgekv.runtime.scoring import InStorageScorer, KeyPool, write_pool


def _rate(fn, tokens: int, repeats: int = 3) -> float:
    fn()
    best = min(_timed(fn) for _ in range(repeats))
    return tokens / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def scoring_throughputs(storage: InStorageScorer, n_kv_heads: int, head_dim: int, tokens: int = 32768,
                        work: Path | None = None) -> dict:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((tokens, n_kv_heads, head_dim)).astype(np.float16)
    q = rng.standard_normal((n_kv_heads, head_dim)).astype(np.float32)
    host = torch.from_numpy(keys)
    f_cpu = _rate(lambda: torch.einsum("nhd,hd->n", host.float(), torch.from_numpy(q)), tokens)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        path = Path(tmp) / "pool.f16"
        write_pool(path, keys)
        pool = KeyPool(path, np.arange(tokens, dtype=np.int32), n_kv_heads, head_dim)
        f_ssd = _rate(lambda: storage.score(pool, q, 1.0, 1024, 64), tokens)
    return {"f_cpu_tok_s": f_cpu, "f_ssd_tok_s": f_ssd, "scorer_backend": storage.backend_label,
            "emulated": storage.emulated, "tokens": tokens}


def pool_ratio(f_cpu: float, f_ssd: float, cpu_budget_bytes: float, key_bytes_all_tokens: float) -> float:
    """beta = f_cpu / f_ssd, capped so the CPU pool (beta / (1 + beta) of the keys) stays under M_0."""
    share_cap = min(0.999, cpu_budget_bytes / key_bytes_all_tokens)
    return min(f_cpu / f_ssd, share_cap / (1 - share_cap))
