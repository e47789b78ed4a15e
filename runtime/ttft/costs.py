"""Predicted costs of a chunk grid: compute_s[t, l] from the install step's fit, load_s[t, l] from bytes and a link rate.

A chunk (t, l) spans tokens [p, p + n) (``grid.span(t)``).  Its compute (see ``compute``):
  * l = 0: embedding + layer 0's q/k/v projections over n tokens;
  * l >= 1: layer l-1's attention (n queries over the s = p + n keys before the span's end),
    o-proj and MLP, then layer l's q/k/v projections: one whole layer's weights over n tokens.
Both are linear in a few features of (n, p) -- a per-call overhead, the tokens (every
projection and the MLP), the query-key pairs n * s (QK^T and PV; the runtime's masked SDPA
computes every pair before the span's end, masked or not) and the keys s (K/V read) -- so a
model is its coefficients, one set for layer 0 and one for the layers above it.
``ComputeCostModel`` holds fitted seconds per feature (``install.chunk_profile`` fits them
on timings of the runtime's own ``ChunkCompute``); ``RooflineCostModel`` holds FLOPs and
bytes per feature and the device's peak rates.  This module evaluates; it never measures.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from .grid import ChunkGrid

FEATURES_LAYER0 = ("call", "tokens")  # [1, n]
FEATURES_LAYER = ("call", "tokens", "pairs", "keys")  # [1, n, n * (p + n), p + n]


def layer0_features(n) -> np.ndarray:
    """[..., 2] features of layer-0 chunks of n tokens."""
    n = np.asarray(n, dtype=np.float64)
    return np.stack([np.ones_like(n), n], axis=-1)


def layer_features(n, p) -> np.ndarray:
    """[..., 4] features of layer >= 1 chunks of n tokens starting at position p."""
    n, p = np.broadcast_arrays(np.asarray(n, dtype=np.float64), np.asarray(p, dtype=np.float64))
    keys = p + n
    return np.stack([np.ones_like(n), n, n * keys, keys], axis=-1)


def chunk_lengths(grid: ChunkGrid) -> np.ndarray:
    """[T] tokens per token chunk (the last one may be partial)."""
    starts = np.arange(grid.n_chunks) * grid.chunk_tokens
    return np.minimum(starts + grid.chunk_tokens, grid.n_tokens) - starts


def _grid_features(grid: ChunkGrid) -> tuple[np.ndarray, np.ndarray]:
    n = chunk_lengths(grid)
    p = np.arange(grid.n_chunks) * grid.chunk_tokens
    return layer0_features(n), layer_features(n, p)


def _on_grid(grid: ChunkGrid, first: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """[T, L] from per-chunk seconds of layer 0 ([T]) and of every layer above it ([T])."""
    out = np.repeat(rest[:, None], grid.n_layers, axis=1)
    out[:, 0] = first
    return out


@dataclass(frozen=True)
class ComputeCostModel:
    """Seconds per feature: layer-0 chunks from ``coeffs_layer0`` (FEATURES_LAYER0), the others
    from ``coeffs_layer`` (FEATURES_LAYER)."""

    coeffs_layer0: tuple[float, ...]
    coeffs_layer: tuple[float, ...]
    kind: str = "fit"

    def __post_init__(self):
        if len(self.coeffs_layer0) != len(FEATURES_LAYER0) or len(self.coeffs_layer) != len(FEATURES_LAYER):
            raise ValueError(f"a compute cost model needs {len(FEATURES_LAYER0)} layer-0 and {len(FEATURES_LAYER)} "
                             f"layer coefficients, got {len(self.coeffs_layer0)} and {len(self.coeffs_layer)}")
        object.__setattr__(self, "coeffs_layer0", tuple(float(c) for c in self.coeffs_layer0))
        object.__setattr__(self, "coeffs_layer", tuple(float(c) for c in self.coeffs_layer))

    def chunk_s(self, n, p, layer0: bool = False) -> np.ndarray:
        """Seconds of chunks of n tokens starting at p (arrays broadcast)."""
        if layer0:
            return layer0_features(np.broadcast_arrays(n, p)[0]) @ np.asarray(self.coeffs_layer0)
        return layer_features(n, p) @ np.asarray(self.coeffs_layer)

    def compute_s(self, grid: ChunkGrid) -> np.ndarray:
        """[T, L] predicted seconds to compute each chunk."""
        f0, f = _grid_features(grid)
        return _on_grid(grid, f0 @ np.asarray(self.coeffs_layer0), f @ np.asarray(self.coeffs_layer))

    def scale(self, factor: float) -> "ComputeCostModel":
        """The same model with every cost times ``factor`` (measured / predicted, when compute runs slower)."""
        if not factor > 0:
            raise ValueError(f"scale factor must be positive, got {factor}")
        return replace(self, coeffs_layer0=tuple(c * factor for c in self.coeffs_layer0),
                       coeffs_layer=tuple(c * factor for c in self.coeffs_layer))

    def to_json(self) -> dict:
        return {"kind": self.kind, "features_layer0": list(FEATURES_LAYER0), "features_layer": list(FEATURES_LAYER),
                "coeffs_layer0": list(self.coeffs_layer0), "coeffs_layer": list(self.coeffs_layer)}

    @classmethod
    def from_json(cls, data: dict) -> "ComputeCostModel":
        _check_features(data)
        return cls(tuple(data["coeffs_layer0"]), tuple(data["coeffs_layer"]), data.get("kind", "fit"))


@dataclass(frozen=True)
class RooflineCostModel:
    """t = max(FLOPs / peak_flops, bytes / bandwidth) per chunk, FLOPs and bytes linear in the same features."""

    flops_layer0: tuple[float, ...]
    flops_layer: tuple[float, ...]
    bytes_layer0: tuple[float, ...]
    bytes_layer: tuple[float, ...]
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    kind: str = "roofline"

    @classmethod
    def from_dims(cls, *, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int,
                  layer_params: int, qkv_params: int, elem_bytes: int, peak_flops: float, bandwidth: float) -> "RooflineCostModel":
        """From the model's shapes.  ``layer_params``: weights of one decoder layer's matmuls (q, k, v, o,
        MLP); ``qkv_params``: those of q, k, v alone.  FLOPs: 2 per weight per token, 4 * heads * head_dim per
        query-key pair (QK^T and PV).  Bytes: weights read once per chunk, K and V of every key read once,
        and per token each activation written once and read once (hidden states, q, attention output, the
        MLP's gate/up/product, q/k/v out); norms, RoPE and softmax are left out."""
        e = float(elem_bytes)
        qkv_width = (n_heads + 2 * n_kv_heads) * head_dim
        act0 = 2 * e * (2 * hidden + qkv_width)  # embedding row, normed, q/k/v
        act = 2 * e * (6 * hidden + 2 * n_heads * head_dim + 3 * intermediate + qkv_width)  # x, o-proj, residual, norm, down, norm
        return cls(
            flops_layer0=(0.0, 2.0 * qkv_params),
            flops_layer=(0.0, 2.0 * layer_params, 4.0 * n_heads * head_dim, 0.0),
            bytes_layer0=(e * qkv_params, act0),
            bytes_layer=(e * layer_params, act, 0.0, 2.0 * n_kv_heads * head_dim * e),
            peak_flops=float(peak_flops), bandwidth=float(bandwidth),
        )

    def chunk_s(self, n, p, layer0: bool = False) -> np.ndarray:
        if layer0:
            f = layer0_features(np.broadcast_arrays(n, p)[0])
            return self._time(f, self.flops_layer0, self.bytes_layer0)
        return self._time(layer_features(n, p), self.flops_layer, self.bytes_layer)

    def compute_s(self, grid: ChunkGrid) -> np.ndarray:
        f0, f = _grid_features(grid)
        return _on_grid(grid, self._time(f0, self.flops_layer0, self.bytes_layer0),
                        self._time(f, self.flops_layer, self.bytes_layer))

    def _time(self, features: np.ndarray, flops, nbytes) -> np.ndarray:
        return np.maximum(features @ np.asarray(flops) / self.peak_flops, features @ np.asarray(nbytes) / self.bandwidth)

    def scale(self, factor: float) -> "RooflineCostModel":
        if not factor > 0:
            raise ValueError(f"scale factor must be positive, got {factor}")
        return replace(self, peak_flops=self.peak_flops / factor, bandwidth=self.bandwidth / factor)

    def to_json(self) -> dict:
        return {"features_layer0": list(FEATURES_LAYER0), "features_layer": list(FEATURES_LAYER),
                **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}}

    @classmethod
    def from_json(cls, data: dict) -> "RooflineCostModel":
        _check_features(data)
        return cls(*(tuple(data[k]) for k in ("flops_layer0", "flops_layer", "bytes_layer0", "bytes_layer")),
                   float(data["peak_flops"]), float(data["bandwidth"]), data.get("kind", "roofline"))


