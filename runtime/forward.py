"""Prefill: one prompt through the model layer by layer, handing each layer's K/V to a callback.

Shared by the engine (which stores the KV where its policy says) and by adapter
calibration (which only collects keys).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .model import DecoderModel

KVCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
QueryCallback = Callable[[int, torch.Tensor], None]


WINDOW_QUERY_BLOCK = 1024  # queries per block of a sliding-window prefill: its mask is block x (block + W)


def attention(model: DecoderModel, q, k, v, mask=None, causal=False) -> torch.Tensor:
    """SDPA with GQA; q [B, H, T, d], k/v [B, H_kv, S, d]."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=model.scaling, enable_gqa=True
    )


def prompt_attention(model: DecoderModel, layer: int, q, k, v) -> torch.Tensor:
    """Causal attention of a whole prompt (q, k, v over the same T tokens) at ``layer``: a sliding-window layer's
    query at position p sees keys p-W+1..p, computed in query blocks over only the keys they can see (a
    [T, T] mask at 32K tokens would take 1 GiB)."""
    window = model.dims.window(layer)
    n = q.shape[2]
    if not window or window >= n:
        return attention(model, q, k, v, causal=True)
    out = torch.empty_like(q)
    for start in range(0, n, WINDOW_QUERY_BLOCK):
        stop = min(start + WINDOW_QUERY_BLOCK, n)
        first = max(0, start - window + 1)
        out[:, :, start:stop] = attention(model, q[:, :, start:stop], k[:, :, first:stop], v[:, :, first:stop],
                                          mask=visible(start, stop, first, window, q.device)[None, None])
    return out


def visible(start: int, stop: int, first: int, window: int, device) -> torch.Tensor:
    """[stop - start, stop - first] bool: query positions [start, stop) see key positions [first, stop) causally,
    within ``window`` tokens when it is > 0."""
    q_pos = torch.arange(start, stop, device=device)[:, None]
    k_pos = torch.arange(first, stop, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window else mask


def decode_attention(model: DecoderModel, q, k, v, mask) -> torch.Tensor:
    """One query token per sequence: q [B, H, 1, d], k/v [B, H_kv, S, d], mask [B, 1, 1, S] (True = attend).

    On CPU, two grouped matmuls read K and V once each (memory-bound, ~1.6x faster than
    SDPA's GQA path at 16K); on CUDA, SDPA's fused kernels (``grouped_sdpa``).
    """
    if q.device.type == "cuda":
        return grouped_sdpa(model, q, k, v, mask)
    b, h, _, d = q.shape
    weights = _grouped_scores(model, q, k, mask).softmax(dim=-1).to(v.dtype)
    return (weights @ v).view(b, h, 1, d)


def _grouped_scores(model: DecoderModel, q, k, mask) -> torch.Tensor:
    """Scaled scores [B, H_kv, H / H_kv, S] in float32, -inf where ``mask`` is False: each KV head's query heads are
    columns of one grouped matmul, so K is read once and never repeated per query head. K [S, d] times the queries
    [d, g] reads K in its own row order: SmolLM2 at 8K on the CPU, 30 layers' scores 7.4 ms against 10.1 ms for
    the queries times K transposed."""
    b, h, _, d = q.shape
    n_kv = k.shape[1]
    scores = (k @ q.view(b, n_kv, h // n_kv, d).transpose(-1, -2)).transpose(-1, -2) * model.scaling
    return scores.float().masked_fill(~mask, float("-inf"))


def decode_attention_part(model: DecoderModel, q, k, v, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over part of a step's keys: (out [B, H, 1, d] float32, log-sum-exp of its scores [B, H, 1, 1]),
    so parts attended apart merge into the whole (``merge_attention``); a row with no key to attend gives out 0 and
    log-sum-exp -inf (it weighs nothing in the merge)."""
    b, h, _, d = q.shape
    scores = _grouped_scores(model, q, k, mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = (scores - lse).exp_().nan_to_num_(0.0)  # a row of -inf only: (-inf) - (-inf) is NaN, its weights 0
    return (weights.to(v.dtype) @ v).float().view(b, h, 1, d), lse.view(b, h, 1, 1)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Attention over the union of the parts' keys from each part's (out, log-sum-exp): each weighed by its share of
    the softmax mass."""
    lse = torch.stack([p_lse for _, p_lse in parts]).logsumexp(dim=0)
    return sum(out * (p_lse - lse).exp() for out, p_lse in parts).to(dtype)


def grouped_sdpa(model: DecoderModel, q, k, v, mask) -> torch.Tensor:
    """Decode attention as SDPA over the KV heads, each query head of a group a row of its KV head's queries:
    equal head counts and a broadcast mask are what the memory-efficient kernel takes, so K and V are never
    repeated per query head (``enable_gqa`` with a mask falls back to the math kernel, which repeats them)."""
    b, h, _, d = q.shape
    n_kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(b, n_kv, h // n_kv, d), k, v, attn_mask=mask, scale=model.scaling)
    return out.reshape(b, h, 1, d)  # the fused kernels may return it in [B, g, H_kv, d] memory order


@torch.inference_mode()
def prefill(model: DecoderModel, token_ids: list[int], on_kv: KVCallback, on_queries: QueryCallback | None = None
            ) -> torch.Tensor:
    """Run one prompt; on_kv(layer, k, v) receives post-RoPE k and v [H_kv, T, d], after on_queries(layer, q)
    (if given) the layer's post-RoPE queries [H, T, d] (a policy scoring tokens by attention). Returns last-token logits [V]."""
    return model.logits(_through_layers(model, token_ids, on_kv, on_queries)[:, -1])[0]


@torch.inference_mode()
def teacher_forced_logits(model: DecoderModel, token_ids: list[int]) -> torch.Tensor:
    """Every position's logits [T, V] for ``token_ids``, through the calls a prefill and a decode step make (the
    layer plans' fused norms and packed projections), not the Hugging Face modules': a weight format's measured
    loss is the one the runtime decodes with."""
    return model.logits(_through_layers(model, token_ids, lambda *_: None, None))[0]


def _through_layers(model: DecoderModel, token_ids: list[int], on_kv: KVCallback, on_queries: QueryCallback | None
                    ) -> torch.Tensor:
    """The hidden states [1, T, hidden] after the last layer (before the final norm)."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    positions = torch.arange(len(token_ids), device=model.device)[None]
    rope = model.rope(positions)
    x = model.embed(ids)
    for layer in range(model.dims.n_layers):
        q, k, v = model.qkv(layer, x, rope)
        if on_queries is not None:
            on_queries(layer, q[0])
        on_kv(layer, k[0], v[0])
        x = model.finish_layer(layer, x, prompt_attention(model, layer, q, k, v))
    return x
