"""The two ways the context store says no: a named problem (with its fix), or bytes it could not read."""
from __future__ import annotations


class ContextStoreError(ValueError):
    """A problem with how the store is used (unknown context, other model, read-only, bad cap, layout); the message says the fix."""


class ChunkUnavailable(OSError):
    """A chunk's bytes could not be read (missing blob, HTTP error, short body, dropped connection, timeout).

    The caller computes that chunk instead: a read never returns partial or foreign bytes.
    """


class ChunkCorrupt(ChunkUnavailable):
    """A chunk's records or trailer failed their checksums: a miss, never KV to use (the store drops it)."""
