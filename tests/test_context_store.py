"""The context store gives back exactly what was saved, matches by prefix, survives restarts and
crashes, keeps its cap, refuses other models, and reads over HTTP without hanging or garbage."""
import copy
import errno
import hashlib
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from edgekv.runtime.checksum import Trailer
from edgekv.runtime.disk_store import RecordLayout, aligned_zeros
from edgekv.runtime.store import (ChunkUnavailable, ContextStore, ContextStoreError, ThrottledBackend,
                                  model_fingerprint)
from edgekv.runtime.store import local as local_mod
from tests.store_helpers import (C, CHUNK_BYTES, FP, LAYOUT, REPO, D, G, H, L, assert_same_kv, blobs, fingerprint,
                                 make_kv, open_store, read_back)

# ---- round trip and matching --------------------------------------------------------------------

def test_put_match_read_round_trip_is_bit_exact(tmp_path):
    store = open_store(tmp_path)
    ids = list(range(1, 23))  # 22 tokens: 20 stored as chunks of 8, 8, 4
    kv = make_kv(22)
    saved = store.put(ids, kv)
    assert saved.n_tokens == 20 and [(r.start, r.n_tokens) for r in saved.chunks] == [(0, 8), (8, 8), (16, 4)]
    found = store.match(ids)
    assert found == saved  # limit (22 - 1) // 4 * 4 = 20
    h0 = hashlib.sha256(bytes.fromhex(FP["id"]) + np.arange(1, 9, dtype="<i8").tobytes()).hexdigest()
    h1 = hashlib.sha256(bytes.fromhex(h0) + np.arange(9, 17, dtype="<i8").tobytes()).hexdigest()
    assert [r.hash for r in saved.chunks[:2]] == [h0, h1]  # chained, seeded by the fingerprint
    assert_same_kv(read_back(store, found), kv, 20)
    # the blob is layer-major records (layer l of a full chunk is one aligned range), then the checksum trailer
    ref = found.chunks[0]
    raw = np.fromfile(store.backend.blob_path(ref.hash), dtype=np.uint8)
    per_layer = store.read_bytes_per_chunk_layer(ref)
    assert per_layer == 2 * LAYOUT.stride_bytes and per_layer % 4096 == 0
    assert raw.size == L * per_layer + Trailer.nbytes(L, 2, LAYOUT.align_bytes)
    assert raw[L * per_layer : L * per_layer + 8].tobytes() == b"EKVSUMS\0"
    for layer in range(L):
        k, v = kv[layer]
        np.testing.assert_array_equal(raw[layer * per_layer:(layer + 1) * per_layer],
                                      LAYOUT.pack(k[:, :8], v[:, :8]).reshape(-1))
    with pytest.raises(ValueError, match="needs"):
        store.read(ref, 0, aligned_zeros((1, LAYOUT.stride_bytes), 4096))


