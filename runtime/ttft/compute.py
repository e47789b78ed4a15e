"""Compute of one chunk: bring a token chunk's hidden states one layer up and project its K/V.

``PrefixKV`` holds a prompt's KV as it fills (loaded or computed chunks write their token
range of one layer); ``ChunkCompute`` keeps each token chunk's hidden states between its
layers.  Chunked this way, prefill is the same arithmetic as one pass over the prompt (the
same projections, attention over the same keys with the same causal mask), only split into
smaller matmuls, so floating-point results agree to rounding.
"""
from __future__ import annotations

import functools

import torch

from ..forward import attention, visible
from ..model import DecoderModel


class PrefixKV:
    """K and V of every layer for tokens [0, n_tokens): per layer [H_kv, n_tokens, d] in the model's dtype."""

    def __init__(self, model: DecoderModel, n_tokens: int):
        d = model.dims
        shape = (d.n_layers, 2, d.n_kv_heads, n_tokens, d.head_dim)
        self.kv = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.n_tokens = n_tokens
        self._loads = _load_stream(model.device) if model.device.type == "cuda" else None

    @torch.inference_mode()  # also on the I/O thread: the buffer is an inference tensor when made in the engine
    def put(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [H_kv, n, d] become tokens [start, start + n) of ``layer``.  Host chunks loaded from the store go
        to a GPU on their own stream from pinned memory, and are there when this returns (the wait is the
        loading thread's): queued compute never delays a load, nor a load the compute."""
        stop = start + k.shape[1]
        if self._loads is not None and k.device.type == "cpu":
            with torch.cuda.stream(self._loads):
                self.kv[layer, 0, :, start:stop].copy_(k.pin_memory(), non_blocking=True)
                self.kv[layer, 1, :, start:stop].copy_(v.pin_memory(), non_blocking=True)
            self._loads.synchronize()
            return
        self.kv[layer, 0, :, start:stop] = k
        self.kv[layer, 1, :, start:stop] = v

    def put_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The ``forward.prefill`` callback: a whole layer of the prompt at once."""
        self.put(layer, 0, k, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0], self.kv[layer, 1]


@functools.cache
def _load_stream(device: torch.device):
    """One stream per GPU for stored chunks' loads (not one per prompt)."""
    return torch.cuda.Stream(device)


class ChunkCompute:
    """Runs token spans of ``token_ids`` through the model layer by layer, writing their KV into ``kv``.

    ``advance(span, l)`` computes chunk (span, l): for l >= 1 it runs layer l-1 over the span
    (attention over every key before the span's end at layer l-1, which must be present in
    ``kv``), then projects layer l's K/V.  Spans are (start, stop) token ranges; the caller
    (the executor, the profiler, the suffix step) decides which and in what order.
    """

    def __init__(self, model: DecoderModel, token_ids: list[int], kv: PrefixKV, final_span: tuple[int, int] | None = None):
        self.model = model
        self.ids = token_ids
        self.kv = kv
        self.final_span = final_span  # the span whose last-layer states are kept for ``logits``
        self._state: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor, tuple]] = {}  # span -> (layer, x, q, rope)

    @torch.inference_mode()
    def advance(self, span: tuple[int, int], layer: int) -> None:
        model = self.model
        start, stop = span
        if layer == 0:
            ids = torch.tensor([self.ids[start:stop]], dtype=torch.long, device=model.device)
            rope = model.rope(torch.arange(start, stop, device=model.device)[None])
            x = model.embed(ids)
        else:
            at, x, q, rope = self._state.pop(span)
            if at != layer - 1:
                raise RuntimeError(f"tokens {span} are at layer {at}, not {layer - 1}: chunks of one span compute in layer order")
            x = model.finish_layer(layer - 1, x, self._attend(layer - 1, q, start, stop))
        q, k, v = model.qkv(layer, x, rope)
        self.kv.put(layer, start, k[0], v[0])
        if layer + 1 < model.dims.n_layers or span == self.final_span:
            self._state[span] = (layer, x, q, rope)

    @torch.inference_mode()
    def logits(self, span: tuple[int, int]) -> torch.Tensor:
        """Last-token logits [V] of a span advanced to the last layer (the prompt's final span)."""
        last = self.model.dims.n_layers - 1
        at, x, q, _ = self._state.pop(span)
        if at != last:
            raise RuntimeError(f"tokens {span} are at layer {at}: advance them to layer {last} first")
        stop = span[1]
        x = self.model.finish_layer(last, x[:, -1:], self._attend(last, q[:, :, -1:], stop - 1, stop))
        return self.model.logits(x[:, -1])[0]

    def _attend(self, layer: int, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        k, v = self.kv.layer(layer)
        mask = visible(start, stop, 0, self.model.dims.window(layer), q.device)
        return attention(self.model, q, k[None, :, :stop], v[None, :, :stop], mask=mask[None, None])

    def drop(self, span: tuple[int, int]) -> None:
        """Forget a span's hidden states (its upper layers come from the store)."""
        self._state.pop(span, None)