def cost_model_from_json(data: dict) -> ComputeCostModel | RooflineCostModel:
    """Either model, by its ``kind``."""
    return RooflineCostModel.from_json(data) if data.get("kind") == "roofline" else ComputeCostModel.from_json(data)


def _check_features(data: dict) -> None:
    for key, names in (("features_layer0", FEATURES_LAYER0), ("features_layer", FEATURES_LAYER)):
        if key in data and tuple(data[key]) != names:
            raise ValueError(f"cost model was fit on features {data[key]}, this runtime evaluates {list(names)}: "
                             "profile the chunks again")


def load_s(grid: ChunkGrid, bytes_per_chunk_layer, link_mib_s: float, latency_s: float = 0.0) -> np.ndarray:
    """[T, L] seconds to load each chunk: latency + bytes / rate.

    ``bytes_per_chunk_layer``: a scalar (every chunk the same), [T] per token chunk (a partial last
    chunk has fewer bytes) or [T, L]."""
    if not link_mib_s > 0:
        raise ValueError(f"link rate must be positive, got {link_mib_s} MiB/s")
    nbytes = np.asarray(bytes_per_chunk_layer, dtype=np.float64)
    if nbytes.ndim == 1:
        if nbytes.shape[0] != grid.n_chunks:
            raise ValueError(f"{nbytes.shape[0]} chunk sizes for a grid of {grid.n_chunks} token chunks")
        nbytes = nbytes[:, None]
    elif nbytes.ndim == 2 and nbytes.shape != grid.shape:
        raise ValueError(f"chunk sizes of shape {nbytes.shape} for a grid of shape {grid.shape}")
    elif nbytes.ndim > 2:
        raise ValueError(f"chunk sizes must be a scalar, [T] or [T, L], got shape {nbytes.shape}")
    return np.broadcast_to(latency_s + nbytes / (link_mib_s * 2**20), grid.shape).copy()