def test_prefix_matching(tmp_path):
    store = open_store(tmp_path)
    a = list(range(100, 124))  # 3 full chunks
    kv_a = make_kv(24, seed=1)
    store.put(a, kv_a)
    assert len(blobs(tmp_path)) == 3

    longer = store.match(a + [7, 8, 9, 10, 11])
    assert longer.n_tokens == 24 and len(longer.chunks) == 3
    assert_same_kv(read_back(store, longer), kv_a, 24)

    same = store.match(a)  # the last token is computed: chunk 2 (tokens 16..23) cannot be used whole
    assert same.n_tokens == 16 and same.n_tokens <= len(a) - 1

    differs = a[:17] + [999] + a[18:] + [1, 2]
    got = store.match(differs)
    assert got.n_tokens == 16 and [r.hash for r in got.chunks] == [r.hash for r in longer.chunks[:2]]
    assert store.match([999] + a[1:]) is None
    assert store.match(a[:G]) is None  # nothing before the last token fills a group

    b = a[:16] + [200, 201, 202, 203]  # shares chunks 0-1, ends with a partial chunk
    kv_b = torch.stack([torch.stack(layer) for layer in make_kv(20, seed=2)])  # [L, 2, H, T, d] like PrefixKV.kv
    kv_b[:, :, :, :16] = torch.stack([torch.stack(layer) for layer in kv_a])[:, :, :, :16]
    written = []
    write_blob = store._write_blob
    store._write_blob = lambda ref, kv: written.append(ref.start) or write_blob(ref, kv)
    saved_b = store.put(b, kv_b)
    assert written == [16] and len(blobs(tmp_path)) == 4  # only the partial chunk was new
    got = store.match(b + [5, 5])
    assert got == saved_b and got.n_tokens == 20 and got.chunks[-1].n_tokens == 4
    assert_same_kv(read_back(store, got), [tuple(layer) for layer in kv_b], 20)
    for ids in (a, b + [1], differs, a + [3] * 9):
        m = store.match(ids)
        assert m.n_tokens % G == 0 and m.n_tokens <= len(ids) - 1


# ---- restarts and crashes -------------------------------------------------------------------------

SCRIPT = """
import hashlib, os, sys, torch
sys.path.insert(0, {tests!r})
from store_helpers import open_store, make_kv
from edgekv.runtime.store import context_store
store = open_store({root!r})
store.put(list(range(300, 320)), make_kv(20, seed=5), name="other")
def killed(*args):  # dies between writing a blob and renaming it into place
    os._exit(17)
context_store.os.replace = killed
store.put(list(range(500, 516)), make_kv(16, seed=6), name="never")
"""


def test_index_survives_restart_and_a_killed_process(tmp_path):
    root = tmp_path / "store"
    first = open_store(root)
    ids = list(range(1, 30))
    kv = make_kv(29, seed=3)
    first.put(ids, kv, name="doc")

    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(REPO / "tests"), root=str(root))],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr
    assert any(p.name.startswith(".tmp-") for p in (root / "chunks").iterdir())  # the dead writer's temp blob

    first.refresh()  # a store that was open all along sees the other process's context
    assert {c["name"] for c in first.contexts()} == {"doc", "other"}

    again = open_store(root)  # a restart: only complete, indexed blobs remain
    assert not any(p.name.startswith(".tmp-") for p in root.rglob("*"))
    assert {c["name"] for c in again.contexts()} == {"doc", "other"}
    assert all(c["complete"] for c in again.contexts())
    assert again.context_ids("doc") == ids
    got = again.match(again.context_ids("doc") + [0])
    assert got.n_tokens == 28
    assert_same_kv(read_back(again, got), kv, 28)
    other = again.match(list(range(300, 320)) + [0])
    assert_same_kv(read_back(again, other), make_kv(20, seed=5), 20)
    assert again.match(list(range(500, 516)) + [0]) is None


