"""Which model and dtype produced a KV: stored KV is only ever reused by the same weights in the same dtype."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..weights import linear_weight

# config keys that name where or how a checkpoint was loaded, not what it computes
_VOLATILE_KEYS = {"name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
                  "output_attentions", "output_hidden_states"}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def model_fingerprint(model) -> dict:
    """{"id", "name", "model_type", "n_layers", "n_kv_heads", "head_dim", "dtype"} of a DecoderModel.

    id = sha256(canonical config json, dtype, a few weight slices): the config alone would not
    tell a fine-tune from its base, the slices (embedding rows, final norm, first rows of the
    first and last layers' k/v projections) do, at the cost of a few KiB of hashing.
    """
    cfg = model.hf.config
    stable = {k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE_KEYS and not k.startswith("_")}
    dtype = str(model.dtype).removeprefix("torch.")
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode())
    digest.update(dtype.encode())
    if model.weights != "native":  # other weights, other K/V: the stored KV of one is not the other's
        digest.update(model.weights.encode())
    slices = [model.embed.weight[:4], model.norm.weight]
    for layer in (model.layers[0], model.layers[-1]):
        slices += [linear_weight(layer.self_attn.k_proj)[:4], linear_weight(layer.self_attn.v_proj)[:4]]
    for t in slices:
        digest.update(_tensor_bytes(t))
    d = model.dims
    return {"id": digest.hexdigest(), "name": Path(str(getattr(cfg, "_name_or_path", "") or "")).name or cfg.model_type,
            "model_type": cfg.model_type, "n_layers": d.n_layers, "n_kv_heads": d.n_kv_heads,
            "head_dim": d.head_dim, "dtype": dtype, **({"weights": model.weights} if model.weights != "native" else {})}


def describe(fp: dict) -> str:
    """One line naming a fingerprint for messages."""
    return (f"{fp.get('name', '?')} ({fp.get('model_type', '?')}, {fp.get('n_layers', '?')} layers, "
            f"{fp.get('dtype', '?')}, fingerprint {str(fp.get('id', '?'))[:12]})")
