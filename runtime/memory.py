"""The KV memory a policy keeps resident, computed before anything is allocated.

Each policy declares its parts (``PolicySpec.memory_parts``, runtime/policies/): ``full`` keeps the whole
cache; the disk policies keep K_lr (those that predict), their slot buffers (reuse: C slots per layer; no
reuse: M slots for two layers, the one computing and the one loading; sink and window groups are not picked,
so they take no slots), the sinks (S tokens per layer) and the rolling window (the W newest tokens plus the
group being filled, per layer), and with ``clustering`` the placement tables (each group's copies on the KV
paths), and the checksums of the records on disk (4 bytes per group and layer, none when ``verify_fraction``
is 0).  Slots count their O_DIRECT padding: it is resident too.  ``arkv`` keeps, per layer, its window in
original precision and the rest of its share of the budget as original or quantized tokens (with their
scores); under a budget that holds the whole cache it is ``full``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import RuntimeConfig
from .model import ModelDims
from .policies import get

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


def plan_memory(policy: str, cfg: RuntimeConfig, dims: ModelDims, kv_itemsize: int, rank: int,
                stride_bytes: int) -> MemoryPlan:
    """cfg must already be the policy's effective config (``effective_config``).  A model's sliding-window layers
    take their rings first (runtime/hybrid.py); the policy sizes the global layers in what is left."""
    view = dims.global_view()
    cfg = global_config(cfg, dims, kv_itemsize)
    parts = get(policy).memory_parts(cfg, view, kv_itemsize, rank, stride_bytes) if view.n_layers else {}
    if dims.hybrid:
        parts["window_ring"] = dims.window_ring_bytes(cfg.max_context, kv_itemsize)
    return MemoryPlan(parts, cfg.max_batch)


def global_config(cfg: RuntimeConfig, dims: ModelDims, kv_itemsize: int) -> RuntimeConfig:
    """The config a hybrid model's policy runs its global layers with: the KV budget less the sliding-window rings
    (a policy that fills its budget, arkv, sizes itself to the rest); the same config for other models."""
    if not dims.hybrid or cfg.max_kv_mem_mib is None:
        return cfg
    ring_mib = dims.window_ring_bytes(cfg.max_context, kv_itemsize) * cfg.max_batch / MIB
    if ring_mib >= cfg.max_kv_mem_mib:
        raise BudgetError(f"the sliding-window layers' rings alone need {ring_mib:.1f} MiB of KV memory for "
                          f"max_batch={cfg.max_batch} but max_kv_mem_mib is {cfg.max_kv_mem_mib:g} MiB; raise the budget "
                          "or lower max_batch")
    return cfg.with_fields(max_kv_mem_mib=cfg.max_kv_mem_mib - ring_mib)