def test_crash_between_blob_rename_and_index_leaves_nothing_visible(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.put(list(range(10, 19)), make_kv(9), name="kept")

    def crash(self):
        raise KeyboardInterrupt("killed before the index names the new blobs")

    monkeypatch.setattr(ContextStore, "_write_index", crash)
    with pytest.raises(KeyboardInterrupt):
        store.put(list(range(40, 60)), make_kv(20, seed=9), name="lost")
    monkeypatch.undo()
    assert len(blobs(tmp_path)) == 1 + 3  # renamed into place, but no index names them

    again = open_store(tmp_path)
    assert len(blobs(tmp_path)) == 1  # orphans removed on open
    assert again.match(list(range(40, 60))) is None
    assert [c["name"] for c in again.contexts()] == ["kept"] and again.context_ids("kept") == list(range(10, 19))
    assert not list((tmp_path / "contexts").glob("lost*"))


def test_index_entry_without_blob_is_dropped_on_open(tmp_path):
    store = open_store(tmp_path)
    saved = store.put(list(range(24)), make_kv(24), name="doc")
    store.backend.blob_path(saved.chunks[1].hash).unlink()
    again = open_store(tmp_path)
    assert again.match(list(range(25))).n_tokens == 8
    (doc,) = again.contexts()
    assert not doc["complete"] and doc["usable_tokens"] == 8


def test_concurrent_writers_share_one_index(tmp_path):
    stores = [open_store(tmp_path) for _ in range(4)]
    threads = [threading.Thread(target=s.put, args=(list(range(i * 100, i * 100 + 17)), make_kv(17, seed=i)),
                                kwargs={"name": f"c{i}"}) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = open_store(tmp_path)
    assert [c["name"] for c in fresh.contexts()] == ["c0", "c1", "c2", "c3"]
    assert len(blobs(tmp_path)) == 8
    for i in range(4):
        assert fresh.match(list(range(i * 100, i * 100 + 17))).n_tokens == 16


# ---- cap and eviction ---------------------------------------------------------------------------------

def test_eviction_is_lru_and_a_recently_matched_chunk_survives(tmp_path):
    store = open_store(tmp_path, max_bytes=3 * CHUNK_BYTES)
    ctx = {name: [base + i for i in range(C)] for name, base in (("x", 0), ("y", 100), ("z", 200), ("w", 300))}
    for name in "xyz":
        store.put(ctx[name], make_kv(C))
    assert store.total_bytes == 3 * CHUNK_BYTES
    assert store.match(ctx["x"] + [1]).n_tokens == C  # x is now the most recently used
    store.put(ctx["w"], make_kv(C))
    assert store.total_bytes <= store.max_bytes
    assert store.match(ctx["y"] + [1]) is None  # the least recently used went
    for name in "zxw":  # z becomes the least recently used
        assert store.match(ctx[name] + [1]).n_tokens == C
    assert len(blobs(tmp_path)) == 3
    # the order is persistent: another process evicts the same way
    assert open_store(tmp_path, max_bytes=3 * CHUNK_BYTES).put([9] * C, make_kv(C)).n_tokens == C
    assert store.match(ctx["z"] + [1]) is None and store.match(ctx["x"] + [1]) is not None


def test_evicted_named_context_keeps_its_usable_prefix(tmp_path):
    store = open_store(tmp_path, max_bytes=3 * CHUNK_BYTES)
    doc = list(range(2 * C))
    store.put(doc, make_kv(2 * C), name="doc")
    store.put([50] * C, make_kv(C))
    store.put([60] * C, make_kv(C))  # evicts doc's later chunk before its first
    (entry,) = store.contexts()
    assert not entry["complete"] and entry["usable_tokens"] == C and entry["tokens"] == 2 * C
    assert entry["bytes"] == CHUNK_BYTES
    assert store.match(doc + [1]).n_tokens == C


def test_cap_smaller_than_a_chunk_is_refused_and_a_too_long_put_keeps_a_prefix(tmp_path):
    with pytest.raises(ContextStoreError) as err:
        open_store(tmp_path, max_bytes=CHUNK_BYTES - 1)
    assert str(CHUNK_BYTES - 1) in str(err.value) and str(CHUNK_BYTES) in str(err.value)
    store = open_store(tmp_path, max_bytes=2 * CHUNK_BYTES)
    saved = store.put(list(range(5 * C)), make_kv(5 * C), name="long")
    assert saved.n_tokens == 2 * C and store.total_bytes == 2 * CHUNK_BYTES
    assert not store.contexts()[0]["complete"]


def test_remove_keeps_shared_chunks_and_remove_all_empties(tmp_path):
    store = open_store(tmp_path)
    store.put(list(range(2 * C)), make_kv(2 * C), name="a")
    store.put(list(range(C)) + [77] * C, make_kv(2 * C), name="b")  # shares chunk 0 with a
    store.remove("a")
    assert [c["name"] for c in store.contexts()] == ["b"] and store.contexts()[0]["complete"]
    assert len(blobs(tmp_path)) == 2
    with pytest.raises(ContextStoreError, match="saved contexts: b"):
        store.remove("a")
    store.remove_all()
    assert store.contexts() == [] and store.total_bytes == 0 and blobs(tmp_path) == []
    assert list((tmp_path / "contexts").iterdir()) == []


# ---- fingerprints and layouts -------------------------------------------------------------------------

def test_another_fingerprint_never_matches_and_is_refused(tmp_path):
    ids = list(range(20))
    open_store(tmp_path).put(ids, make_kv(20), name="doc")
    other = open_store(tmp_path, fp=fingerprint("model-b", name="other-weights"))
    assert other.match(ids + [1]) is None
    with pytest.raises(ContextStoreError) as err:
        other.context_ids("doc")
    msg = str(err.value)
    assert "model-a" in msg and "other-weights" in msg and "refused, not used" in msg
    assert [c["fingerprint"]["id"] for c in other.contexts()] == [FP["id"]]
    with pytest.raises(ContextStoreError, match="saved contexts: doc"):
        other.context_ids("nope")


def test_layout_mismatch_is_refused(tmp_path):
    open_store(tmp_path)
    with pytest.raises(ContextStoreError) as err:
        ContextStore.open(tmp_path, FP, RecordLayout(8, H, D, torch.float32), L, chunk_tokens=C)
    assert "group_tokens=4" in str(err.value) and "group_tokens=8" in str(err.value)
    with pytest.raises(ContextStoreError, match="chunk_tokens=16"):
        ContextStore.open(tmp_path, FP, LAYOUT, L, chunk_tokens=16)
    with pytest.raises(ContextStoreError, match="multiple of the group size"):
        ContextStore.open(tmp_path / "new", FP, LAYOUT, L, chunk_tokens=6)
    with pytest.raises(ContextStoreError, match="head_dim"):
        open_store(tmp_path, fp=fingerprint("model-a", head_dim=32))
    store = open_store(tmp_path)
    half = [(k.half(), v.half()) for k, v in make_kv(8)]
    with pytest.raises(ContextStoreError, match="float16"):
        store.put(list(range(8)), half)


@pytest.fixture(scope="module")
def fixture_model():
    from edgekv.runtime.engine import Engine
    return Engine.from_pretrained("fixture", policy="full", device="cpu").model


def test_fixture_model_kv_round_trip_and_fingerprints(tmp_path, fixture_model):
    from edgekv.runtime.model import DecoderModel
    from edgekv.runtime.ttft.compute import ChunkCompute, PrefixKV

    model = fixture_model
    fp = model_fingerprint(model)
    assert fp == model_fingerprint(model)
    assert {k: fp[k] for k in ("model_type", "n_layers", "n_kv_heads", "head_dim", "dtype")} == {
        "model_type": "llama", "n_layers": model.dims.n_layers, "n_kv_heads": model.dims.n_kv_heads,
        "head_dim": model.dims.head_dim, "dtype": "float32"}
    half = DecoderModel(copy.deepcopy(model.hf).to(torch.float16))
    tweaked = DecoderModel(copy.deepcopy(model.hf))
    with torch.no_grad():
        tweaked.layers[0].self_attn.k_proj.weight[0, 0] += 1e-3
    fp_half, fp_tweaked = model_fingerprint(half), model_fingerprint(tweaked)
    assert len({fp["id"], fp_half["id"], fp_tweaked["id"]}) == 3 and fp_half["dtype"] == "float16"

    d = model.dims
    layout = RecordLayout(16, d.n_kv_heads, d.head_dim, model.dtype)
    ids = [int(t) for t in torch.randint(3, d.vocab, (70,), generator=torch.Generator().manual_seed(0))]
    prefix = PrefixKV(model, 64)
    compute = ChunkCompute(model, ids, prefix)
    for layer in range(d.n_layers):
        compute.advance((0, 64), layer)
    store = ContextStore.open(tmp_path, fp, layout, d.n_layers, chunk_tokens=32)
    store.put(ids[:64], prefix.kv, name="doc")
    got = store.match(ids)
    assert got.n_tokens == 64
    assert_same_kv(read_back(store, got, layout, d.n_layers), [tuple(x) for x in prefix.kv], 64)

    other = ContextStore.open(tmp_path, fp_half, RecordLayout(16, d.n_kv_heads, d.head_dim, torch.float16),
                              d.n_layers, chunk_tokens=32)
    assert other.match(ids) is None
    with pytest.raises(ContextStoreError, match="float32.*float16.*refused, not used"):
        other.context_ids("doc")


# ---- local reads ------------------------------------------------------------------------------------

def test_local_reads_fall_back_from_o_direct_once_and_resume_short_reads(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path)
    kv = make_kv(16)
    saved = store.put(list(range(17)), kv)
    assert_same_kv(read_back(store, saved), kv, 16)
    assert store.backend.o_direct is not None

    real_open, real_preadv = os.open, os.preadv
    calls = []

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def short(fd, buffers, offset):
        calls.append(offset)
        return real_preadv(fd, [buffers[0][:4096]], offset)

    fresh = open_store(tmp_path)
    monkeypatch.setattr(local_mod.os, "open", no_direct)
    monkeypatch.setattr(local_mod.os, "preadv", short)
    with caplog.at_level(logging.WARNING, logger=local_mod.__name__):
        assert_same_kv(read_back(fresh, saved), kv, 16)
    assert fresh.backend.o_direct is False
    assert sum("O_DIRECT refused" in r.message for r in caplog.records) == 1
    assert len(calls) == (2 * L + 1) * len(saved.chunks)  # 2 pages per (chunk, layer) and its trailer's, a page a call

    monkeypatch.undo()
    path = store.backend.blob_path(saved.chunks[1].hash)
    os.truncate(path, path.stat().st_size - Trailer.nbytes(L, 2, LAYOUT.align_bytes) - 4096)  # the trailer, a record
    buf = aligned_zeros((2, LAYOUT.stride_bytes), 4096)
    with pytest.raises(ChunkUnavailable, match="short"):
        store.read(saved.chunks[1], L - 1, buf)
    path.unlink()
    with pytest.raises(ChunkUnavailable, match="evicted or removed"):
        store.read(saved.chunks[1], 0, buf)


def finishes(fn, *args):
    """Run fn in a thread and return (or raise) what it did; a read that hangs fails the test instead of it."""
    result = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{fn} still running after 60 s: hung"
    if "error" in result:
        raise result["error"]
    return result.get("value")


# ---- HTTP ---------------------------------------------------------------------------------------------

def test_http_store_reads_what_was_published_on_one_connection(range_server):
    local = open_store(range_server.root)
    ids = list(range(40, 70))
    kv = make_kv(30, seed=4)
    local.put(ids, kv, name="doc")
    remote = open_store(range_server.url, timeout_s=5)
    assert remote.context_ids("doc") == ids
    got = remote.match(ids + [1])
    assert got.n_tokens == 28
    assert_same_kv(read_back(remote, got), kv, 28)
    assert range_server.connections == 1  # keep-alive: every GET so far on one connection
    for call in (lambda: remote.put(ids, kv), lambda: remote.remove("doc"), remote.remove_all):
        with pytest.raises(ContextStoreError, match="read-only: save to a local --kv-path and publish the folder"):
            call()


def test_http_failures_raise_chunk_unavailable(range_server):
    local = open_store(range_server.root)
    saved = local.put(list(range(17)), make_kv(17))
    remote = open_store(range_server.url, timeout_s=0.5)
    ref = saved.chunks[0]
    buf = aligned_zeros((2, LAYOUT.stride_bytes), 4096)

    local.backend.blob_path(saved.chunks[1].hash).unlink()
    with pytest.raises(ChunkUnavailable, match="404"):
        remote.read(saved.chunks[1], 0, buf)
    range_server.mode = "drop"  # the connection closes mid-body
    with pytest.raises(ChunkUnavailable):
        finishes(remote.read, ref, 1, buf)
    range_server.mode = "wrong-range"
    with pytest.raises(ChunkUnavailable, match="Content-Range"):
        remote.read(ref, 0, buf)
    range_server.mode = "ignore-range"
    with pytest.raises(ChunkUnavailable, match="ignores Range"):
        remote.read(ref, 1, buf)
    range_server.mode = "stall"  # half the body, then silence: the timeout ends it
    with pytest.raises(ChunkUnavailable):
        finishes(remote.read, ref, 2, buf)
    range_server.release.set()
    range_server.mode = "normal"
    remote.read(ref, 2, buf)  # a fresh connection after the failures
    k, v = make_kv(17)[2]
    np.testing.assert_array_equal(buf, LAYOUT.pack(k[:, :8], v[:, :8]))


def test_http_open_without_a_store_is_refused(range_server):
    range_server.root.mkdir()
    with pytest.raises(ContextStoreError, match="no context store"):
        open_store(range_server.url, timeout_s=2)


# ---- throttling -----------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


class CountingBackend:
    def __init__(self, fail=False):
        self.bytes, self.fail, self.lock = 0, fail, threading.Lock()

    def read_range(self, blob, offset, nbytes, out):
        if self.fail:
            raise ChunkUnavailable("gone")
        with self.lock:
            self.bytes += nbytes


MIB = 2**20


def test_throttle_paces_by_bytes_and_drops_the_rate():
    clock = FakeClock()
    link = ThrottledBackend(CountingBackend(), rate_mib_s=1.0, drop_at_s=1.5, drop_factor=0.5,
                            clock=clock, sleep=clock.sleep)
    link.start()
    link.read_range("h", 0, MIB // 2, None)
    link.read_range("h", 0, MIB // 2, None)
    assert clock.now == pytest.approx(1.0) and link.bytes_read == MIB
    link.read_range("h", 0, MIB, None)  # 0.5 MiB before the drop at 1.5 s, 0.5 MiB at 0.5 MiB/s after
    assert clock.now == pytest.approx(2.5)
    clock.now = 10.0  # an idle link builds no credit
    link.read_range("h", 0, MIB, None)
    assert clock.now == pytest.approx(12.0) and link.slept_s == pytest.approx(4.5)

    failing = ThrottledBackend(CountingBackend(fail=True), 1.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(ChunkUnavailable):
        failing.read_range("h", 0, MIB, None)
    assert failing.bytes_read == 0 and clock.now == pytest.approx(12.0)


def test_throttle_accounts_every_byte_across_threads(tmp_path):
    clock = FakeClock()
    slept = []
    link = ThrottledBackend(CountingBackend(), rate_mib_s=4.0, clock=clock, sleep=slept.append)
    link.start()

    def reader():
        for _ in range(25):
            link.read_range("h", 0, 64 * 1024, None)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert link.bytes_read == link.backend.bytes == 8 * 25 * 64 * 1024
    assert max(slept) == pytest.approx(link.bytes_read / (4.0 * MIB))  # reservations queue on one link

    store = open_store(tmp_path)
    saved = store.put(list(range(9)), make_kv(9))
    store.backend = ThrottledBackend(store.backend, rate_mib_s=1e6)
    assert_same_kv(read_back(store, saved), make_kv(9), 8)
    trailer = Trailer.nbytes(L, 2, LAYOUT.align_bytes)  # read once per chunk
    assert store.backend.bytes_read == L * store.read_bytes_per_chunk_layer(saved.chunks[0]) + trailer
