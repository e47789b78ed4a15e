"""edgekv.runtime: the engine that serves a Hugging Face checkpoint with its KV cache on disk."""
from .adapter import LowRankAdapter, build_adapter
from .config import ConfigError, RuntimeConfig
from .disk_store import DiskKVStore, RecordLayout, StoreError
from .engine import Engine, GenerationResult
from .events import StepEvent
from .memory import BudgetError
from .model import SUPPORTED_ARCHITECTURES, ModelError
from .policies import names as _policy_names
from .reader import KVReader, open_reader

POLICIES = _policy_names()  # the built-in policies; runtime.policies.names() also lists ones registered later

__all__ = [
    "Engine", "GenerationResult", "RuntimeConfig", "ConfigError", "POLICIES", "LowRankAdapter", "build_adapter",
    "DiskKVStore", "RecordLayout", "StoreError", "StepEvent", "BudgetError", "SUPPORTED_ARCHITECTURES",
    "ModelError", "KVReader", "open_reader",
]
