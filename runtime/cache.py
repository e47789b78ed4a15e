"""Where edgekv caches what it builds and measures (a module of its own: the native builds need it, and the
checkpoints' module, which also uses it, loads models)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where edgekv caches what it builds and measures: ``$EDGEKV_CACHE``, else ``~/.cache/edgekv``."""
    return Path(os.environ.get("EDGEKV_CACHE") or Path.home() / ".cache" / "edgekv")
