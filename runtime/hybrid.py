"""Hybrid attention: sliding-window layers keep a ring of their window in memory, the policy gets the rest.

In Gemma 3 five of every six layers attend only to their last W tokens (Mistral's and Qwen2's ``sliding_window``
likewise): their KV is bounded, so it stays in memory, in a ring of W slots per sequence, and only the global
layers' KV, which grows with the context, goes to the KV policy (disk, selection, quantization).  The policy
sees a model of the global layers alone (``GlobalLayers``), numbered 0..n_global-1, and never learns the others
exist; ``HybridKV`` routes each layer's calls to the ring or to it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .dense_attention import DenseAttention
from .forward import decode_attention
from .kernels import Backend, resolve_backend
from .kv_policy import KVPolicy
from .memory import global_config
from .model import DecoderModel
from .transfer import to_device


def build_policy(spec, env, batch: int, cfg) -> KVPolicy:
    """``spec``'s policy for ``batch`` sequences: as is for a model without windows, else wrapped in ``HybridKV``
    (the policy built over the global layers only, none when every layer is windowed)."""
    model = env.model
    if not model.dims.hybrid:
        return spec.build(env, batch, cfg)
    view = GlobalLayers(model)
    inner_cfg = global_config(cfg, model.dims, torch.empty(0, dtype=model.dtype).element_size())
    inner = spec.build(dataclasses.replace(env, model=view), batch, inner_cfg) if view.dims.n_layers else None
    return HybridKV(model, inner, batch, cfg.max_context, env.backend)


class GlobalLayers:
    """A model as a hybrid model's KV policy sees it: its global layers only, renumbered from 0."""

    def __init__(self, model: DecoderModel):
        self.model = model
        self.layer_ids = model.dims.global_layers
        self.dims = model.dims.global_view()

    def __getattr__(self, name):  # dtype, device, scaling, synthetic: the model's own
        return getattr(self.model, name)

    def query(self, layer: int, x: torch.Tensor, rope) -> torch.Tensor:
        return self.model.query(self.layer_ids[layer], x, rope)


