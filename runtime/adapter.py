"""The low-rank K adapter: per layer A in R^{(H_kv*d) x r}, r = H_kv*d / sigma, from an SVD of keys.

The in-memory K cache is K_lr = flatten(K) A; a query head h scores tokens through
(q_h A_{g(h)}) K_lr^T (KVSwap Eq. 1).  A comes from the right singular vectors of the
*centred* post-RoPE keys: the key mean adds the same amount to every token's score, so
spending rank on it would not change any ranking.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from .forward import prefill
from .model import DecoderModel
from .store.files import write_atomic

log = logging.getLogger(__name__)
KEYS_PER_RANK = 4  # a projection fitted on fewer than 4 x rank keys is coarse: the engine does not keep it


class AdapterError(ValueError):
    """An adapter file does not match the model or is malformed."""


class LowRankAdapter:
    def __init__(self, matrices: list[torch.Tensor], n_kv_heads: int, head_dim: int):
        self.matrices = [m.float().contiguous() for m in matrices]
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.rank = self.matrices[0].shape[1]

    @property
    def sigma(self) -> float:
        return self.n_kv_heads * self.head_dim / self.rank

    @staticmethod
    def rank_for(n_kv_heads: int, head_dim: int, sigma: float) -> int:
        return max(1, round(n_kv_heads * head_dim / sigma))

    @classmethod
    def fit(cls, keys_per_layer: list[torch.Tensor], n_kv_heads: int, head_dim: int, rank: int) -> "LowRankAdapter":
        """keys_per_layer[l]: post-RoPE keys [N, H_kv*d] of layer l."""
        matrices = []
        for keys in keys_per_layer:
            keys = keys.float()
            if keys.shape[0] == 0:
                raise AdapterError("an adapter needs keys of at least one token per layer; give calibration text")
            centred = keys - keys.mean(dim=0, keepdim=True) if keys.shape[0] > 1 else keys
            _, _, vh = torch.linalg.svd(centred, full_matrices=False)
            top = vh[:rank].T
            if top.shape[1] < rank:
                top = torch.cat([top, top.new_zeros(top.shape[0], rank - top.shape[1])], dim=1)
            matrices.append(top)
        return cls(matrices, n_kv_heads, head_dim)

    @classmethod
    def fit_sigma(cls, keys_per_layer: list[torch.Tensor], n_kv_heads: int, head_dim: int, sigma: float) -> "LowRankAdapter":
        """``fit`` at the rank that compression ratio sigma gives."""
        return cls.fit(keys_per_layer, n_kv_heads, head_dim, cls.rank_for(n_kv_heads, head_dim, sigma))

    def save(self, path: str | Path) -> None:
        meta = {"n_kv_heads": str(self.n_kv_heads), "head_dim": str(self.head_dim), "sigma": json.dumps(self.sigma)}
        tensors = {f"layer.{i}": m.contiguous() for i, m in enumerate(self.matrices)}
        write_atomic(Path(path), save(tensors, metadata=meta))  # a killed deploy never leaves half an adapter

    @classmethod
    def load(cls, path: str | Path) -> "LowRankAdapter":
        path = Path(path)
        if not path.is_file():
            raise AdapterError(f"adapter file {path} does not exist; build one with edgekv.install (build_adapter)")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        try:
            matrices = [tensors[f"layer.{i}"] for i in range(len(tensors))]
            return cls(matrices, int(meta["n_kv_heads"]), int(meta["head_dim"]))
        except KeyError as exc:
            raise AdapterError(f"adapter file {path} is malformed (missing {exc}); rebuild it") from exc

    def check(self, n_layers: int, n_kv_heads: int, head_dim: int) -> None:
        if (len(self.matrices), self.n_kv_heads, self.head_dim) != (n_layers, n_kv_heads, head_dim):
            raise AdapterError(
                f"adapter is for {len(self.matrices)} layers x {self.n_kv_heads} KV heads x head_dim {self.head_dim}, "
                f"the model has {n_layers} x {n_kv_heads} x {head_dim}; build an adapter for this model"
            )


def collect_keys(model: DecoderModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Post-RoPE keys [N, H_kv*d] per global layer (the ones a policy predicts for) over the given prompts."""
    index = {layer: i for i, layer in enumerate(model.dims.global_layers)}
    keys: list[list[torch.Tensor]] = [[] for _ in index]

    def keep(layer, k, v):
        if layer in index:
            keys[index[layer]].append(k.transpose(0, 1).reshape(k.shape[1], -1).float().cpu())

    for ids in prompts:
        prefill(model, ids, keep)
    return [torch.cat(k) for k in keys]


def build_adapter(model, texts, sigma: float, tokenizer=None) -> LowRankAdapter:
    """Calibrate an adapter on ``texts`` (strings, with a tokenizer, or token-id lists).

    ``model`` is a DecoderModel or an Engine (its model and tokenizer are used).
    """
    tokenizer = tokenizer or getattr(model, "tokenizer", None)
    model = getattr(model, "model", model)
    prompts = []
    for text in texts:
        if isinstance(text, str):
            if tokenizer is None:
                raise AdapterError("calibration texts are strings but the model has no tokenizer; pass token-id lists")
            text = tokenizer(text)["input_ids"]
        prompts.append(list(text))
    return LowRankAdapter.fit_sigma(collect_keys(model, prompts), model.dims.n_kv_heads, model.dims.head_dim, sigma)


class AdapterSet:
    """The low-rank K adapters an engine's batches predict with: the file a config names (loaded once), else the
    one given or kept from an earlier batch when its rank matches the config's sigma, else none (the batch fits
    its own on its prompts' keys).  ``predicts``: the policy uses them at all."""

    def __init__(self, n_kv_heads: int, head_dim: int, predicts: bool, current: LowRankAdapter | None = None,
                 current_path: str | None = None):
        """``current_path``: the file ``current`` was loaded from (not read again)."""
        self.n_kv_heads, self.head_dim, self.predicts = n_kv_heads, head_dim, predicts
        self.current = current
        self._files: dict[str, LowRankAdapter] = {current_path: current} if current_path and current else {}

    def for_config(self, cfg) -> LowRankAdapter | None:
        if cfg.predictor.adapter_path and self.predicts:
            if cfg.predictor.adapter_path not in self._files:
                self._files[cfg.predictor.adapter_path] = LowRankAdapter.load(cfg.predictor.adapter_path)
            return self._files[cfg.predictor.adapter_path]
        if self.current is not None and self.current.rank == LowRankAdapter.rank_for(
                self.n_kv_heads, self.head_dim, cfg.sigma or self.current.sigma):
            return self.current
        return None

    def rank(self, cfg) -> int:
        adapter = self.for_config(cfg)
        return adapter.rank if adapter else LowRankAdapter.rank_for(self.n_kv_heads, self.head_dim, cfg.sigma)

    def keep_fitted(self, fitted: LowRankAdapter | None, n_keys: int, cfg) -> None:
        """A projection fitted on a batch's prompts is kept for later batches of the same rank when it saw
        enough keys (KEYS_PER_RANK x rank per layer); a coarser one serves this batch only, and says so."""
        if fitted is None or self.for_config(cfg) is not None:
            return
        if n_keys >= KEYS_PER_RANK * fitted.rank:
            self.current = fitted
            return
        log.warning("the low-rank K adapter (rank %d) of this batch was fitted on %d keys per layer, fewer than the %d "
                    "a stable fit needs: predictions are coarse, and the next batch fits its own; pass an adapter file "
                    "from the install step to avoid this", fitted.rank, n_keys, KEYS_PER_RANK * fitted.rank)
