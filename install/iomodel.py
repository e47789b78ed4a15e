"""T_io(b, picked_groups, G, reuse): the time one decode step's missed records take to reach the compute device.

Each layer reads the missed picks of every sequence, b * picked_groups * (1 - reuse) records of
``stride_bytes`` (the on-disk record of one group, in its ``kv_record_dtype``), at the random-read bandwidth the
profile measured for the runtime's reader at that block size and queue depth.  With several KV paths the
records are spread over them and the rate is ``planned_mib_s`` (N x the slowest path, a shared device once).
On a GPU the same bytes then cross the bus to the device slots (``h2d_gib_s``, the compute profile's), after
their reads: hits never cross it, misses once.
"""
from __future__ import annotations

import torch

from edgekv.runtime import RecordLayout
from edgekv.runtime.model import ModelDims

from .disk import DiskProfile, planned_mib_s


def io_model(disk: DiskProfile | list[DiskProfile], dims: ModelDims, kv_dtype: torch.dtype, io_align_bytes: int,
             queue_depth: int, h2d_gib_s: float | None = None, block_bytes: int | None = None):
    """A function (batch, picked_groups, G, reuse_rate, record_dtype) -> ms of reads (and, on a GPU, host -> device
    copies) per decode step (all layers).

    ``disk``: one path's profile, or one per KV path (one queue of ``queue_depth`` each); ``h2d_gib_s``: the
    bus's rate (None: the records are read where attention reads them, the CPU); ``block_bytes``: the disk's O_DIRECT
    unit, records shorter than ``io_align_bytes`` padding to a power of two from it (None: to ``io_align_bytes``)."""
    profiles = list(disk) if isinstance(disk, (list, tuple)) else [disk]

    def t_io_ms(batch: int, picked_groups: int, G: int, reuse_rate: float, record_dtype: str = "auto") -> float:
        stride = RecordLayout.padded(G, dims.n_kv_heads, dims.head_dim, kv_dtype, record_dtype, io_align_bytes,
                                     block_bytes).stride_bytes
        bytes_per_layer = batch * picked_groups * (1.0 - reuse_rate) * stride
        mib_s = planned_mib_s(profiles, stride, queue_depth)
        bus_s = bytes_per_layer / (h2d_gib_s * 2**30) if h2d_gib_s else 0.0
        return dims.n_layers * (bytes_per_layer / (mib_s * 2**20) + bus_s) * 1e3

    return t_io_ms


SPAN_RECORDS = 4  # the request sizes the gap's worth is measured over: one record to this many (a merged read's)


def gap_bytes(disk: DiskProfile | list[DiskProfile], record_bytes: int, queue_depth: int) -> int:
    """``io_gap_bytes``: how far apart two records of a file may be and still be read as one request, the gap read
    and dropped.  A request of b bytes holds the disk for b / rate(b) (the profile's rate at ``queue_depth``);
    along the sizes a merged read has (one record to ``SPAN_RECORDS``) that is a fixed cost plus a cost per byte,
    and a gap is worth reading while its bytes cost less than the fixed cost of the request it saves.

    The rates are fio's where it ran (the disk's own random reads), not our reader's, and the sizes stop at
    ``SPAN_RECORDS`` records, where merged reads are (2-3 records of 4 KiB bridged: 19 KiB a request on average): on
    this machine's virtio disk the reader's rates and the 64 KiB points vary from profile to profile (fio 1,175 to
    2,222 MiB/s at 64 KiB), and a fit that leaned on them chose gaps of 8-11 records, measured 0.90x no gap at 11.
    Over 4-16 KiB fio's rates give 9-11 KiB in four profiles of seven (2 records, measured 1.11-1.20x), 16 KiB in the
    other three (4 records, 1.05-1.12x); an NVMe SSD's none (a request costs less than a record); a disk whose
    requests cost nothing over their bytes none."""
    profiles = list(disk) if isinstance(disk, (list, tuple)) else [disk]
    small, large = record_bytes, SPAN_RECORDS * record_bytes
    cost_small, cost_large = (size / (planned_mib_s(profiles, size, queue_depth, source="disk") * 2**20)
                              for size in (small, large))
    per_byte = (cost_large - cost_small) / (large - small)
    fixed = cost_small - small * per_byte
    if fixed <= 0:
        return 0
    return large if per_byte <= 0 else int(min(large, fixed / per_byte))