class WindowRing:
    """K and V of each windowed layer's last W tokens per sequence: token p sits in slot p % W, so a decode step
    writes one slot per row and attends to the filled ones (all W once p >= W - 1)."""

    def __init__(self, model: DecoderModel, batch: int, max_context: int, lengths: np.ndarray,
                 backend: Backend | None = None):
        """``backend``: what it attends on (runtime/kernels.py; None: the model device's)."""
        dims = model.dims
        self.model, self.lengths = model, lengths  # the policy's lengths (the positions of the step's tokens)
        self.sizes = {layer: min(dims.window(layer), max_context) for layer in range(dims.n_layers) if dims.window(layer)}
        self.kv = {layer: torch.zeros(2, batch, dims.n_kv_heads, size, dims.head_dim, dtype=model.dtype,
                                      device=model.device) for layer, size in self.sizes.items()}
        self._step: dict | None = None  # per step: the active rows, their positions, each ring size's slots and mask
        # on the native backend the filled slots [0, min(position + 1, W)) in one call (runtime/dense_attention.py)
        self.dense = DenseAttention.for_cache(backend or resolve_backend(model.device), model.dtype, dims.n_heads,
                                              dims.n_kv_heads, dims.head_dim, model.scaling)
        self._attention = self._torch_attention if self.dense is None else self._dense_attention
        self._starts = np.zeros(batch, dtype=np.int64)

    @property
    def resident_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv in self.kv.values())

    def store_prompt(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompt's last W tokens of k/v [H_kv, T, d], each in its slot."""
        n, size = k.shape[1], self.sizes[layer]
        first = max(0, n - size)
        slots = torch.arange(first, n, device=k.device) % size
        self.kv[layer][0, seq, :, slots] = k[:, first:]
        self.kv[layer][1, seq, :, slots] = v[:, first:]

    def begin_step(self, active: np.ndarray) -> None:
        self._step = {"rows": to_device(np.flatnonzero(active), self.model.device),
                      "positions": to_device(self.lengths.copy(), self.model.device)}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The current tokens join their rows' rings (active rows only: an idle row's window stays whole), then
        q [B, H, 1, d] attends to every filled slot."""
        size, ring, step = self.sizes[layer], self.kv[layer], self._step
        if size not in step:
            slots = step["positions"] % size
            mask = (torch.arange(size, device=q.device) <= step["positions"][:, None])[:, None, None, :]
            step[size] = (slots, mask, np.minimum(self.lengths + 1, size))
        slots, mask, stops = step[size]
        rows = step["rows"]
        ring[0, rows, :, slots[rows]] = k[rows, :, 0]
        ring[1, rows, :, slots[rows]] = v[rows, :, 0]
        return self._attention(q, ring, mask, stops)

    def _dense_attention(self, q: torch.Tensor, ring: torch.Tensor, mask: torch.Tensor, stops: np.ndarray
                         ) -> torch.Tensor:
        """The filled slots [0, stop) in one native call (the mask is torch's)."""
        return self.dense(q, ring[0], ring[1], self._starts, stops)

    def _torch_attention(self, q: torch.Tensor, ring: torch.Tensor, mask: torch.Tensor, stops: np.ndarray
                         ) -> torch.Tensor:
        return decode_attention(self.model, q, ring[0], ring[1], mask)

    def end_step(self) -> None:
        self._step = None


class HybridKV(KVPolicy):
    """A KV policy over the global layers beside a ``WindowRing`` for the windowed ones; lengths, reads, stalls
    and reuse are the policy's, resident bytes both."""

    def __init__(self, model: DecoderModel, inner: KVPolicy | None, batch: int, max_context: int,
                 backend: Backend | None = None):
        self.model, self.batch, self.max_context, self.inner = model, batch, max_context, inner
        self._own = KVPolicy(model, batch, max_context)  # lengths and counters when every layer is windowed
        self.ring = WindowRing(model, batch, max_context, self._counters.lengths, backend)
        self._global = {layer: i for i, layer in enumerate(model.dims.global_layers)}

    @property
    def _counters(self) -> KVPolicy:
        return self.inner if self.inner is not None else self._own

    lengths = property(lambda self: self._counters.lengths)
    bytes_read = property(lambda self: self._counters.bytes_read)
    io_stall_s = property(lambda self: self._counters.io_stall_s)
    io_read_s = property(lambda self: self._counters.io_read_s)
    select_s = property(lambda self: self._counters.select_s)
    prompt_queries = property(lambda self: self.inner.prompt_queries if self.inner is not None else 0)

    @property
    def resident_bytes(self) -> int:
        return (self.inner.resident_bytes if self.inner is not None else 0) + self.ring.resident_bytes

    def start_sequence(self, seq):
        self._counters.start_sequence(seq)

    def share_prefix(self, seq, owner, n_groups):
        if self.inner is not None:
            self.inner.share_prefix(seq, owner, n_groups)

    def observe_prompt(self, layer, seq, q):
        if layer in self._global:
            self.inner.observe_prompt(self._global[layer], seq, q)

    def store_prompt(self, layer, seq, k, v):
        if layer in self._global:
            self.inner.store_prompt(self._global[layer], seq, k, v)
        else:
            self.ring.store_prompt(layer, seq, k, v)

    def end_prompt(self, seq, n_tokens):
        self._counters.end_prompt(seq, n_tokens)

    def end_prefill(self):
        if self.inner is not None:
            self.inner.end_prefill()

    def prefetch(self, layer, x, rope, active):
        if layer == 0:  # the step's first call
            self.ring.begin_step(active)
        if layer in self._global:
            self.inner.prefetch(self._global[layer], x, rope, active)

    def attend(self, layer, q, k, v):
        if layer in self._global:
            return self.inner.attend(self._global[layer], q, k, v)
        out = self.ring.attend(layer, q, k, v)
        if self.inner is not None:
            self.inner.take_picks()  # the next global layer's picks, launched ahead (scored beside this attention)
        return out

    def end_step(self, active):
        self._counters.end_step(active)
        self.ring.end_step()

    def reuse_counts(self):
        return self._counters.reuse_counts()

    def stats(self, seq):
        stats = KVPolicy.stats(self, seq) if self.inner is None else self.inner.stats(seq)
        return stats | {"kv_resident_bytes": self.resident_bytes, "kv_window_bytes": self.ring.resident_bytes}

    def fitted_adapter(self):
        return self.inner.fitted_adapter() if self.inner is not None else (None, 0)

    def release_sequence(self, seq):
        if self.inner is not None:
            self.inner.release_sequence(seq)

    def close(self):
        if self.inner is not None:
            self.inner.close()
