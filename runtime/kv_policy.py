"""KV policies: where each layer's KV lives and what the current token attends to.

The engine's layer loop calls, per decode step: ``prefetch(layer + 1, ...)`` before it
computes ``layer`` (so a policy may start loading the next layer's KV), then
``attend(layer, ...)``, and ``end_step`` once all layers are done.  ``InMemoryKV`` is the
reference (``full``); ``OffloadedKV`` (runtime/offload/) serves ``kvswap``, ``token``, ``flexgen`` and ``hillinfer``;
``ArkvKV`` (arkv.py) serves ``arkv``.
"""
from __future__ import annotations

import numpy as np
import torch

from .aside import SPIN_US, AsideThread
from .dense_attention import DenseAttention
from .forward import decode_attention
from .kernels import Backend, resolve_backend
from .model import DecoderModel
from .reader import BusyTime
from .transfer import to_device

CUDA_SPAN_TOKENS = 256  # full's attended span on a GPU grows in these steps (attended_span)


def attended_span(longest: int, max_context: int, device: torch.device) -> int:
    """Key positions full attends this step, ``longest`` + 1 at least.  On a GPU it is rounded up to
    ``CUDA_SPAN_TOKENS`` (the rest masked): cuDNN's attention builds a graph per shape, 1.3 ms of host time a call
    on an H100 when the span grew every step, against 0.07 ms for a shape it has seen."""
    span = longest + 1
    if device.type == "cuda":
        span = -(-span // CUDA_SPAN_TOKENS) * CUDA_SPAN_TOKENS
    return min(span, max_context)


class KVPolicy:
    """Base: owns the per-sequence cache lengths; subclasses own the KV itself."""

    prompt_queries = 0  # the last prompt queries per layer the policy wants (observe_prompt), 0: none

    def __init__(self, model: DecoderModel, batch: int, max_context: int):
        self.model = model
        self.batch = batch
        self.max_context = max_context
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.io_stall_s = 0.0
        self.read_time = BusyTime()  # begin/end around every read, on any thread
        self.select_s = 0.0  # prediction + slot bookkeeping on the compute thread
        self.bytes_read = np.zeros(batch, dtype=np.int64)

    @property
    def resident_bytes(self) -> int:
        raise NotImplementedError

    def start_sequence(self, seq: int) -> None:
        self.lengths[seq] = 0
        self.bytes_read[seq] = 0

    def share_prefix(self, seq: int, owner: int, n_groups: int) -> None:
        """``seq``'s prompt starts with ``n_groups`` whole groups of ``owner``'s (same tokens, so the same KV),
        called before its prefill; a policy may keep them once.  Default: each sequence keeps its own."""

    def observe_prompt(self, layer: int, seq: int, q: torch.Tensor) -> None:
        """The prompt's last ``prompt_queries`` queries q [H, n, d] of ``layer``, given before its KV when computed."""

    def store_prompt(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one layer of a prompt's KV, k/v [H_kv, T, d]."""
        raise NotImplementedError

    def end_prompt(self, seq: int, n_tokens: int) -> None:
        self.lengths[seq] = n_tokens

    def end_prefill(self) -> None:
        """Every prompt of the batch is stored; decoding starts."""

    def prefetch(self, layer: int, x: torch.Tensor, rope, active: np.ndarray) -> None:
        """Start bringing ``layer``'s KV in, predicting from hidden states x (input of the layer before)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the current tokens q [B, H, 1, d]; k/v [B, H_kv, 1, d] are their own KV."""
        raise NotImplementedError

    @property
    def io_read_s(self) -> float:
        """Wall time with any read running (reads on several threads overlap): bytes_read / io_read_s is the
        achieved disk rate."""
        return self.read_time.total_s

    def take_picks(self) -> None:
        """A layer attends elsewhere (a hybrid model's windowed layer): what ``prefetch`` launched on the device may
        reach the host and start its reads now."""

    def end_step(self, active: np.ndarray) -> None:
        """The current tokens of active sequences join the cache."""
        self.lengths[active] += 1

    def reuse_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(hits, lookups) per sequence."""
        zeros = np.zeros(self.batch, dtype=np.int64)
        return zeros, zeros

    def stats(self, seq: int) -> dict:
        """What the policy did for ``seq`` (its reads and reuse) and the batch (stalls, resident bytes, of which
        ``kv_window_bytes`` in sliding-window rings, runtime/hybrid.py): every policy reports the same keys, a disk
        policy's store adds its reads by path and checks."""
        hits, lookups = self.reuse_counts()
        return {"kv_bytes_read": int(self.bytes_read[seq]),
                "reuse_rate": float(hits[seq] / lookups[seq]) if lookups[seq] else 0.0,
                "reuse_hits": int(hits[seq]), "reuse_lookups": int(lookups[seq]),
                "io_stall_s": self.io_stall_s, "io_read_s": self.io_read_s, "select_s": self.select_s,
                "kv_resident_bytes": self.resident_bytes, "kv_window_bytes": 0, "o_direct": None, "n_paths": 0, "kv_read_requests": 0,
                "kv_records_read": 0, "kv_gap_records_read": 0, "kv_records_by_path": [], "kv_records_verified": 0, "kv_records_reread": 0,
                "scorer_fallback": None, "kv_correction_records": 0, "correction_s": 0.0, "guess_recall": None,
                "corrected_layer_share": None,
                "kv_bytes_copied": 0}

    def fitted_adapter(self) -> tuple[object | None, int]:
        """A low-rank K adapter fitted on this batch's prompts, and the fewest keys a layer's fit saw: (None, 0)
        when the policy fitted none (it predicts nothing, or has a calibrated adapter)."""
        return None, 0

    def reads_in_place(self, layout) -> bool:
        """Whether the policy reads a stored context's blobs of record ``layout`` in place (``attach_prefix``)."""
        return False

    def attach_prefix(self, seq: int, layout, blobs: list) -> None:
        """``seq``'s prompt starts with stored chunks: (blob path, groups, record checksums) each, in order."""

    def release_sequence(self, seq: int) -> None:
        pass

    def close(self) -> None:
        pass


class InMemoryKV(KVPolicy):
    """All KV in one preallocated tensor per layer: the exact reference, no copies per step.  On the native backend
    it attends in one native call (runtime/dense_attention.py) shared with a helper thread."""

    def __init__(self, model: DecoderModel, batch: int, max_context: int, backend: Backend | None = None):
        """``backend``: what it attends on (runtime/kernels.py; None: the model device's)."""
        super().__init__(model, batch, max_context)
        d = model.dims
        self.kv = torch.zeros(
            d.n_layers, 2, batch, d.n_kv_heads, max_context, d.head_dim, dtype=model.dtype, device=model.device
        )
        self._batch_index = torch.arange(batch, device=model.device)
        self._step_key, self._step = None, None  # the step's lengths -> (write positions, span, mask)
        backend = backend or resolve_backend(model.device)
        self.dense = DenseAttention.for_cache(backend, model.dtype, d.n_heads, d.n_kv_heads, d.head_dim, model.scaling)
        self._attention = self._torch_attention if self.dense is None else self._dense_attention
        if self.dense is not None:
            # where the model's layers share the helper too it spins between them (aside.SPIN_US)
            self.dense.aside = AsideThread.open(SPIN_US if model.computes_aside else 0, backend)
            model.lend_aside(self.dense.aside, self)
            self._starts = np.zeros(batch, dtype=np.int64)

    @property
    def resident_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def store_prompt(self, layer, seq, k, v):
        n = k.shape[1]
        self.kv[layer, 0, seq, :, :n] = k
        self.kv[layer, 1, seq, :, :n] = v

    def attend(self, layer, q, k, v):
        pos, span, mask = self._step_tensors(q.device)
        self.kv[layer, :, self._batch_index, :, pos] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)  # K and V at once
        return self._attention(layer, q, span, mask)

    def _dense_attention(self, layer: int, q: torch.Tensor, span: int, mask: torch.Tensor) -> torch.Tensor:
        """Each row's positions [0, length] in one native call (the span and mask are torch's)."""
        return self.dense(q, self.kv[layer, 0], self.kv[layer, 1], self._starts, self._stops)

    def _torch_attention(self, layer: int, q: torch.Tensor, span: int, mask: torch.Tensor) -> torch.Tensor:
        return decode_attention(self.model, q, self.kv[layer, 0, :, :, :span], self.kv[layer, 1, :, :, :span], mask)

    def _step_tensors(self, device) -> tuple[torch.Tensor, int, torch.Tensor]:
        """(each row's write position [B], the attended span, the mask [B, 1, 1, span]): the same for every layer of
        a step, so made once a step (one non-blocking move on a GPU) instead of once a layer."""
        key = self.lengths.tobytes()
        if self._step_key != key:
            pos = to_device(self.lengths, device)
            span = attended_span(int(self.lengths.max()), self.kv.shape[4], device)
            self._step = pos, span, (torch.arange(span, device=device) <= pos[:, None])[:, None, None, :]
            self._step_key = key
            self._stops = self.lengths + 1  # the native attention's positions [0, length]
        return self._step

    def close(self) -> None:
        if self.dense is not None and self.dense.aside is not None:
            self.model.lend_aside(None, self)
            self.dense.aside.close()
