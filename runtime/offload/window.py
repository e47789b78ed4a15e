"""The tokens a disk policy attends besides its picks, held in memory: the sinks (the first ``sink_groups`` groups,
copied in once written) and the window, a ring of ``window_groups + 1`` groups (the group still being filled, written
to disk as one record when full, and the newest full groups).  Neither is offered to the selector, so its picks go
to the groups in between; both stay in the model's dtype, exact whatever the records' format."""
from __future__ import annotations

import numpy as np
import torch

from ..config import RuntimeConfig
from ..kernels import Backend
from ..model import DecoderModel
from ..native_build import address
from ..transfer import to_device


class Window:
    """Sinks and ring of every layer and sequence, and how far each sequence has filled them: ``n_groups`` full
    groups written, ``rb_len`` tokens of the group being filled."""

    def __init__(self, model: DecoderModel, batch: int, cfg: RuntimeConfig, group_tokens: int, backend: Backend):
        dims = model.dims
        self.G, self.sink_groups, self.window_groups = group_tokens, cfg.sink_groups, cfg.window_groups
        self.ring_groups = cfg.window_groups + 1
        self.use_rolling_buffer = cfg.rolling_buffer
        self.rolling = torch.zeros(dims.n_layers, batch, 2, dims.n_kv_heads, self.ring_groups * self.G, dims.head_dim,
                                   dtype=model.dtype, device=model.device)
        self.sinks = torch.zeros(dims.n_layers, batch, 2, dims.n_kv_heads, self.sink_groups * self.G, dims.head_dim,
                                 dtype=model.dtype, device=model.device)
        self.n_groups = np.zeros(batch, dtype=np.int64)
        self.rb_len = np.zeros(batch, dtype=np.int64)
        self._step = None  # the step's device tensors (step_tensors), made again when lengths change
        self._batch_index = torch.arange(batch, device=model.device)
        # on a CPU a step's K and V land in the ring by one native call (the "attend" library's ekv_put_rows), where
        # torch's two index_put calls cost ~70 us a layer inside the step.  The ring as rows of one token's head: each
        # (K|V, sequence, KV head)'s row of layer 0 at ring position 0; a step adds its write positions, a layer its
        # offset
        lib = backend.lib("attend")
        self._put_rows = None if lib is None else lib.ekv_put_rows
        self.write = self._write_torch if lib is None else self._write_native
        self._ring_first_rows = ((np.arange(2)[:, None, None] + 2 * np.arange(batch)[None, :, None]) * dims.n_kv_heads
                                 + np.arange(dims.n_kv_heads)) * self.rolling.shape[4]
        self._ring_layer_rows = self._ring_first_rows.size * self.rolling.shape[4]
        self._ring_row_bytes = dims.head_dim * self.rolling.element_size()
        self._ring_step_rows = None

    @property
    def nbytes(self) -> int:
        return self.rolling.numel() * self.rolling.element_size() + self.sinks.numel() * self.sinks.element_size()

    def start(self, seq: int) -> None:
        self.n_groups[seq] = self.rb_len[seq] = 0
        self._step = None

    def outside(self) -> np.ndarray:
        """Per sequence, the groups before the window: what the selector may pick from (past the sinks)."""
        return np.maximum(self.n_groups - self.window_groups, 0)

    def keep_prompt(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A layer of a prompt's K/V [H_kv, T, d]: its sinks, and its last full groups and partial group in the ring;
        after the last layer the sequence's counts say how far it is filled."""
        n_full = k.shape[1] // self.G
        kept = [*range(min(n_full, self.sink_groups))] + [*range(max(0, n_full - self.window_groups), n_full + 1)]
        for group in kept:
            span = slice(group * self.G, min((group + 1) * self.G, k.shape[1]))
            self.keep_group(layer, seq, group, k[:, span], v[:, span], in_ring=group >= n_full - self.window_groups)
        self._step = None
        if layer == self.rolling.shape[0] - 1:
            self.n_groups[seq], self.rb_len[seq] = n_full, k.shape[1] - n_full * self.G

    def keep_group(self, layer: int, seq: int, group: int, k: torch.Tensor, v: torch.Tensor, in_ring: bool) -> None:
        """Hold (part of) ``group`` in memory: in the sinks if it is one, in its ring slot if ``in_ring``."""
        n = k.shape[1]
        if group < self.sink_groups:
            self.sinks[layer, seq, 0, :, group * self.G : group * self.G + n] = k
            self.sinks[layer, seq, 1, :, group * self.G : group * self.G + n] = v
        if in_ring:
            start = (group % self.ring_groups) * self.G
            self.rolling[layer, seq, 0, :, start : start + n] = k
            self.rolling[layer, seq, 1, :, start : start + n] = v

    def step_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's ring write position [B], the resident mask) on the compute device: the same for every layer
        of a step, so made once a step (one transfer, none per layer)."""
        if self._step is None:
            write_at = self.n_groups % self.ring_groups * self.G + self.rb_len
            self._step = (to_device(write_at, device), self._resident_mask(device))
            self._ring_step_rows = np.ascontiguousarray(self._ring_first_rows + write_at[:, None])
        return self._step

    def _write_native(self, layer: int, k: torch.Tensor, v: torch.Tensor, write_at: torch.Tensor) -> None:
        """The step's own K and V [B, H_kv, 1, d] into their ring slot of ``layer`` (at ``write_at`` [B])."""
        k, v = (t.to(self.rolling.dtype).contiguous() for t in (k, v))
        self._put_rows(self.rolling.data_ptr(), self._ring_row_bytes, address(self._ring_step_rows),
                       layer * self._ring_layer_rows, k.data_ptr(), v.data_ptr(), k.shape[0] * k.shape[1])

    def _write_torch(self, layer: int, k: torch.Tensor, v: torch.Tensor, write_at: torch.Tensor) -> None:
        rolling = self.rolling[layer]
        rolling[self._batch_index, 0, :, write_at] = k[:, :, 0]
        rolling[self._batch_index, 1, :, write_at] = v[:, :, 0]

    def _resident_mask(self, device) -> torch.Tensor:
        """[B, S + (W + 1) * G]: which sink and ring positions hold tokens to attend (never one the picks hold)."""
        n_groups = to_device(self.n_groups, device)[:, None]
        sink_group = torch.arange(self.sink_groups * self.G, device=device) // self.G
        sinks = sink_group < n_groups
        ring_slot = torch.arange(self.ring_groups, device=device)
        group = n_groups - (n_groups - ring_slot) % self.ring_groups  # [B, R]: the newest group in each ring slot
        position = torch.arange(self.G, device=device)
        rb_pos = to_device(self.rb_len, device)[:, None, None]
        filling = position <= rb_pos if self.use_rolling_buffer else position == rb_pos
        full = ((group >= 0) & (group >= self.sink_groups))[..., None].expand(-1, -1, self.G)
        ring = torch.where((group == n_groups)[..., None], filling, full)
        return torch.cat([sinks, ring.reshape(len(self.n_groups), -1)], dim=1)

    def end_step(self, active: np.ndarray) -> list[tuple[int, slice, torch.Tensor]]:
        """The step's tokens join the window; returns (sequence, ring span, its K/V [L, 2, H_kv, G, d] on the host)
        of each group now full, moved in one transfer (on a GPU its one sync), not two per layer."""
        self._step = None
        self.rb_len[active] += 1
        full = np.flatnonzero(self.rb_len == self.G)
        if not len(full):
            return []
        spans = [self.span(int(seq)) for seq in full]
        on_host = torch.stack([self.rolling[:, seq, :, :, span] for seq, span in zip(full, spans)]).cpu()
        return [(int(seq), span, kv) for seq, span, kv in zip(full, spans, on_host)]

    def span(self, seq: int) -> slice:
        """The ring positions of the group ``seq`` is filling."""
        slot = int(self.n_groups[seq]) % self.ring_groups
        return slice(slot * self.G, (slot + 1) * self.G)

    def flushed(self, seq: int, span: slice) -> None:
        """``seq``'s group in ``span`` is on disk: a sink group is kept in the sinks too, and a new group begins."""
        group = int(self.n_groups[seq])
        for layer in range(self.rolling.shape[0]) if group < self.sink_groups else ():
            k, v = self.rolling[layer, seq, :, :, span]
            self.keep_group(layer, seq, group, k, v, in_ring=False)
        self.n_groups[seq] += 1
        self.rb_len[seq] = 0
