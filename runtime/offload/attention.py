"""A disk policy's attention over a layer's picks, the sinks and the window: through a gathered copy (torch: the
reference, and a GPU's way), or straight from the slots where the records' native kernel reads them
(runtime/record_attention.py); which one is chosen once, when the policy is built."""
from __future__ import annotations

import numpy as np
import torch

from ..disk_store import RecordLayout
from ..forward import decode_attention, decode_attention_part
from ..kernels import Backend
from ..model import DecoderModel
from ..record_attention import RecordAttention
from ..transfer import to_device
from .window import Window


class GatheredAttention:
    """Only the picked records are gathered, one copy each, and decoded on the compute device; the sinks and the
    window are joined to them and the whole attended at once."""

    def __init__(self, model: DecoderModel, layout: RecordLayout, slot_memory, slots, window: Window):
        self.model, self.layout, self.slot_memory, self.slots, self.window = model, layout, slot_memory, slots, window

    def __call__(self, layer: int, q: torch.Tensor, slots: np.ndarray, valid: np.ndarray,
                 resident: torch.Tensor) -> torch.Tensor:
        """The layer's attention over its picks in flat ``slots`` [B, M] (where ``valid``), the sinks and the window
        (``resident``: which of their positions hold tokens)."""
        return decode_attention(self.model, q, *self._keys_values(layer, q, slots, valid, resident))

    def lend_aside(self, aside) -> None:
        """The policy's helper thread, for a kernel that shares its work with it (torch's has none)."""

    def part(self, layer: int, q: torch.Tensor, slots: np.ndarray, valid: np.ndarray,
             resident: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One part of the layer's attention (``forward.decode_attention_part``): the picks in ``slots``, and the
        sinks and the window when ``resident`` is given; parts merge by log-sum-exp (``forward.merge_attention``)."""
        return decode_attention_part(self.model, q, *self._keys_values(layer, q, slots, valid, resident))

    def _keys_values(self, layer: int, q: torch.Tensor, slots: np.ndarray, valid: np.ndarray,
                     resident: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values [B, H_kv, S, d] and the mask [B, 1, 1, S] of the picks, then the sinks and the window."""
        records = self.slot_memory.gather(layer, self.slots.buffer_index(layer), torch.from_numpy(slots))
        selected = self.layout.decode(records, self.model.dtype)  # [B, M, K|V, H_kv, G, d]
        b, m, _, h_kv, g, d = selected.shape
        kv = selected.permute(2, 0, 3, 1, 4, 5).reshape(2, b, h_kv, m * g, d)  # K and V in one copy
        mask = to_device(np.repeat(valid, g, axis=1), q.device)
        if resident is not None:
            window = self.window
            kv = torch.cat([kv, window.sinks[layer].transpose(0, 1), window.rolling[layer].transpose(0, 1)], dim=3)
            mask = torch.cat([mask, resident], dim=1)
        keys, values = kv
        return keys, values, mask[:, None, None, :]


class SlotAttention(GatheredAttention):
    """The whole attention in one native call reading each record where it landed in the host slots, and the sinks
    and the ring where they are (a correction's parts still gather: they are few)."""

    def __init__(self, kernel: RecordAttention, model, layout, slot_memory, slots, window: Window):
        super().__init__(model, layout, slot_memory, slots, window)
        self.kernel = kernel
        self._dense: dict[int, np.ndarray] = {}  # layer -> its sinks and ring as the kernel takes them

    def lend_aside(self, aside) -> None:
        self.kernel.aside = aside

    def __call__(self, layer, q, slots, valid, resident):
        records = self.slot_memory.buffer_records(self.slots.buffer_index(layer))
        dense = self._dense.get(layer)
        if dense is None:  # the sinks and the ring stay where they are: found once a layer
            dense = self._dense[layer] = self.kernel.segments([self.window.sinks[layer], self.window.rolling[layer]])
        return self.kernel(q, records, slots, valid, dense, resident)


def picked_attention(backend: Backend, model: DecoderModel, layout: RecordLayout, slot_memory, slots, window: Window
                     ) -> GatheredAttention:
    """Straight from the slots where the backend's records kernel serves this layout and model; else gathered."""
    kernel = RecordAttention.for_layout(backend, layout, model.dims.n_heads, model.scaling, model.dtype)
    if kernel is None:
        return GatheredAttention(model, layout, slot_memory, slots, window)
    return SlotAttention(kernel, model, layout, slot_memory, slots, window)
