"""The persistent context store: a context's KV saved once, reused across requests, restarts and devices."""
from .context_store import ChunkRef, ContextStore, StoredPrefix, chain_hash, store_location
from .errors import ChunkCorrupt, ChunkUnavailable, ContextStoreError
from .fingerprint import model_fingerprint
from .http import HttpBackend
from .local import LocalBackend
from .throttle import ThrottledBackend

__all__ = ["ChunkRef", "ContextStore", "StoredPrefix", "chain_hash", "ChunkCorrupt", "ChunkUnavailable", "ContextStoreError",
           "model_fingerprint", "HttpBackend", "LocalBackend", "ThrottledBackend", "store_location"]
