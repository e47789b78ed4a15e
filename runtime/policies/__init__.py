"""The KV policies by name.  Adding one: a module here with a ``PolicySpec`` subclass, and one line below.

Entries are "module:Class" strings, imported on first use (as vLLM registers its offloading specs), so listing
the names costs nothing and a policy's module may use anything below the registry.
"""
from __future__ import annotations

import importlib

from ..config import ConfigError
from .base import BudgetFit, PolicyEnv, PolicySpec

__all__ = ["BudgetFit", "PolicyEnv", "PolicySpec", "register", "unregister", "get", "names", "specs", "reference"]

_REGISTRY: dict[str, PolicySpec | str] = {}


def register(name: str, spec: PolicySpec | type[PolicySpec] | str) -> None:
    """Register ``spec`` (an instance, a class, or "module:Class" imported when first asked for) as ``name``."""
    if isinstance(spec, type):
        spec = spec()
    if isinstance(spec, PolicySpec) and spec.name != name:
        raise ValueError(f"policy {spec.name!r} registered as {name!r}: the names must match")
    _REGISTRY[name] = spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> PolicySpec:
    """The policy called ``name``; an unknown name is a ConfigError listing the known ones."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError(f"unknown policy {name!r}; choose one of {names()}")
    if isinstance(spec, str):
        module, _, cls = spec.partition(":")
        spec = _REGISTRY[name] = getattr(importlib.import_module(module, __name__), cls)()
    return spec


def specs() -> list[PolicySpec]:
    return [get(name) for name in _REGISTRY]


def reference() -> str:
    """The name of the exact policy others are compared with (``full``)."""
    return next(spec.name for spec in specs() if spec.reference)


register("kvswap", ".kvswap:KVSwap")
register("full", ".full:Full")
register("flexgen", ".flexgen:FlexGen")
register("token", ".token:Token")
register("hillinfer", ".hillinfer:HillInfer")
register("arkv", ".arkv:Arkv")
