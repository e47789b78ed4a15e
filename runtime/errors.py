"""Errors the runtime raises that its callers tell apart: a checkpoint that cannot be served, a KV disk that
fails under running sequences, text a tokenizer cannot take.  Their own module: the model loader, the weight
formats, the KV store and the engine all raise them, and callers (the CLI, the server) map them without
importing those modules' internals."""
from __future__ import annotations

import errno

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
DISK_UNWRITABLE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


class ModelError(ValueError):
    """The checkpoint cannot be served; the message says why and what to do."""


class DiskError(OSError):
    """A KV folder cannot hold or give back records: gone, full, not writable, or failing; what asked for them was
    sound.  Its text is the one sentence the log and a client both get (what failed, where, the fix: no
    ``[Errno N]``); ``full`` tells a full disk (space can come back) from a folder someone must repair."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()

    @property
    def full(self) -> bool:
        return self.errno in DISK_FULL_ERRNOS


def disk_fix(errno_: int | None) -> str:
    """What to do about an OSError of a KV folder, by its errno."""
    if errno_ in DISK_FULL_ERRNOS:
        return "free space there or pick another --kv-path"
    if errno_ == errno.EROFS:
        return "remount it read-write or pick another --kv-path"
    if errno_ in DISK_UNWRITABLE_ERRNOS:
        return "make it writable by the server's user or pick another --kv-path"
    return "check the device, then run again"


def unencodable(text: str) -> str | None:
    """Why ``text`` cannot be UTF-8 encoded (a lone surrogate, as JSON's ``"\\ud800"`` decodes to), naming the
    character's position; None when it can be."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"character {exc.start} is a lone surrogate (U+{ord(text[exc.start]):04X}) that UTF-8 cannot "
                "encode; send valid Unicode")
    return None


class RowsFailed(DiskError):
    """A decode step whose KV writes failed for some rows only (each row's records go to its own files): ``rows``
    maps each failed row to its error, and those rows must leave the batch; every other row's step is whole, its
    logits in ``logits`` [rows, V].  A DiskError with the first failed row's errno and sentence: where it escapes,
    the client hears what that row's error says."""

    def __init__(self, rows: dict[int, DiskError]):
        self.first = rows[min(rows)]
        super().__init__(self.first.errno, self.first.strerror)
        self.rows = rows
        self.logits = None  # set by the step that computed them
