"""pytest-benchmark micro-benchmarks of the decode hot path (not part of `make test`):

    .venv/bin/python -m pytest tests/bench --benchmark-only

Shapes are one layer of a Llama-3.2-3B-like model (24 query heads over 8 KV heads of 128)
at 16K context, batch 4, M*G = 400, sigma 8.
"""
import os

import numpy as np
import pytest
import torch

from edgekv.runtime.disk_store import aligned_zeros
from edgekv.runtime.reader import ReadBatch, open_reader
from edgekv.runtime.config import PredictorConfig
from edgekv.runtime.model import ModelDims
from edgekv.runtime.selector import LowRankSelector

B, H, H_KV, D, S, G, M, RANK = 4, 24, 8, 128, 16384, 4, 100, 128


class _Model:
    scaling = D ** -0.5


@pytest.fixture(scope="module")
def selector():
    dims = ModelDims(n_layers=1, hidden=H_KV * D, n_heads=H_KV, n_kv_heads=H_KV, head_dim=D, vocab=10)
    sel = LowRankSelector(None, RANK, dims, B, S, G, M, PredictorConfig(klr_dtype="bfloat16"), torch.device("cpu"))
    sel.adapter = [torch.randn(H_KV * D, RANK, dtype=sel.dtype)]  # projections compute in float32
    sel.k_lr.normal_()
    return sel


def test_predictor_scoring(benchmark, selector):
    q = torch.randn(B, H, 1, D)
    benchmark(selector.select, 0, q, torch.full((B,), S // G))


def test_group_gather(benchmark):
    slots = torch.randn(B, 2 * M, 2, H_KV, G, D)
    picks = torch.randint(0, 2 * M, (B, M))
    rows = torch.arange(B)[:, None]
    benchmark(lambda: slots[rows, picks].contiguous())


def test_attention_over_selected_groups(benchmark):
    from edgekv.runtime.forward import decode_attention

    q = torch.randn(B, H, 1, D)
    k = torch.randn(B, H_KV, M * G + G, D)
    mask = torch.ones(B, 1, 1, M * G + G, dtype=torch.bool)
    benchmark(decode_attention, _Model(), q, k, k, mask)


def test_disk_read_of_m_groups(benchmark, tmp_path_factory):
    path = tmp_path_factory.mktemp("disk") / "kv.bin"
    record = 2 * H_KV * G * D * 2  # fp16 K and V of one group
    with open(path, "wb") as f:
        f.write(os.urandom(record * 4096))
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    reader = open_reader("auto", 64)
    dest = aligned_zeros((B * M, record), 4096)
    rng = np.random.default_rng(0)
    batch = ReadBatch(np.full(B * M, fd, dtype=np.int32), rng.integers(0, 4096, B * M).astype(np.int64) * record,
                      dest.ctypes.data + np.arange(B * M, dtype=np.int64) * record, record)
    benchmark(reader.read, batch)
    reader.close()
    os.close(fd)


def _gb_s(benchmark, nbytes: int) -> None:
    """Throughput beside the time: bytes of float KV handled per second (fp32 in or out)."""
    benchmark.extra_info["float_bytes"] = nbytes
    benchmark.extra_info["GB/s"] = nbytes / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("record_dtype", ["int8", "int4"])
def test_record_encode(benchmark, record_dtype):
    """A full group flushed or a prompt written: M groups of one layer quantized into records."""
    from edgekv.runtime.disk_store import RecordLayout

    layout = RecordLayout(G, H_KV, D, torch.float32, 512, record_dtype)
    k, v = torch.randn(H_KV, M * G, D), torch.randn(H_KV, M * G, D)
    benchmark(layout.pack, k, v)
    _gb_s(benchmark, 2 * k.numel() * 4)


@pytest.mark.parametrize("record_dtype", ["fp16", "int8", "int4"])
def test_record_decode_selected(benchmark, record_dtype):
    """One layer's step: the M selected records of every sequence dequantised for attention."""
    from edgekv.runtime.disk_store import RecordLayout

    layout = RecordLayout(G, H_KV, D, torch.float32, 512, record_dtype)
    records = np.stack([layout.pack(torch.randn(H_KV, M * G, D), torch.randn(H_KV, M * G, D)) for _ in range(B)])
    benchmark(layout.decode, records, torch.float32)
    _gb_s(benchmark, B * M * 2 * H_KV * G * D * 4)
