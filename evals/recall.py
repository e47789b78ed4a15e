"""How well the low-rank predictor finds the groups the true attention needs, per rank.

For each instance and layer, the query of the first answer step (the queried key, fed
after the context) is scored against the context's keys twice: exactly (softmax per
head, summed over heads, max per group) and through a rank-r adapter (KVSwap Eq. 1).
``recall`` is the share of the true top-M groups that the predictor also picks;
``needle_hit``: over the layers whose true top-M holds the answer's needle group, the share
where the predicted top-M holds it too.
"""
from __future__ import annotations

import numpy as np
import torch

from edgekv.runtime.adapter import LowRankAdapter, collect_keys
from edgekv.runtime.forward import prompt_attention
from edgekv.runtime.model import DecoderModel

from .tasks import TaskInstance


@torch.inference_mode()
def _last_query_and_keys(model: DecoderModel, ids: list[int]):
    """Per global layer (the ones a policy selects in): post-RoPE q of the last token [H, d] and keys
    [H_kv, T, d] (one causal pass)."""
    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    rope = model.rope(positions)
    x = model.embed(tokens)
    out = []
    for layer in range(model.dims.n_layers):
        q, k, v = model.qkv(layer, x, rope)
        if not model.dims.window(layer):
            out.append((q[0, :, -1].float(), k[0].float()))
        x = model.finish_layer(layer, x, prompt_attention(model, layer, q, k, v))
    return out


def _group_top(token_scores: torch.Tensor, G: int, picked_groups: int) -> set[int]:
    n = token_scores.shape[0] // G
    groups = token_scores[: n * G].view(n, G).amax(dim=-1)
    return set(groups.topk(min(picked_groups, n)).indices.tolist())


def selection_recall(model: DecoderModel, instances: list[TaskInstance], sigmas: list[float], G: int,
                     picked_groups: int, calibration: list[list[int]]) -> list[dict]:
    """Recall and needle hit rate of the rank-r predictor for each sigma (adapters fitted on ``calibration``)."""
    dims = model.dims
    keys = collect_keys(model, calibration)
    adapters = {s: LowRankAdapter.fit_sigma(keys, dims.n_kv_heads, dims.head_dim, s) for s in sigmas}
    tallies = {s: {"recall": [], "needle_hit": []} for s in sigmas}
    for inst in instances:
        ids = inst.context + inst.forced[:2]  # up to the first queried key
        n_ctx = len(inst.context)
        needle_start, needle_len = inst.needles[0]
        needle_groups = {(needle_start + j) // G for j in range(needle_len)}
        for layer, (q, k) in enumerate(_last_query_and_keys(model, ids)):
            k = k[:, :n_ctx]
            n_rep = dims.n_heads // dims.n_kv_heads
            exact = torch.einsum("hd,htd->ht", q, k.repeat_interleave(n_rep, dim=0)) * model.scaling
            truth = _group_top(exact.softmax(dim=-1).sum(dim=0), G, picked_groups)
            flat = k.transpose(0, 1).reshape(n_ctx, -1)
            q_sum = q.view(dims.n_kv_heads, n_rep, -1).sum(dim=1).reshape(-1)
            for sigma, adapter in adapters.items():
                a = adapter.matrices[layer]
                predicted = _group_top((flat @ a) @ (q_sum @ a), G, picked_groups)
                tallies[sigma]["recall"].append(len(truth & predicted) / max(1, len(truth)))
                if needle_groups & truth:
                    tallies[sigma]["needle_hit"].append(bool(needle_groups & predicted))
    return [
        {"sigma": s, "rank": adapters[s].rank, "recall": float(np.mean(t["recall"])),
         "needle_hit": float(np.mean(t["needle_hit"])) if t["needle_hit"] else float("nan")}
        for s, t in tallies.items()
    ]
