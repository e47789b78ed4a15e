"""T_io(b, M, G, reuse): disk time of one decode step, from the disk profile.

Each layer reads the missed groups of every sequence, b * M * (1 - reuse) records of
``stride_bytes`` (the on-disk record of one group, in its ``kv_record_dtype``), at the random-read bandwidth the
profile measured for the runtime's reader at that block size and queue depth.  With several KV paths the
records are spread over them and the rate is ``planned_mib_s`` (N x the slowest path, a shared device once).
"""
from __future__ import annotations

import torch

from edgekv.runtime import RecordLayout
from edgekv.runtime.model import ModelDims

from .disk import DiskProfile, planned_mib_s


def io_model(disk: DiskProfile | list[DiskProfile], dims: ModelDims, kv_dtype: torch.dtype, io_align_bytes: int,
             queue_depth: int):
    """A function (batch, M, G, reuse_rate, record_dtype) -> ms of reads per decode step (all layers).

    ``disk``: one path's profile, or one per KV path (one queue of ``queue_depth`` each)."""
    profiles = list(disk) if isinstance(disk, (list, tuple)) else [disk]

    def t_io_ms(batch: int, M: int, G: int, reuse_rate: float, record_dtype: str = "auto") -> float:
        stride = RecordLayout(G, dims.n_kv_heads, dims.head_dim, kv_dtype, io_align_bytes, record_dtype).stride_bytes
        bytes_per_layer = batch * M * (1.0 - reuse_rate) * stride
        mib_s = planned_mib_s(profiles, stride, queue_depth)
        return dims.n_layers * bytes_per_layer / (mib_s * 2**20) * 1e3

    return t_io_ms
