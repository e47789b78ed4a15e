"""The KV memory a policy keeps resident, computed before anything is allocated.

Per sequence: ``full`` keeps the whole cache; the offloading policies keep K_lr (not
``flexgen``, which predicts nothing), their slot buffers (reuse: C slots per layer; no
reuse: M slots for two layers, the one computing and the one loading; sink and window groups
are not picked, so they take no slots), the sinks (S tokens per layer) and the rolling window
(the W newest tokens plus the group being filled, per layer), and with ``clustering`` the placement tables
(each group's copies on the KV paths), and the checksums of the records on disk (4 bytes per group and layer,
none when ``verify_fraction`` is 0).  Slots count their O_DIRECT padding: it is resident too.
``arkv`` keeps, per layer, its window in original precision and the rest of its share of the budget as
original or quantized tokens (with their scores), the split per layer set by the prompt (runtime/arkv.py);
under a budget that holds the whole cache it is ``full``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .arkv import GROUP_TOKENS, ArkvGeometry
from .checksum import CHECKSUM_BYTES
from .config import RuntimeConfig, cpu_pool_tokens
from .hillinfer import HierarchicalSelector
from .model import ModelDims
from .placement import PLACEMENT_BYTES_PER_GROUP
from .selector import klr_token_bytes
from .slots import PreloadSlots, SlotTable

MIB = 1024 * 1024


class BudgetError(ValueError):
    """The configuration needs more KV memory than its budget allows."""


@dataclass(frozen=True)
class MemoryPlan:
    per_sequence_bytes: dict[str, int]
    batch: int

    @property
    def total_bytes(self) -> int:
        return sum(self.per_sequence_bytes.values()) * self.batch

    def check(self, budget_mib: float | None, policy: str) -> None:
        if budget_mib is None:
            return
        need_mib = self.total_bytes / MIB
        if need_mib > budget_mib:
            parts = ", ".join(f"{k} {v * self.batch / MIB:.1f} MiB" for k, v in self.per_sequence_bytes.items())
            raise BudgetError(
                f"policy {policy!r} needs {need_mib:.1f} MiB of KV memory for max_batch={self.batch} "
                f"({parts}) but max_kv_mem_mib is {budget_mib:g} MiB; raise the budget or lower "
                "max_batch, max_context, C, M or the K rank (raise sigma)"
            )


def plan_memory(
    policy: str,
    cfg: RuntimeConfig,
    dims: ModelDims,
    kv_itemsize: int,
    rank: int,
    stride_bytes: int,
) -> MemoryPlan:
    """cfg must already be the policy's effective config (RuntimeConfig.for_policy)."""
    token_bytes = 2 * dims.n_kv_heads * dims.head_dim * kv_itemsize
    arkv = ArkvGeometry(cfg, dims, kv_itemsize) if policy == "arkv" else None
    if policy == "full" or (arkv is not None and arkv.fits_all):
        parts = {"kv": dims.n_layers * cfg.max_context * token_bytes}
    elif arkv is not None:
        if arkv.arena_bytes < arkv.min_arena_bytes:
            need_mib = arkv.min_arena_bytes * dims.n_layers * cfg.max_batch / MIB
            raise BudgetError(
                f"policy 'arkv' needs at least {need_mib:.2f} MiB of KV memory for max_batch={cfg.max_batch} (per layer: "
                f"arkv_window_tokens={cfg.arkv_window_tokens} + 1 + {GROUP_TOKENS} tokens in original precision and one "
                f"quantized group) but max_kv_mem_mib is {cfg.max_kv_mem_mib:g} MiB; raise max_kv_mem_mib or lower "
                "arkv_window_tokens or max_batch"
            )
        parts = {"window_original": dims.n_layers * arkv.window_bytes,
                 "tokens_original_or_quantized": dims.n_layers * (arkv.arena_bytes - arkv.window_bytes)}
    else:
        picked = cfg.picked_groups
        slots = SlotTable.n_buffers(dims.n_layers) * cfg.C if cfg.reuse else PreloadSlots.n_buffers(dims.n_layers) * picked
        parts = {
            "k_lowrank": 0 if policy in ("flexgen", "hillinfer") else dims.n_layers * cfg.max_context * klr_token_bytes(rank, cfg.klr_dtype),
            "k_cpu_pool": 0 if policy != "hillinfer" else
            dims.n_layers * cpu_pool_tokens(cfg.beta, cfg.max_context) * dims.n_kv_heads * dims.head_dim * 2
            + HierarchicalSelector.index_bytes(dims.n_layers, cfg.max_context),
            "slots": slots * stride_bytes,
            "slot_table": SlotTable.index_bytes(dims.n_layers, cfg.C, -(-cfg.max_context // cfg.G), cfg.replacement)
            if cfg.reuse else 0,
            "sinks": dims.n_layers * cfg.sink_groups * cfg.G * token_bytes,
            "rolling": dims.n_layers * (cfg.window_groups + 1) * cfg.G * token_bytes,
            "placement": dims.n_layers * -(-cfg.max_context // cfg.G) * PLACEMENT_BYTES_PER_GROUP if cfg.clustering else 0,
            "checksums": dims.n_layers * -(-cfg.max_context // cfg.G) * CHECKSUM_BYTES if cfg.verify_fraction > 0 else 0,
        }
    return MemoryPlan(parts, cfg.max_batch)
