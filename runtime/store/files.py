"""Crash-safe files of a local store: atomic replace, temp names that say who owns them, one lock file.

Everything visible under the store's names is complete: blobs and JSON are written to a
``.tmp-<pid>-<rand>`` name, fsynced, then renamed.  A temp file whose process is gone is
debris from a crash and is removed on the next open.
"""
from __future__ import annotations

import fcntl
import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX = ".tmp-"
LOCK_FILE = ".lock"


def tmp_path(folder: Path, suffix: str = "") -> Path:
    return folder / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}"


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so readers see the old or the new contents, never a mix."""
    tmp = tmp_path(path.parent, path.suffix)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj) -> None:
    """``write_atomic`` of ``obj`` as indented JSON: configs, profiles and tables a crash must not leave half written."""
    write_atomic(Path(path), json.dumps(obj, indent=1).encode())


@contextmanager
def locked(root: Path):
    """Exclusive lock of the store across processes (and across threads, each taking its own fd)."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_tmp(path: Path) -> bool:
    """A temp file left by a process that no longer runs (this process's own are in use)."""
    try:
        pid = int(path.name[len(TMP_PREFIX):].split("-", 1)[0])
    except ValueError:
        return True
    return pid != os.getpid() and not pid_alive(pid)
