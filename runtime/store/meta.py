"""The store's metadata (store.json, index.json, contexts/<x>.json): sealed with a checksum, parsed strictly.

A file's ``sha256`` is over the canonical JSON of the rest of it (sorted keys, no spaces): a changed value,
key or structure is caught while the layout may differ (store.json stays indented for people).  A file that
is not JSON, fails its checksum or its schema raises ``Damaged``; the store logs it naming the file and
treats it as a miss.  A sealed index can still be hand-made (the checksum is not a signature), so every
entry is also checked on its own: hashes are 64 lowercase hex digits (they name blobs), a context's file
is a plain name inside ``contexts/``, counts fit the geometry; an entry that does not is refused by name.
index.json keeps a copy of store.json's geometry: ``read_geometry`` falls back on it.
"""
from __future__ import annotations

import hashlib
import json
import math
import re

from .errors import ChunkUnavailable, ContextStoreError

STORE_FILE, INDEX_FILE = "store.json", "index.json"
FORMAT = 3  # 2: blobs end in a checksum trailer; 3: the JSON files carry checksums
LEGACY_FORMAT = 2  # read, and migrated when opened locally
SUM_KEY = "sha256"
HEX64 = re.compile(r"[0-9a-f]{64}")
CONTEXT_FILE = re.compile(r"contexts/[A-Za-z0-9_-][A-Za-z0-9._-]*\.json")
GEOMETRY_KEYS = {"format", "group_tokens", "align_bytes", "chunk_tokens"}
INDEX_KEYS = {"format", "tick", "chunks", "contexts"}  # and the geometry's copy
CHUNK_KEYS = {"fp", "parent", "start", "n_tokens", "bytes", "tick", "last_used"}
CONTEXT_KEYS = {"file", "tokens", "stored_tokens", "chunks", "fingerprint", "saved_at"}


class Damaged(ValueError):
    """A metadata file that is not what was written: the message says what is wrong with it."""


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(body: dict, indent: int | None = None) -> bytes:
    """``body`` as JSON with its checksum beside it."""
    return json.dumps({**body, SUM_KEY: _digest(body)}, indent=indent,
                      separators=None if indent else (",", ":")).encode()


def unseal(data: bytes) -> tuple[dict, bool]:
    """(the object in ``data``, whether it carried a checksum); a checksum present is verified."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise Damaged(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise Damaged(f"a JSON {type(obj).__name__}, not an object")
    found = obj.pop(SUM_KEY, None)
    if found is not None and found != _digest(obj):
        raise Damaged("its checksum does not match its contents")
    return obj, found is not None


def is_hash(value) -> bool:
    return isinstance(value, str) and HEX64.fullmatch(value) is not None


def is_count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_time(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def check_blob(blob) -> str:
    """A blob name from an index: 64 lowercase hex digits, so ``chunks/<blob>.kv`` stays inside the store."""
    if not is_hash(blob):
        raise ContextStoreError(f"chunk {str(blob)[:80]!r} is not a chunk hash (64 hex digits): refused, not read; "
                                f"the store's index.json was edited or damaged")
    return blob


def check_rel(rel) -> str:
    """A path from an index read relative to the store: no absolute path, no '..', no backslash."""
    parts = str(rel).split("/")
    if not rel or str(rel).startswith("/") or "\\" in str(rel) or any(p in ("", ".", "..") for p in parts):
        raise ContextStoreError(f"{str(rel)[:200]!r} is not a path inside the store: refused, not followed")
    return rel


def geometry_problem(obj) -> str | None:
    if not isinstance(obj, dict) or set(obj) != GEOMETRY_KEYS:
        return f"the geometry is not an object of {sorted(GEOMETRY_KEYS)}"
    g, align, c = obj["group_tokens"], obj["align_bytes"], obj["chunk_tokens"]
    if not (is_count(obj["format"], 1) and is_count(g, 1) and is_count(align, 1) and align & (align - 1) == 0
            and is_count(c, 1) and c % g == 0):
        return f"the geometry {obj} is not format >= 1, G >= 1, a power-of-two align and chunk_tokens a multiple of G"
    return None


def chunk_problem(h: str, e, geometry: dict) -> str | None:
    """Why an index's chunk entry cannot be right for this geometry (None: it can)."""
    g, c = geometry["group_tokens"], geometry["chunk_tokens"]
    if not is_hash(h):
        return "its hash is not 64 hex digits"
    if not isinstance(e, dict) or set(e) != CHUNK_KEYS:
        return f"it is not an object of {sorted(CHUNK_KEYS)}"
    if not (is_hash(e["fp"]) and is_hash(e["parent"]) and is_count(e["bytes"], 1) and is_count(e["tick"])
            and is_time(e["last_used"])):
        return "fp, parent, bytes, tick or last_used is out of range"
    if not (is_count(e["start"]) and e["start"] % c == 0 and is_count(e["n_tokens"], 1) and e["n_tokens"] % g == 0
            and e["n_tokens"] <= c):
        return f"start {e['start']!r} / n_tokens {e['n_tokens']!r} do not fit G={g}, chunk_tokens={c}"
    return None


