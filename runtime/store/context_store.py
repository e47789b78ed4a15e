"""The persistent context store: token chunks of KV (all layers) saved once, matched by prefix.

Folder layout (the same when published over HTTP)::

    store.json          geometry every blob shares: G, align, chunk_tokens
    index.json          chunks {hash: parent, start, n_tokens, bytes, LRU tick} and named contexts
    contexts/<x>.json   a named context's token ids
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
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checksum import Trailer, TrailerError, record_sums
from ..disk_store import RecordLayout, aligned_zeros
from .errors import ChunkCorrupt, ChunkUnavailable, ContextStoreError
from .files import TMP_PREFIX, fsync_dir, locked, stale_tmp, tmp_path, write_atomic
from .fingerprint import describe
from .http import HttpBackend
from .local import LocalBackend

log = logging.getLogger(__name__)

STORE_FILE, INDEX_FILE = "store.json", "index.json"
FORMAT = 2  # 2: blobs end in a checksum trailer
READ_ONLY = "read-only: save to a local --kv-path and publish the folder"


def chain_hash(parent: str, tokens: np.ndarray) -> str:
    return hashlib.sha256(bytes.fromhex(parent) + np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


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

    # ---- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, location: str | Path, fingerprint: dict, layout: RecordLayout, n_layers: int,
             chunk_tokens: int = 512, max_bytes: int | None = None, timeout_s: float = 30.0) -> "ContextStore":
        """A local folder (created if missing) or an http(s):// URL of a published one (read-only)."""
        _check_args(fingerprint, layout, n_layers, chunk_tokens, max_bytes)
        loc = str(location)
        if loc.startswith(("http://", "https://")):
            store = cls(HttpBackend(loc, timeout_s), None, loc, fingerprint, layout, n_layers, chunk_tokens, max_bytes)
            found = store._fetch_json(STORE_FILE)
            if found is None:
                raise ContextStoreError(f"no context store at {loc} (no {STORE_FILE}); publish a store folder there")
            store._check_geometry(found)
            store.refresh()
            return store
        root = Path(location)
        for sub in ("chunks", "contexts"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        store = cls(LocalBackend(root, layout.align_bytes), root, str(root), fingerprint, layout, n_layers,
                    chunk_tokens, max_bytes)
        with locked(root):
            found = store._fetch_json(STORE_FILE)
            if found is None:
                write_atomic(root / STORE_FILE, json.dumps(store._geometry(), indent=1).encode())
            else:
                store._check_geometry(found)
            store._refresh()
            store._clean()
        return store

    @staticmethod
    def geometry_at(location: str | Path, timeout_s: float = 30.0) -> dict | None:
        """The geometry (G, align, chunk_tokens) of the store at ``location``; None when there is none yet.

        An engine opens an existing store with its geometry, so a config with another G still reuses it.
        """
        loc = str(location)
        if loc.startswith(("http://", "https://")):
            data = HttpBackend(loc, timeout_s).read_file(STORE_FILE)
        else:
            path = Path(loc) / STORE_FILE
            data = path.read_bytes() if path.is_file() else None
        return json.loads(data) if data else None

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
        want = self._geometry()
        if found.get("format") != FORMAT:
            raise ContextStoreError(
                f"the context store at {self.location} has format {found.get('format')}; this edgekv reads format "
                f"{FORMAT} (blobs with checksums): move that folder away, or use another --kv-path, and save again")
        if any(found.get(k) != v for k, v in want.items()):
            def show(g):
                return ", ".join(f"{k}={g.get(k)}" for k in want)
            raise ContextStoreError(
                f"layout mismatch: the context store at {self.location} holds {show(found)}; this engine uses "
                f"{show(want)}: run with the store's group size and chunk size, or use another --kv-path")

    def _fetch_json(self, rel: str) -> dict | None:
        try:
            data = self.backend.read_file(rel)
        except ChunkUnavailable as exc:
            raise ContextStoreError(f"cannot read {rel} of the context store at {self.location}: {exc}") from exc
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ContextStoreError(f"{self.location}/{rel} is not valid JSON ({exc}); move it away to start afresh") from exc

    # ---- the index ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up what other processes saved (local), or fetch the published index again (remote)."""
        with self._mutex:
            if self.root is None:
                self._set_index(self._fetch_json(INDEX_FILE) or _empty_index())
            else:
                self._refresh()

    def _refresh(self) -> None:
        """Local: reload index.json if another process replaced it.  Remote: the snapshot stays until refresh()."""
        if self.root is None:
            return
        try:
            st = (self.root / INDEX_FILE).stat()
            stamp = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        except FileNotFoundError:
            stamp = "missing"
        if stamp != self._stamp:
            self._set_index(self._fetch_json(INDEX_FILE) or _empty_index())
            self._stamp = stamp

    def _set_index(self, index: dict) -> None:
        self._index = index
        self._lengths = {}
        for entry in index["chunks"].values():
            self._lengths.setdefault(entry["parent"], set()).add(entry["n_tokens"])

    def _write_index(self) -> None:
        """Under the lock: replace index.json atomically and remember its stamp."""
        write_atomic(self.root / INDEX_FILE, json.dumps(self._index, separators=(",", ":")).encode())
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
        with self._mutex:
            if self.root is None:
                refs = self._walk(arr, limit)
            else:
                with locked(self.root):
                    self._refresh()
                    refs = self._walk(arr, limit)
                    if refs:
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
            with locked(self.root):
                self._refresh()
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
        g, c = self.layout.group_tokens, self.chunk_tokens
        n = len(arr) // g * g
        self._check_kv(kv, n)
        refs, parents, parent = [], {}, self.fingerprint["id"]
        for start in range(0, n, c):
            stop = min(start + c, n)
            ref = ChunkRef(chain_hash(parent, arr[start:stop]), start, stop - start)
            refs.append(ref)
            parents[ref.hash], parent = parent, ref.hash
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
            with locked(self.root):
                self._refresh()
                missing = [r for r in refs if r.hash not in self._index["chunks"]]
            written: dict[str, Path] = {}
            try:
                for r in missing:  # outside the lock: other processes keep matching meanwhile
                    written[r.hash] = self._write_blob(r, kv)
                with locked(self.root):
                    self._refresh()
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
                        (self.root / replaced).unlink(missing_ok=True)
                for h in victims:
                    self.backend.blob_path(h).unlink(missing_ok=True)
            finally:
                for tmp in written.values():
                    tmp.unlink(missing_ok=True)
        return StoredPrefix(refs[-1].start + refs[-1].n_tokens if refs else 0, refs)

    def _record_context(self, name: str, arr: np.ndarray, hashes: list[str], n_stored: int) -> str | None:
        """Write the context's ids to a file of this save's own (a kill before the index names it leaves the old
        entry and its old file intact; the open-time clean-up drops the new one); returns the file it replaces."""
        rel = f"contexts/{_slug(name)}-{uuid.uuid4().hex[:8]}.json"
        body = {"name": name, "ids": arr.tolist(), "fingerprint": self.fingerprint, "chunks": hashes}
        write_atomic(self.root / rel, json.dumps(body).encode())
        old = self._index["contexts"].get(name, {}).get("file")
        self._index["contexts"][name] = {"file": rel, "tokens": len(arr), "stored_tokens": n_stored, "chunks": hashes,
                                         "fingerprint": self.fingerprint, "saved_at": time.time()}
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
        with self._mutex:
            self._refresh()
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
            known = ", ".join(sorted(self._index["contexts"])) or "none"
            raise ContextStoreError(f"no saved context named {name!r} in {self.location}; saved contexts: {known}")
        return c

    def context_ids(self, name: str) -> list[int]:
        """The token ids of a named context saved by this model in this dtype."""
        with self._mutex:
            self._refresh()
            c = self._context(name)
        if c["fingerprint"].get("id") != self.fingerprint["id"]:
            raise ContextStoreError(
                f"context {name!r} was saved by {describe(c['fingerprint'])}; this engine runs "
                f"{describe(self.fingerprint)}: refused, not used (KV of other weights or another dtype); "
                f"save it again with this model")
        data = self.backend.read_file(c["file"])
        if data is None:
            raise ContextStoreError(f"context {name!r}: {c['file']} is missing from {self.location}; save it again")
        return [int(t) for t in json.loads(data)["ids"]]

    def remove(self, name: str) -> None:
        """Forget a named context and the chunks no other named context uses."""
        if self.root is None:
            raise self._read_only()
        with self._mutex:
            with locked(self.root):
                self._refresh()
                c = self._context(name)
                del self._index["contexts"][name]
                shared = {h for other in self._index["contexts"].values() for h in other["chunks"]}
                victims = [h for h in c["chunks"] if h in self._index["chunks"] and h not in shared]
                for h in victims:
                    del self._index["chunks"][h]
                self._write_index()
                (self.root / c["file"]).unlink(missing_ok=True)
            for h in victims:
                self.backend.blob_path(h).unlink(missing_ok=True)

    def remove_all(self) -> None:
        """Empty the store: every chunk and named context, of every fingerprint."""
        if self.root is None:
            raise self._read_only()
        with self._mutex:
            with locked(self.root):
                self._refresh()
                victims = list(self._index["chunks"])
                files = [c["file"] for c in self._index["contexts"].values()]
                self._index = {**_empty_index(), "tick": self._index["tick"]}
                self._write_index()
                for rel in files:
                    (self.root / rel).unlink(missing_ok=True)
            for h in victims:
                self.backend.blob_path(h).unlink(missing_ok=True)

    @property
    def total_bytes(self) -> int:
        with self._mutex:
            self._refresh()
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
