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


def attention(model: DecoderModel, q, k, v, mask=None, causal=False) -> torch.Tensor:
    """SDPA with GQA; q [B, H, T, d], k/v [B, H_kv, S, d]."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=model.scaling, enable_gqa=True
    )


@torch.inference_mode()
def prefill(model: DecoderModel, token_ids: list[int], on_kv: KVCallback) -> torch.Tensor:
    """Run one prompt; on_kv(layer, k, v) receives post-RoPE k and v [H_kv, T, d]. Returns last-token logits [V]."""
    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    positions = torch.arange(len(token_ids), device=model.device)[None]
    cos, sin = model.rope(positions)
    x = model.embed(ids)
    for layer in range(model.dims.n_layers):
        q, k, v = model.qkv(layer, x, cos, sin)
        on_kv(layer, k[0], v[0])
        x = model.finish_layer(layer, x, attention(model, q, k, v, causal=True))
    return model.logits(x[:, -1])[0]