def context_problem(c, geometry: dict) -> str | None:
    """Why an index's named-context entry cannot be right (None: it can)."""
    g, chunk = geometry["group_tokens"], geometry["chunk_tokens"]
    if not isinstance(c, dict) or set(c) != CONTEXT_KEYS:
        return f"it is not an object of {sorted(CONTEXT_KEYS)}"
    if not isinstance(c["file"], str) or CONTEXT_FILE.fullmatch(c["file"]) is None:
        return f"its file {str(c['file'])[:200]!r} is not a plain file name inside contexts/"
    n = c["stored_tokens"]
    if not (is_count(c["tokens"]) and is_count(n) and n == c["tokens"] // g * g and is_time(c["saved_at"])
            and isinstance(c["fingerprint"], dict) and is_hash(c["fingerprint"].get("id"))):
        return "tokens, stored_tokens, fingerprint or saved_at is out of range"
    if not (isinstance(c["chunks"], list) and all(map(is_hash, c["chunks"])) and len(c["chunks"]) == -(-n // chunk)):
        return f"its chunks are not {-(-n // chunk)} hashes"
    return None


def parse_index(body: dict, geometry: dict, legacy: bool) -> tuple[dict, dict[str, str], dict[str, str]]:
    """(the index in ``body``, refused contexts {name: why}, refused chunks {hash: why}); Damaged when ``body`` is
    not an index of the store whose geometry is ``geometry`` (format 2 ones, ``legacy``, carry no copy of it)."""
    copy = body.pop("geometry", None)
    formats = (LEGACY_FORMAT, FORMAT) if legacy else (FORMAT,)
    if set(body) != INDEX_KEYS or body["format"] not in formats or not is_count(body["tick"]) \
            or not isinstance(body["chunks"], dict) or not isinstance(body["contexts"], dict):
        raise Damaged(f"it is not an index of format {' or '.join(map(str, formats))}")
    same = isinstance(copy, dict) and {**copy, "format": FORMAT} == geometry
    if not (same or copy is None and legacy):
        raise Damaged(f"its copy of the geometry {copy} is not {STORE_FILE}'s {geometry}")
    chunks = {h: chunk_problem(h, e, geometry) for h, e in body["chunks"].items()}
    contexts = {name: context_problem(c, geometry) for name, c in body["contexts"].items()}
    index = {"format": FORMAT, "tick": body["tick"],
             "chunks": {h: body["chunks"][h] for h, why in chunks.items() if not why},
             "contexts": {name: body["contexts"][name] for name, why in contexts.items() if not why}}
    return index, {name: why for name, why in contexts.items() if why}, {h: why for h, why in chunks.items() if why}


def read_file(backend, location: str, rel: str) -> bytes | None:
    try:
        return backend.read_file(rel)
    except ChunkUnavailable as exc:
        raise ContextStoreError(f"cannot read {rel} of the context store at {location}: {exc}") from exc


def parse_geometry(data: bytes, location: str) -> dict:
    """store.json's geometry; Damaged when it is not intact, a ContextStoreError for another format."""
    body, sealed = unseal(data)
    fmt = body.get("format")
    if is_count(fmt, 1) and fmt not in (LEGACY_FORMAT, FORMAT) and not sealed:
        raise ContextStoreError(
            f"the context store at {location} has format {fmt} ({STORE_FILE}); this edgekv reads formats "
            f"{LEGACY_FORMAT} and {FORMAT} (blobs with checksums): move that folder away, or use another --kv-path, "
            f"and save again")
    if not sealed and fmt != LEGACY_FORMAT:
        raise Damaged("it carries no checksum")
    problem = geometry_problem(body)
    if problem:
        raise Damaged(problem)
    return body


def read_geometry(backend, location: str) -> tuple[dict | None, str | None]:
    """store.json's geometry, or where that file is missing or damaged the copy index.json keeps, with a note
    saying so; (None, None) where there is no store yet."""
    data = read_file(backend, location, STORE_FILE)
    why = "is missing"
    if data is not None:
        try:
            return parse_geometry(data, location), None
        except Damaged as exc:
            why = f"is damaged ({exc})"
    try:
        index, sealed = unseal(read_file(backend, location, INDEX_FILE) or b"{}")
    except Damaged:
        index, sealed = {}, False
    copy = index.get("geometry")
    if sealed and geometry_problem(copy) is None:
        return copy, f"context store {location}: {STORE_FILE} {why}: its geometry is restored from {INDEX_FILE}"
    if data is None:
        return None, None
    raise ContextStoreError(f"{location}/{STORE_FILE} {why} and {INDEX_FILE} holds no intact copy of the store's "
                            f"geometry: move the folder away (or use another --kv-path) and save the contexts again")
