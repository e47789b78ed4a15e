"""What a KV policy is to the rest of the code: its traits, its effective config, its memory, how it is built.

A ``PolicySpec`` is the unit a newcomer reads and a contributor adds: one module per policy under
``runtime/policies/`` and one registry line in its ``__init__``.  The engine builds it, the memory plan sizes
it, the solver, bench and eval turn a KV budget into its configuration, and the CLI and server list it, all
through the registry, never through its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

from ..config import RuntimeConfig
from ..kernels import Backend, resolve_backend
from ..kv_policy import KVPolicy
from ..model import DecoderModel, ModelDims


@dataclass
class PolicyEnv:
    """What building a policy may use, supplied by whoever runs it (the engine)."""

    model: DecoderModel
    kv_paths: list[Path]
    reader: object | None  # a runtime.reader.KVReader (disk policies)
    scorer: object | None  # an in-storage scorer (runtime.scoring.InStorageScorer), hillinfer's
    adapter_for: Callable[[RuntimeConfig], object | None]  # the calibrated low-rank adapter for a config, or None
    rank_for: Callable[[RuntimeConfig], int]  # the K_lr rank a config runs with
    on_select: Callable | None = None  # on_select(layer, groups [B, M], valid [B, M]): every step's picks
    backend: Backend | None = None  # what the policy's operations run on (runtime/kernels.py); None: the model device's

    def __post_init__(self):
        if self.backend is None:
            self.backend = resolve_backend(self.model.device)


class BudgetFit:
    """How a caller (bench, eval, solver) turns a KV budget into a disk geometry; a policy says which it wants.

    ``tuned`` the caller's best geometry for the budget (the solver's, or the quality rule's); ``fixed`` the
    largest (sigma, M, C) at a given G with or without a reuse buffer; both None when nothing fits.
    ``largest_group_tokens`` the G a policy reading whole layers uses.  ``budget_mib`` the budget itself."""

    def __init__(self, budget_mib: float | None = None, largest_group_tokens: int | None = None):
        self.budget_mib, self.largest_group_tokens = budget_mib, largest_group_tokens

    def tuned(self) -> dict | None:
        raise NotImplementedError

    def fixed(self, G: int, reuse: bool) -> dict | None:
        raise NotImplementedError

    @staticmethod
    def geometry(fit, reuse: bool | None = None) -> dict | None:
        """The config fields of a solver fit (install.solver's MemoryFit or Solution); None stays None."""
        if fit is None:
            return None
        return {"G": fit.G, "M": fit.M, "C": fit.C, "sigma": fit.sigma, "reuse": fit.reuse if reuse is None else reuse}


class PolicySpec:
    """One KV policy.  Its name and traits are given on its class line
    (``class Full(PolicySpec, name="full", on_disk=False, reference=True, budgeted=False)``), what it is in its
    docstring; the hooks below have defaults most policies keep."""

    name: ClassVar[str] = ""
    on_disk: ClassVar[bool] = True  # KV records on disk: needs KV folder(s) and a reader
    predicts: ClassVar[bool] = False  # a low-rank K cache predicts the next layer's picks (adapter files apply)
    selects: ClassVar[bool] = False  # attends to the groups it picks: M, sigma, S and W apply
    reference: ClassVar[bool] = False  # attends to every token exactly: what the others are compared with
    budgeted: ClassVar[bool] = True  # sized by a KV budget (bench and eval budgets apply)
    reuses: ClassVar[bool] = False  # keeps a reuse buffer of C slots per layer when the config asks for one
    group_tokens: ClassVar[int | None] = None  # a fixed G (token: 1), None: the config's

    def __init_subclass__(cls, name: str | None = None, **traits):
        unknown = sorted(set(traits) - set(TRAITS))
        if unknown:
            raise TypeError(f"policy {name or cls.__name__}: unknown trait(s) {unknown}; traits: {TRAITS}")
        super().__init_subclass__()
        if name is not None:
            cls.name = name
        for trait, value in traits.items():
            setattr(cls, trait, value)

    @property
    def tunable(self) -> bool:
        """Its geometry under a budget is the caller's tuned choice (the solver's, or the quality rule's)."""
        return self.on_disk and self.selects and self.reuses and self.group_tokens is None

    def effective_config(self, cfg: RuntimeConfig) -> RuntimeConfig:
        """The parameters this policy runs with, given the deployed ones (e.g. token: G = 1)."""
        return cfg.within_context()

    def memory_parts(self, cfg: RuntimeConfig, dims: ModelDims, kv_itemsize: int, rank: int,
                     stride_bytes: int) -> dict[str, int]:
        """Resident KV bytes per sequence, by part; ``cfg`` is already effective."""
        raise NotImplementedError

    def build(self, env: PolicyEnv, batch: int, cfg: RuntimeConfig) -> KVPolicy:
        """The runtime object for ``batch`` sequences; ``cfg`` is already effective."""
        raise NotImplementedError

    def budget_geometry(self, fit: BudgetFit) -> dict | None:
        """The config fields a KV budget sets for this policy (None: nothing fits).  In memory: the budget itself;
        on disk, selecting: the caller's tuned geometry, or the fixed G and reuse this policy needs; reading
        whole layers: the largest G."""
        if not self.on_disk:
            return {"max_kv_mem_mib": fit.budget_mib} if self.budgeted else {}
        if not self.selects:
            return {"G": fit.largest_group_tokens, "reuse": False} if fit.largest_group_tokens else {"reuse": False}
        geometry = fit.tuned() if self.tunable else fit.fixed(self.group_tokens, reuse=self.reuses)
        return None if geometry is None else {**geometry, "max_kv_mem_mib": fit.budget_mib}


TRAITS = ("on_disk", "predicts", "selects", "reference", "budgeted", "reuses", "group_tokens")
