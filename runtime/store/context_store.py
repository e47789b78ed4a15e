"""The persistent context store: token chunks of KV (all layers) saved once, matched by prefix.

Folder layout (the same when published over HTTP)::

    store.json          geometry every blob shares: G, align, chunk_tokens
    index.json          chunks {hash: parent, start, n_tokens, bytes, LRU tick} and named contexts, and a copy
                        of the geometry
    contexts/<x>.json   a named context's token ids, fingerprint and chunk hashes
    chunks/<hash>.kv    one token chunk, every layer, layer-major, in the disk policies' records,
                        then a trailer with each record's checksum (runtime/checksum.py)

Hashes are chained (h_0 = sha256(fingerprint || chunk 0 tokens), h_t = sha256(h_{t-1} ||
chunk t tokens)), so equal hashes mean equal model, dtype and whole token prefix, and a prompt
reuses the longest stored prefix chunk by chunk.  Chunk boundaries sit at multiples of
chunk_tokens; only a context's last chunk may be shorter (a multiple of G).  The index keeps
``index ⊆ blobs``: blobs are renamed into place before the index names them, and the index
forgets a blob before it is unlinked.  A record or trailer that fails its checksum is a miss:
the chunk is dropped from the index (and its blob removed), the caller computes it, and the next
save writes it again.

The JSON files carry a checksum and are parsed strictly (store/meta.py); damage there is a miss too,
logged naming the file, never an opaque error:

- index.json damaged: rebuilt from the intact context files (each one's ids give its chunk chain, every
  hash recomputed) and the blobs whose trailer names that chunk (fingerprint, first group, size); chunks
  no context names cannot be placed and are dropped, the LRU order starts afresh (``index ⊆ blobs`` holds).
  Over HTTP nothing can be listed: every prompt is computed until the folder is published again.  A
  sealed index entry that names a path outside the store (or a hash that is not one) is refused by name,
  never followed.
- store.json damaged or missing: its geometry comes back from index.json's copy and is written again;
  with no intact copy either, the error names store.json and the fix.
- contexts/<x>.json damaged: asking for that context names the file and says to save it again; the
  context is dropped, its chunks stay usable as unnamed prefixes.

Format 3 (checksummed metadata) is written; a format-2 store is migrated when opened locally (its JSON
files sealed, store.json last, so a migration cut short runs again; blobs unchanged) and read as it is
over HTTP.  Other formats are refused naming store.json.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checksum import Trailer, TrailerError, record_sums
from ..disk_store import RecordLayout, aligned_zeros
from .errors import ChunkCorrupt, ContextStoreError
from .files import TMP_PREFIX, fsync_dir, locked, stale_tmp, tmp_path, write_atomic
from .fingerprint import describe
from .http import HttpBackend
from .local import LocalBackend
from .meta import (FORMAT, INDEX_FILE, LEGACY_FORMAT, STORE_FILE, Damaged, check_rel, is_count, is_hash, is_time,
                   parse_index, read_file, read_geometry, seal, unseal)

log = logging.getLogger(__name__)

READ_ONLY = "read-only: save to a local --kv-path and publish the folder"
LOCATIONS = "a folder path, file:///folder, http://host/path or https://host/path"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def chain_hash(parent: str, tokens: np.ndarray) -> str:
    return hashlib.sha256(bytes.fromhex(parent) + np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def store_location(location: str | Path) -> str | Path:
    """A store's place as a local Path or an http(s) URL (str).  file:// URLs become their path; any other
    scheme is refused before anything is created (``ftp://x`` would otherwise be the folder ./ftp:/x)."""
    if isinstance(location, Path):
        return location
    found = _SCHEME.match(location)
    if found is None:
        return Path(location)
    scheme = found.group(1).lower()
    if scheme in ("http", "https"):
        return location
    if scheme == "file":
        parts = urllib.parse.urlsplit(location)
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ContextStoreError(f"context store {location!r}: a file:// URL names a folder of this machine "
                                    f"(file:///path/to/store); give {LOCATIONS}")
        return Path(urllib.request.url2pathname(parts.path))
    raise ContextStoreError(f"context store {location!r}: the scheme {scheme}:// is not supported; give {LOCATIONS}")


@dataclass(frozen=True)
class ChunkRef:
    hash: str
    start: int  # first token
    n_tokens: int  # a multiple of G, at most chunk_tokens


@dataclass(frozen=True)
class StoredPrefix:
    n_tokens: int  # tokens [0, n_tokens) are stored
    chunks: list[ChunkRef]  # in token order


def _empty_index() -> dict:
    return {"format": FORMAT, "tick": 0, "chunks": {}, "contexts": {}}


def _slug(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:48].lstrip(".") or "context"
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


class ContextStore:
    def __init__(self, backend, root: Path | None, location: str, fingerprint: dict, layout: RecordLayout,
                 n_layers: int, chunk_tokens: int, max_bytes: int | None):
        self.backend = backend  # reads go through backend.read_range: wrap it (ThrottledBackend) to pace them
        self.root = root  # None: a read-only remote store
        self.location = location
        self.fingerprint = fingerprint
        self.layout = layout
        self.n_layers = n_layers
        self.chunk_tokens = chunk_tokens
        self.max_bytes = max_bytes
        self._mutex = threading.RLock()
        self._index = _empty_index()
        self._stamp = None  # index.json's (inode, mtime, size) when last loaded
        self._lengths: dict[str, set[int]] = {}  # parent hash -> chunk lengths stored under it
        self._trailers: dict[str, np.ndarray] = {}  # chunk hash -> its records' checksums [n_layers, n_groups]
        self._legacy = False  # a format-2 store: its JSON files carry no checksum yet
        self._refused: dict[str, str] = {}  # context name -> why its entry was refused (asking for it says so)
        self._lost: list[str] = []  # damage that dropped contexts whose names are unknown

    # ---- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, location: str | Path, fingerprint: dict, layout: RecordLayout, n_layers: int,
             chunk_tokens: int = 512, max_bytes: int | None = None, timeout_s: float = 30.0) -> "ContextStore":
        """A local folder (created if missing; ``file://`` URLs too) or an http(s):// URL of a published one
        (read-only)."""
        loc = store_location(location)
        _check_args(fingerprint, layout, n_layers, chunk_tokens, max_bytes)
        if isinstance(loc, str):
            store = cls(HttpBackend(loc, timeout_s), None, loc, fingerprint, layout, n_layers, chunk_tokens, max_bytes)
            found, note = read_geometry(store.backend, loc)
            if found is None:
                raise ContextStoreError(f"no context store at {loc} (no {STORE_FILE}); publish a store folder there")
            if note:
                log.warning("%s", note)
            store._check_geometry(found)
            store.refresh()
            return store
        root = loc
        for sub in ("chunks", "contexts"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        store = cls(LocalBackend(root, layout.align_bytes), root, str(root), fingerprint, layout, n_layers,
                    chunk_tokens, max_bytes)
        with locked(root):
            found, note = read_geometry(store.backend, str(root))
            if found is not None:
                store._check_geometry(found)
            if found is None or note:
                if note:
                    log.warning("%s: %s written again", note, STORE_FILE)
                write_atomic(root / STORE_FILE, seal(store._geometry(), indent=1))
            store._refresh()
            if store._legacy:
                store._migrate()
            store._clean()
        return store

    @staticmethod
    def geometry_at(location: str | Path, timeout_s: float = 30.0) -> dict | None:
        """The geometry (G, align, chunk_tokens) of the store at ``location``; None when there is none yet.

        An engine opens an existing store with its geometry, so a config with another G still reuses it.
        """
        loc = store_location(location)
        backend = HttpBackend(loc, timeout_s) if isinstance(loc, str) else LocalBackend(loc)
        return read_geometry(backend, str(loc))[0]

    @classmethod
    def open_existing(cls, location: str | Path, timeout_s: float = 30.0) -> "ContextStore":
        """An existing store opened with no model, to list and remove contexts (``edgekv context list|rm``);
        it matches no prompt (its fingerprint is no model's)."""
        found = cls.geometry_at(location, timeout_s)
        if found is None:
            raise ContextStoreError(f"no context store at {location} (no {STORE_FILE}); save a context there first "
                                    "(edgekv context save NAME --model M --kv-path P FILE)")
        layout = RecordLayout(found["group_tokens"], 1, 1, torch.float32, found["align_bytes"])
        return cls.open(location, {"id": "00"}, layout, 1, found["chunk_tokens"], timeout_s=timeout_s)

    def _geometry(self) -> dict:
        return {"format": FORMAT, "group_tokens": self.layout.group_tokens, "align_bytes": self.layout.align_bytes,
                "chunk_tokens": self.chunk_tokens}

    def _check_geometry(self, found: dict) -> None:
        """The store's geometry against this engine's (its format was checked when it was read, a format-2 one
        is read without checksums)."""
        want = {k: v for k, v in self._geometry().items() if k != "format"}
        if any(found.get(k) != v for k, v in want.items()):
            def show(g):
                return ", ".join(f"{k}={g.get(k)}" for k in want)
            raise ContextStoreError(
                f"layout mismatch: the context store at {self.location} holds {show(found)}; this engine uses "
                f"{show(want)}: run with the store's group size and chunk size, or use another --kv-path")
        self._legacy = found["format"] == LEGACY_FORMAT  # its JSON files carry no checksum yet

    def _migrate(self) -> None:
        """Under the lock: seal a format-2 store's JSON files (blobs unchanged); store.json goes last, so a
        migration cut short runs again (a file sealed already reads as well)."""
        for name, c in list(self._index["contexts"].items()):
            try:
                body = self._context_body(c["file"], read_file(self.backend, self.location, c["file"]), name, c)
            except Damaged as exc:
                log.warning("context store %s: %s is damaged (%s): context %r dropped, save it again",
                            self.location, c["file"], exc, name)
                del self._index["contexts"][name]
                continue
            write_atomic(self._file(c["file"]), seal({**body, "saved_at": c["saved_at"]}))
        self._legacy = False
        self._write_index()
        write_atomic(self.root / STORE_FILE, seal(self._geometry(), indent=1))
        log.info("context store %s: format %d metadata sealed (format %d)", self.location, LEGACY_FORMAT, FORMAT)

    def _file(self, rel: str) -> Path:
        return self.root / check_rel(rel)

    # ---- the index ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _current(self):
        """Hold the store: this process's mutex and, for a local store, the store's lock with the index reloaded
        if another process replaced it (a damaged one rebuilt and written)."""
        with self._mutex:
            if self.root is None:
                yield
                return
            with locked(self.root):
                self._refresh()
                yield

    def refresh(self) -> None:
        """Pick up what other processes saved (local), or fetch the published index again (remote)."""
        with self._current():
            if self.root is None:
                self._set_index(self._load_index()[0])

    def _refresh(self) -> None:
        """Local, under the lock: reload index.json if another process replaced it.  Remote: the snapshot stays
        until refresh()."""
        if self.root is None:
            return
        try:
            st = (self.root / INDEX_FILE).stat()
            stamp = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        except FileNotFoundError:
            stamp = "missing"
        if stamp != self._stamp:
            index, repaired = self._load_index()
            self._set_index(index)
            self._stamp = stamp
            if repaired:
                self._write_index()

    def _load_index(self) -> tuple[dict, bool]:
        """index.json checked: (the index, whether it was repaired and must be written again)."""
        self._refused, self._lost = {}, []
        data = read_file(self.backend, self.location, INDEX_FILE)
        if data is None:
            return _empty_index(), False
        try:
            body, sealed = unseal(data)
            if not (sealed or self._legacy):
                raise Damaged("it carries no checksum")
            return self._checked_index(body)
        except Damaged as exc:
            why = f"{self.location}/{INDEX_FILE} is damaged ({exc})"
        if self.root is None:
            self._lost.append(f"{why}: publish the store folder again")
            log.warning("context store: %s: every prompt is computed; publish the store folder again", why)
            return _empty_index(), False
        index = self._rebuild()
        self._lost.append(f"{why}; it was rebuilt from the context files")
        log.warning("context store: %s: rebuilt from %d intact context files (%d chunks); chunks no context names "
                    "are dropped", why, len(index["contexts"]), len(index["chunks"]))
        return index, True

    def _checked_index(self, body: dict) -> tuple[dict, bool]:
        """The index in ``body`` with every entry that cannot be right refused by name (logged; a refused context
        says why when asked for); Damaged when its structure is not an index of this store."""
        index, contexts, chunks = parse_index(body, self._geometry(), self._legacy)
        for h, why in chunks.items():
            log.warning("context store %s: %s names chunk %r, refused (%s): not read, it is computed instead",
                        self.location, INDEX_FILE, h[:80], why)
        for name, why in contexts.items():
            self._refused[name] = (f"context {name!r} in {self.location}/{INDEX_FILE} is refused: {why}; nothing it "
                                   f"names is read or removed: save the context again (edgekv context save {name} ...)")
            log.warning("context store: %s", self._refused[name])
        return index, bool(contexts or chunks)

    def _context_body(self, rel: str, data: bytes | None, name: str | None = None, entry: dict | None = None) -> dict:
        """A context file checked: sealed, its ids whole numbers whose chunk chain gives its hashes, and (given
        its index entry) the context that entry describes; Damaged says what is wrong."""
        if data is None:
            raise Damaged("it is missing")
        body, sealed = unseal(data)
        keys = {"name", "ids", "fingerprint", "chunks", "saved_at"}
        if not (sealed and set(body) == keys or self._legacy and set(body) | {"saved_at"} == keys):
            raise Damaged("it carries no checksum" if set(body) == keys else f"its keys are {sorted(body)}")
        ids, fp = body["ids"], body["fingerprint"]
        if not (isinstance(body["name"], str) and isinstance(ids, list) and all(is_count(t) and t < 2**63 for t in ids)
                and isinstance(fp, dict) and is_hash(fp.get("id")) and is_time(body.get("saved_at", 0))):
            raise Damaged("its name, ids, fingerprint or saved_at is malformed")
        if body["chunks"] != [ref.hash for ref, _ in self._chain(fp["id"], np.asarray(ids, dtype="<i8"))]:
            raise Damaged("its chunk hashes are not those of its token ids")
        if entry is not None and (body["name"] != name or len(ids) != entry["tokens"]
                                  or body["chunks"] != entry["chunks"] or fp["id"] != entry["fingerprint"]["id"]):
            raise Damaged(f"it is not the context {name!r} that {INDEX_FILE} describes")
        return body

    def _chain(self, root_id: str, arr: np.ndarray) -> list[tuple[ChunkRef, str]]:
        """(chunk, its parent hash) for the stored part of ``arr``: floor(len/G)*G tokens in chunk_tokens pieces."""
        n, out, parent = len(arr) // self.layout.group_tokens * self.layout.group_tokens, [], root_id
        for start in range(0, n, self.chunk_tokens):
            stop = min(start + self.chunk_tokens, n)
            ref = ChunkRef(chain_hash(parent, arr[start:stop]), start, stop - start)
            out.append((ref, parent))
            parent = ref.hash
        return out

    def _rebuild(self) -> dict:
        """Under the lock: an index from what can be checked.  Each intact context file (the newest of a name)
        gives its chunk chain; a chunk is indexed where its blob's trailer says it holds that chunk."""
        newest: dict[str, tuple[str, dict]] = {}
        for path in sorted((self.root / "contexts").glob("*.json")):
            rel = f"contexts/{path.name}"
            if path.name.startswith(TMP_PREFIX):
                continue
            try:
                body = self._context_body(rel, path.read_bytes())
            except Damaged as exc:
                self._lost.append(f"{self.location}/{rel} was damaged ({exc}) and dropped")
                log.warning("context store %s: %s is damaged (%s): that context is dropped, save it again",
                            self.location, rel, exc)
                continue
            if body["name"] not in newest or body.get("saved_at", 0) > newest[body["name"]][1].get("saved_at", 0):
                newest[body["name"]] = (rel, body)
        index, g = _empty_index(), self.layout.group_tokens
        for name, (rel, body) in sorted(newest.items()):
            fp, saved_at = body["fingerprint"], body.get("saved_at", 0.0)
            ids = np.asarray(body["ids"], dtype="<i8")
            for ref, parent in self._chain(fp["id"], ids):
                size = self._blob_size(ref, fp)
                if size is not None:
                    index["chunks"][ref.hash] = {"fp": fp["id"], "parent": parent, "start": ref.start,
                                                 "n_tokens": ref.n_tokens, "bytes": size, "tick": 0,
                                                 "last_used": saved_at}
            index["contexts"][name] = {"file": rel, "tokens": len(ids), "stored_tokens": len(ids) // g * g,
                                       "chunks": body["chunks"], "fingerprint": fp, "saved_at": saved_at}
        return index

    def _blob_size(self, ref: ChunkRef, fp: dict) -> int | None:
        """The size of ``ref``'s blob where its trailer (own checksum intact) names that model and first group and
        its size is its records' and trailer's; None otherwise (missing, damaged, another chunk)."""
        g, align = self.layout.group_tokens, self.layout.align_bytes
        n_layers = fp.get("n_layers", self.n_layers if fp["id"] == self.fingerprint["id"] else None)
        if not is_count(n_layers, 1):
            return None
        n_groups = ref.n_tokens // g
        tail = Trailer.nbytes(n_layers, n_groups, align)
        try:
            with open(self.backend.blob_path(ref.hash), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(size - tail, 0))
                trailer = Trailer.parse(f.read(tail), n_layers, n_groups)
        except (OSError, TrailerError):
            return None
        stride = -(-trailer.record_bytes // align) * align
        fits = (trailer.fingerprint == fp["id"] and trailer.first_group == ref.start // g
                and size == n_layers * n_groups * stride + tail)
        return size if fits else None

    def _set_index(self, index: dict) -> None:
        self._index = index
        self._lengths = {}
        for entry in index["chunks"].values():
            self._lengths.setdefault(entry["parent"], set()).add(entry["n_tokens"])

    def _write_index(self) -> None:
        """Under the lock: replace index.json atomically (sealed, with a copy of the geometry), remember its stamp."""
        self._index["format"] = FORMAT
        write_atomic(self.root / INDEX_FILE, seal({**self._index, "geometry": self._geometry()}))
        st = (self.root / INDEX_FILE).stat()
        self._stamp = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        self._set_index(self._index)

    def _clean(self) -> None:
        """Under the lock, at open: forget entries without a blob, remove crash debris and orphans."""
        chunks, contexts = self._index["chunks"], self._index["contexts"]
        for folder in (self.root, self.root / "chunks", self.root / "contexts"):
            for path in folder.iterdir():
                if path.name.startswith(TMP_PREFIX) and stale_tmp(path):
                    path.unlink(missing_ok=True)
        blobs = {p.stem: p for p in (self.root / "chunks").glob("*.kv") if not p.name.startswith(TMP_PREFIX)}
        missing = [h for h in chunks if h not in blobs]
        for h in missing:
            del chunks[h]
        for h, path in blobs.items():
            if h not in chunks:
                path.unlink(missing_ok=True)
        named = {Path(c["file"]).name for c in contexts.values()}
        for path in (self.root / "contexts").glob("*.json"):
            if path.name not in named and not path.name.startswith(TMP_PREFIX):
                path.unlink(missing_ok=True)
        if missing:
            log.warning("context store %s: %d index entries had no blob and were dropped", self.root, len(missing))
            self._write_index()

    def _touch(self, hashes: list[str]) -> None:
        self._index["tick"] += 1
        now = time.time()
        for h in hashes:
            self._index["chunks"][h].update(tick=self._index["tick"], last_used=now)

    def _read_only(self) -> ContextStoreError:
        return ContextStoreError(f"the context store at {self.location} is {READ_ONLY}")

    # ---- matching and reading ---------------------------------------------------------------------

    def match(self, ids) -> StoredPrefix | None:
        """The longest stored prefix of ``ids`` for this fingerprint, ending at or before len(ids) - 1.

        The last prompt token is always computed (it gives the logits).  Matched chunks become
        the most recently used (local stores; a remote one is read-only).
        """
        arr = np.asarray(ids, dtype="<i8").reshape(-1)
        g = self.layout.group_tokens
        limit = (len(arr) - 1) // g * g
        if limit <= 0:
            return None
        with self._current():
            refs = self._walk(arr, limit)
            if refs and self.root is not None:
                self._touch([r.hash for r in refs])
                self._write_index()
        if not refs:
            return None
        return StoredPrefix(refs[-1].start + refs[-1].n_tokens, refs)

    def _walk(self, arr: np.ndarray, limit: int) -> list[ChunkRef]:
        chunks = self._index["chunks"]
        parent, pos, refs = self.fingerprint["id"], 0, []
        while pos < limit:
            found = None
            for n in sorted(self._lengths.get(parent, ()), reverse=True):
                if pos + n <= limit:
                    h = chain_hash(parent, arr[pos : pos + n])
                    if h in chunks:
                        found = ChunkRef(h, pos, n)
                        break
            if found is None:
                break
            refs.append(found)
            parent, pos = found.hash, pos + found.n_tokens
            if found.n_tokens < self.chunk_tokens:  # a partial chunk ends its context
                break
        return refs

    def read_bytes_per_chunk_layer(self, ref: ChunkRef) -> int:
        return ref.n_tokens // self.layout.group_tokens * self.layout.stride_bytes

    def read(self, ref: ChunkRef, layer: int, out: np.ndarray) -> None:
        """Fill ``out`` (aligned uint8 [n_groups, stride], see aligned_zeros) with the records of one (chunk, layer)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.n_layers - 1}")
        nbytes = self.read_bytes_per_chunk_layer(ref)
        if out.nbytes != nbytes:
            raise ValueError(f"out holds {out.nbytes} bytes; chunk {ref.hash[:12]} needs "
                             f"[{ref.n_tokens // self.layout.group_tokens}, {self.layout.stride_bytes}] = {nbytes}")
        sums = self.record_sums(ref)
        self.backend.read_range(ref.hash, layer * nbytes, nbytes, out)
        first = ref.start // self.layout.group_tokens
        groups = np.arange(first, first + ref.n_tokens // self.layout.group_tokens)
        found = record_sums(out, self.layout.record_bytes, layer, groups)
        bad = np.flatnonzero(found != sums[layer])
        if len(bad):
            self._corrupt(ref, f"layer {layer} group {int(groups[bad[0]])} (record {layer * len(groups) + int(bad[0])}) "
                               f"and {len(bad) - 1} more failed their checksums")

    def record_sums(self, ref: ChunkRef) -> np.ndarray:
        """The checksums [n_layers, n_groups] of a chunk's records, from its trailer (read once, then kept).
        A damaged trailer, or one of another model or layout, makes the chunk a miss (ChunkCorrupt)."""
        with self._mutex:
            if ref.hash in self._trailers:
                return self._trailers[ref.hash]
        n_groups = ref.n_tokens // self.layout.group_tokens
        nbytes = Trailer.nbytes(self.n_layers, n_groups, self.layout.align_bytes)
        out = aligned_zeros((nbytes,), self.layout.align_bytes)
        self.backend.read_range(ref.hash, self._records_bytes(ref.n_tokens), nbytes, out)
        try:
            trailer = Trailer.unpack(out, self.n_layers, n_groups, self.layout.record_bytes,
                                     ref.start // self.layout.group_tokens, self.fingerprint["id"])
        except TrailerError as exc:
            self._corrupt(ref, str(exc))
        with self._mutex:
            if len(self._trailers) >= 4096:
                self._trailers.pop(next(iter(self._trailers)))
            self._trailers[ref.hash] = trailer.sums
        return trailer.sums

    def _corrupt(self, ref: ChunkRef, what: str):
        """A chunk whose bytes are not those saved is a miss: forget it (local stores), log, raise ChunkCorrupt."""
        log.warning("context store %s: chunk %s (tokens %d..%d) is damaged (%s): dropped, it is computed instead",
                    self.location, ref.hash[:16], ref.start, ref.start + ref.n_tokens, what)
        self.forget_chunk(ref.hash)
        raise ChunkCorrupt(f"chunk {ref.hash[:16]} of the context store at {self.location} is damaged: {what}")

    def forget_chunk(self, h: str) -> None:
        """Drop one chunk from the index, then remove its blob (a damaged one: the next save writes it again)."""
        with self._mutex:
            self._trailers.pop(h, None)
            if self.root is None:
                return
            with self._current():
                if self._index["chunks"].pop(h, None) is None:
                    return
                self._write_index()
            self.backend.blob_path(h).unlink(missing_ok=True)

    # ---- saving -------------------------------------------------------------------------------

    def _records_bytes(self, n_tokens: int) -> int:
        return self.n_layers * n_tokens // self.layout.group_tokens * self.layout.stride_bytes

    def _blob_bytes(self, n_tokens: int) -> int:
        n_groups = n_tokens // self.layout.group_tokens
        return self._records_bytes(n_tokens) + Trailer.nbytes(self.n_layers, n_groups, self.layout.align_bytes)

    def _check_kv(self, kv, n: int) -> None:
        lay = self.layout
        if len(kv) < self.n_layers:
            raise ContextStoreError(f"layout mismatch: kv has {len(kv)} layers, the store was opened for {self.n_layers}")
        for layer in range(self.n_layers):
            for t in kv[layer]:
                if t.dim() != 3 or t.shape[0] != lay.n_kv_heads or t.shape[2] != lay.head_dim or t.shape[1] < n \
                        or t.dtype != lay.dtype:
                    raise ContextStoreError(
                        f"layout mismatch: layer {layer} KV is {t.dtype} {tuple(t.shape)}; the store's records need "
                        f"{lay.dtype} [{lay.n_kv_heads}, >={n}, {lay.head_dim}]")

    def _write_blob(self, ref: ChunkRef, kv) -> Path:
        """Every layer's records of one token chunk into a fsynced temp file (renamed by the caller)."""
        tmp = tmp_path(self.root / "chunks", ".kv")
        stop = ref.start + ref.n_tokens
        first = ref.start // self.layout.group_tokens
        groups = np.arange(first, first + ref.n_tokens // self.layout.group_tokens)
        sums = np.zeros((self.n_layers, len(groups)), dtype=np.uint32)
        try:
            with open(tmp, "wb") as f, torch.no_grad():
                for layer in range(self.n_layers):
                    k, v = kv[layer]
                    records = self.layout.pack(k[:, ref.start : stop], v[:, ref.start : stop])
                    sums[layer] = record_sums(records, self.layout.record_bytes, layer, groups)
                    f.write(memoryview(records.reshape(-1)))
                f.write(Trailer(self.fingerprint["id"], self.layout.record_bytes, first, sums).pack(self.layout.align_bytes))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, ids, kv, name: str | None = None) -> StoredPrefix:
        """Save the KV of floor(len(ids)/G)*G tokens, writing only the chunks not already stored.

        kv: per layer (k, v) [H_kv, >=n, d] post-RoPE, in the layout's dtype (a PrefixKV.kv
        tensor indexes the same way).  ``name`` records the token ids too (context_ids).  Under
        a cap, only the prefix of chunks that fits it is kept; older chunks are evicted LRU.
        """
        if self.root is None:
            raise self._read_only()
        arr = np.asarray(ids, dtype="<i8").reshape(-1)
        n = len(arr) // self.layout.group_tokens * self.layout.group_tokens
        self._check_kv(kv, n)
        chain = self._chain(self.fingerprint["id"], arr)
        refs, parents = [ref for ref, _ in chain], {ref.hash: parent for ref, parent in chain}
        all_hashes = [r.hash for r in refs]
        if self.max_bytes is not None:
            fits, total = 0, 0
            while fits < len(refs) and total + self._blob_bytes(refs[fits].n_tokens) <= self.max_bytes:
                total += self._blob_bytes(refs[fits].n_tokens)
                fits += 1
            if fits < len(refs):
                log.warning("context store cap %d B holds %d of %d chunks of this context; the rest is not saved",
                            self.max_bytes, fits, len(refs))
                refs = refs[:fits]
        with self._mutex:
            with self._current():
                missing = [r for r in refs if r.hash not in self._index["chunks"]]
            written: dict[str, Path] = {}
            try:
                for r in missing:  # outside the lock: other processes keep matching meanwhile
                    written[r.hash] = self._write_blob(r, kv)
                with self._current():
                    chunks = self._index["chunks"]
                    for r in missing:
                        tmp = written.pop(r.hash)
                        if r.hash in chunks:  # another process saved it meanwhile
                            tmp.unlink()
                            continue
                        os.replace(tmp, self.backend.blob_path(r.hash))
                        chunks[r.hash] = {"fp": self.fingerprint["id"], "parent": parents[r.hash], "start": r.start,
                                          "n_tokens": r.n_tokens, "bytes": self._blob_bytes(r.n_tokens),
                                          "tick": 0, "last_used": 0.0}
                    if missing:
                        fsync_dir(self.root / "chunks")
                    self._touch([r.hash for r in refs])
                    replaced = self._record_context(name, arr, all_hashes, n) if name is not None else None
                    victims = self._evict({r.hash for r in refs})
                    self._write_index()
                    if replaced is not None:  # the index names the new file now: the old one is nobody's
                        self._file(replaced).unlink(missing_ok=True)
                for h in victims:
                    self.backend.blob_path(h).unlink(missing_ok=True)
            finally:
                for tmp in written.values():
                    tmp.unlink(missing_ok=True)
        return StoredPrefix(refs[-1].start + refs[-1].n_tokens if refs else 0, refs)

    def _record_context(self, name: str, arr: np.ndarray, hashes: list[str], n_stored: int) -> str | None:
        """Write the context's ids to a file of this save's own (a kill before the index names it leaves the old
        entry and its old file intact; the open-time clean-up drops the new one); returns the file it replaces."""
        rel, now = f"contexts/{_slug(name)}-{uuid.uuid4().hex[:8]}.json", time.time()
        body = {"name": name, "ids": arr.tolist(), "fingerprint": self.fingerprint, "chunks": hashes, "saved_at": now}
        write_atomic(self.root / rel, seal(body))
        old = self._index["contexts"].get(name, {}).get("file")
        self._index["contexts"][name] = {"file": rel, "tokens": len(arr), "stored_tokens": n_stored, "chunks": hashes,
                                         "fingerprint": self.fingerprint, "saved_at": now}
        self._refused.pop(name, None)
        return old if old != rel else None

    def _evict(self, protected: set[str]) -> list[str]:
        """Drop least-recently-used chunks (later ones of a tie first) until the cap holds."""
        if self.max_bytes is None:
            return []
        chunks = self._index["chunks"]
        total = sum(e["bytes"] for e in chunks.values())
        order = sorted((e["tick"], -e["start"], h) for h, e in chunks.items() if h not in protected)
        victims = []
        for _, _, h in order:
            if total <= self.max_bytes:
                break
            total -= chunks.pop(h)["bytes"]
            victims.append(h)
        return victims

    # ---- named contexts -----------------------------------------------------------------------

    def contexts(self) -> list[dict]:
        """Every named context, of any fingerprint; ``complete`` is false once a chunk was evicted."""
        with self._current():
            chunks = self._index["chunks"]
            out = []
            for name, c in sorted(self._index["contexts"].items()):
                usable = 0
                for h in c["chunks"]:
                    if h not in chunks:
                        break
                    usable += chunks[h]["n_tokens"]
                present = [chunks[h] for h in c["chunks"] if h in chunks]
                out.append({"name": name, "tokens": c["tokens"], "usable_tokens": usable,
                            "bytes": sum(e["bytes"] for e in present), "fingerprint": c["fingerprint"],
                            "saved_at": c["saved_at"], "last_used": max([e["last_used"] for e in present] + [c["saved_at"]]),
                            "complete": len(present) == len(c["chunks"])})
            return out

    def _context(self, name: str) -> dict:
        c = self._index["contexts"].get(name)
        if c is None:
            if name in self._refused:
                raise ContextStoreError(self._refused[name])
            known = ", ".join(sorted(self._index["contexts"])) or "none"
            raise ContextStoreError(f"no saved context named {name!r} in {self.location}; saved contexts: {known}"
                                    + "".join(f"; {lost}" for lost in self._lost))
        return c

    def context_ids(self, name: str) -> list[int]:
        """The token ids of a named context saved by this model in this dtype."""
        with self._current():
            c = self._context(name)
        if c["fingerprint"].get("id") != self.fingerprint["id"]:
            raise ContextStoreError(
                f"context {name!r} was saved by {describe(c['fingerprint'])}; this engine runs "
                f"{describe(self.fingerprint)}: refused, not used (KV of other weights or another dtype); "
                f"save it again with this model")
        data = read_file(self.backend, self.location, c["file"])
        if data is None:
            raise ContextStoreError(f"context {name!r}: {c['file']} is missing from {self.location}; save it again")
        try:
            return self._context_body(c["file"], data, name, c)["ids"]
        except Damaged as exc:
            why = (f"context {name!r}: {self.location}/{c['file']} is damaged ({exc}): the context is dropped (its "
                   f"chunks stay usable as prefixes); save it again (edgekv context save {name} ...)")
        log.warning("context store: %s", why)
        self._drop_context(name, c["file"], why)
        raise ContextStoreError(why)

    def _drop_context(self, name: str, rel: str, why: str) -> None:
        """Forget a context whose file is damaged (local stores: its entry and its file); asking for it says ``why``."""
        with self._current():
            if self.root is not None and self._index["contexts"].get(name, {}).get("file") == rel:
                del self._index["contexts"][name]
                self._write_index()
                self._file(rel).unlink(missing_ok=True)
            self._refused[name] = why

    def remove(self, name: str) -> None:
        """Forget a named context and the chunks no other named context uses."""
        if self.root is None:
            raise self._read_only()
        with self._mutex:
            with self._current():
                if name in self._refused and name not in self._index["contexts"]:
                    log.warning("context store: %s; %s no longer lists it", self._refused.pop(name), INDEX_FILE)
                    return
                c = self._context(name)
                del self._index["contexts"][name]
                shared = {h for other in self._index["contexts"].values() for h in other["chunks"]}
                victims = [h for h in c["chunks"] if h in self._index["chunks"] and h not in shared]
                for h in victims:
                    del self._index["chunks"][h]
                self._write_index()
                self._file(c["file"]).unlink(missing_ok=True)
            for h in victims:
                self.backend.blob_path(h).unlink(missing_ok=True)

    def remove_all(self) -> None:
        """Empty the store: every chunk and named context, of every fingerprint."""
        if self.root is None:
            raise self._read_only()
        with self._mutex:
            with self._current():
                victims = list(self._index["chunks"])
                files = [c["file"] for c in self._index["contexts"].values()]
                self._index = {**_empty_index(), "tick": self._index["tick"]}
                self._write_index()
                for rel in files:
                    self._file(rel).unlink(missing_ok=True)
            for h in victims:
                self.backend.blob_path(h).unlink(missing_ok=True)

    @property
    def total_bytes(self) -> int:
        with self._current():
            return sum(e["bytes"] for e in self._index["chunks"].values())


def _check_args(fingerprint: dict, layout: RecordLayout, n_layers: int, chunk_tokens: int, max_bytes: int | None) -> None:
    g = layout.group_tokens
    if chunk_tokens < g or chunk_tokens % g:
        raise ContextStoreError(f"chunk_tokens={chunk_tokens} must be a positive multiple of the group size G={g}")
    try:
        bytes.fromhex(fingerprint["id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ContextStoreError(f"fingerprint needs a hex 'id' (model_fingerprint(model)), got {fingerprint!r}") from exc
    dtype = str(layout.dtype).removeprefix("torch.")
    want = {"n_layers": n_layers, "n_kv_heads": layout.n_kv_heads, "head_dim": layout.head_dim, "dtype": dtype}
    wrong = {k: (fingerprint[k], v) for k, v in want.items() if k in fingerprint and fingerprint[k] != v}
    if wrong:
        detail = ", ".join(f"{k}: model {a} vs layout {b}" for k, (a, b) in wrong.items())
        raise ContextStoreError(f"layout mismatch between the model fingerprint and the record layout ({detail}); "
                                f"build the layout from this model")
    chunk_bytes = n_layers * chunk_tokens // g * layout.stride_bytes + Trailer.nbytes(n_layers, chunk_tokens // g, layout.align_bytes)
    if max_bytes is not None and max_bytes < chunk_bytes:
        raise ContextStoreError(f"context store cap {max_bytes} B is smaller than one chunk ({chunk_bytes} B = "
                                f"{n_layers} layers x {chunk_tokens} tokens); raise the cap or lower chunk_tokens")
