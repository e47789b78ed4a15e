"""The parts every disk policy shares: its records' layout, its memory by part, and the ``OffloadedKV`` it runs.

kvswap, token, flexgen and hillinfer differ in how they pick groups (the selector) and in their effective
config; the store, the slots and the step pipeline are the same code (runtime/offload/).
"""
from __future__ import annotations

import torch

from ..checksum import CHECKSUM_BYTES
from ..config import ConfigError, RuntimeConfig
from ..disk_store import DiskKVStore, RecordLayout
from ..model import ModelDims
from ..offload import OffloadedKV
from ..placement import PLACEMENT_BYTES_PER_GROUP
from ..selector import Selector, klr_layer_bytes
from ..slots import PreloadSlots, SlotTable
from .base import PolicyEnv


def record_layout(cfg: RuntimeConfig, dims: ModelDims, dtype: torch.dtype) -> RecordLayout:
    """The disk records in ``kv_record_dtype``; a format this model cannot take is named as the config field."""
    layout = RecordLayout(cfg.G, dims.n_kv_heads, dims.head_dim, dtype, cfg.io.io_align_bytes, cfg.io.kv_record_dtype)
    try:
        layout.codec  # built now: a format the model cannot take fails before the weights load
    except ValueError as exc:
        raise ConfigError(f"config field 'kv_record_dtype' {cfg.io.kv_record_dtype!r}: {exc}; pick another format") from exc
    return layout


def disk_parts(cfg: RuntimeConfig, dims: ModelDims, kv_itemsize: int, rank: int, stride_bytes: int,
               predicts: bool) -> dict[str, int]:
    """Per sequence: K_lr (``predicts``) and its own float32 projections (``prompt_adapter``), the slot buffers
    (reuse: C per layer; none: the picks of two layers, a correction's reads landing in the slots of the guesses it
    dropped), the slot table, the sinks and rolling window in memory, the placement tables and the records'
    checksums."""
    token_bytes = 2 * dims.n_kv_heads * dims.head_dim * kv_itemsize
    slots = SlotTable.n_buffers(dims.n_layers) * cfg.C if cfg.reuse else PreloadSlots.n_buffers(dims.n_layers) * \
        cfg.picked_groups
    groups = cfg.max_groups
    return {
        "k_lowrank": dims.n_layers * klr_layer_bytes(rank, cfg.predictor.klr_dtype, cfg.max_context) if predicts else 0,
        "prompt_adapter": dims.n_layers * dims.n_kv_heads * dims.head_dim * rank * 4
        if predicts and cfg.predictor.prompt_adapter else 0,
        "k_cpu_pool": 0,
        "slots": slots * stride_bytes,
        "slot_table": SlotTable.index_bytes(dims.n_layers, cfg.C, groups, cfg.replacement) if cfg.reuse else 0,
        "sinks": dims.n_layers * cfg.sink_groups * cfg.G * token_bytes,
        "rolling": dims.n_layers * (cfg.window_groups + 1) * cfg.G * token_bytes,
        "placement": dims.n_layers * groups * PLACEMENT_BYTES_PER_GROUP if cfg.placement.clustering else 0,
        "checksums": dims.n_layers * groups * CHECKSUM_BYTES if cfg.integrity.verify_fraction > 0 else 0,
    }


def open_store(env: PolicyEnv, cfg: RuntimeConfig) -> DiskKVStore:
    dims = env.model.dims
    return DiskKVStore(env.kv_paths, dims.n_layers, record_layout(cfg, dims, env.model.dtype), env.reader,
                       cfg.max_groups, cfg.io.max_request_bytes, cfg.integrity.verify_fraction, cfg.io.io_gap_bytes,
                       backend=env.backend)


def offloaded(env: PolicyEnv, batch: int, cfg: RuntimeConfig, store: DiskKVStore, selector: Selector,
              predict: bool = True, placer=None) -> OffloadedKV:
    """The disk pipeline over ``selector``'s picks: a reuse buffer when the config has one, else preload slots."""
    dims = env.model.dims
    slots = SlotTable(dims.n_layers, batch, cfg.C, cfg.max_groups, cfg.replacement, env.backend) if cfg.reuse \
        else PreloadSlots(batch, cfg.picked_groups)
    return OffloadedKV(env.model, batch, cfg, store, selector, slots, predict, placer, env.on_select, env.backend)
