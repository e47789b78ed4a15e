"""Host -> device moves of small per-step tensors (indices, lengths, masks) that never stall the GPU."""
from __future__ import annotations

import numpy as np
import torch


def to_device(x, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device`` without a host-device sync: on a GPU it goes through pinned memory
    with a non-blocking copy (a copy from pageable memory waits for the stream's queued work first); on the CPU
    it is itself."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
