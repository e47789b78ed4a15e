"""Every sysfs read goes through one root, ``EDGEKV_SYSFS_ROOT`` (default ``/sys``), so the same
code reads a test tree shaped like the real one."""
from __future__ import annotations

import os
from pathlib import Path


def sysfs_root() -> Path:
    return Path(os.environ.get("EDGEKV_SYSFS_ROOT", "/sys"))


def read_int(path: Path) -> int:
    return int(path.read_text().strip())


def read_text(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default
