"""Fault injection at the KV reader and writer (tests/harness/faults.py): damaged records, failed, short and hung reads,
a full disk, a KV path that disappears, damaged context-store chunks.  Each ends in the same tokens as a clean
run or a clear error, no file left behind, and an engine that serves the next request."""
import errno
import json
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from edgekv.cli import main
from edgekv.runtime import Engine
from edgekv.runtime import disk_store as disk_store_mod
from edgekv.runtime.checksum import Trailer
from edgekv.runtime.disk_store import CorruptRecord, DiskKVStore, RecordLayout, StoreError, aligned_zeros
from edgekv.runtime.engine import _record_layout
from edgekv.runtime.reader import open_reader
from edgekv.runtime.store import ChunkCorrupt, ContextStore
from edgekv.runtime.ttft.prefill import TTFTOptions

from tests.harness.faults import DAMAGE, FaultyReader, rewrite, run_store_flips

from .conftest import files_under

CFG = {"G": 4, "M": 4, "C": 8, "max_context": 160, "max_batch": 2, "read_deadline_s": 0.5}
PROMPTS = [list(range(1, 57)), list(range(30, 86))]  # 14 whole groups each
NEW_TOKENS = 9


@pytest.fixture
def engine(model_dirs, kv_path):
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CFG, policy="kvswap",
                                device="cpu") as engine:
        yield engine


def run(engine, **kw):
    return [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[], **kw)]


def inject(engine, fault: str, at: int) -> FaultyReader:
    layout = _record_layout(engine.config, engine.model.dims, engine.model.dtype)
    engine.reader = FaultyReader(engine.reader, layout.record_bytes, fault, at, seed=at)
    return engine.reader


@pytest.mark.parametrize("at", [0, 4, 9])
@pytest.mark.parametrize("fault", DAMAGE)
def test_a_damaged_record_is_caught_and_the_answer_is_unchanged(engine, kv_path, fault, at, caplog):
    want = run(engine)
    reader = inject(engine, fault, at)
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        got = run(engine)
    assert reader.injected is not None
    assert got == want
    if fault == "flip_memory":  # transient: the second read is intact and used
        assert "then read back intact" in caplog.text and "twice" not in caplog.text
    else:  # on disk: the batch is computed again from its tokens, the message names the file and record
        assert "failed its checksum twice" in caplog.text and str(kv_path) in caplog.text
    assert files_under(kv_path) == []


@pytest.mark.parametrize("fault", DAMAGE)
def test_damage_is_caught_with_gaps_read_through(model_dirs, kv_path, fault, caplog):
    """Requests bridge gaps (io_gap_bytes): the damage lands in a wanted record, never in one only read to bridge."""
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**CFG, "io_gap_bytes": 3 * 4096},
                                policy="kvswap", device="cpu") as engine:
        want = run(engine)
        stores = []
        open_batch = engine.open_batch
        engine.open_batch = lambda *a: _keep_store(open_batch(*a), stores)
        reader = inject(engine, fault, 4)
        with caplog.at_level(logging.WARNING, logger="edgekv"):
            got = run(engine)
    assert reader.injected is not None and got == want
    assert stores[0].gap_records_read > 0, "the requests bridged gaps"
    assert ("then read back intact" if fault == "flip_memory" else "failed its checksum twice") in caplog.text


def test_without_verification_damage_goes_through_and_a_warning_says_so(model_dirs, kv_path, caplog):
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**CFG, "verify_fraction": 0},
                                    policy="kvswap", device="cpu") as engine:
            reader = inject(engine, "flip_disk", 2)
            run(engine)
    assert reader.injected is not None
    assert "are not checked against their checksums" in caplog.text and "failed its checksum" not in caplog.text


def test_sampled_verification_states_its_coverage_and_checks_about_that_share(model_dirs, kv_path, caplog):
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**CFG, "verify_fraction": 0.5},
                                    policy="kvswap", device="cpu") as engine:
            stores = []
            open_batch = engine.open_batch
            engine.open_batch = lambda *a: _keep_store(open_batch(*a), stores)
            engine.generate(PROMPTS, max_new_tokens=60, stop_token_ids=[])
    assert "caught with probability 0.5 per read" in caplog.text
    store = stores[0]
    assert store.records_read > 200 and 0.3 < store.records_verified / store.records_read < 0.7


def _keep_store(batch, stores):
    stores.append(batch.policy.store)
    return batch


@pytest.mark.parametrize("fault", ["eio", "short"])
def test_failed_and_short_reads_end_the_request_with_a_named_error(engine, kv_path, fault):
    want = run(engine)
    inner = engine.reader
    reader = inject(engine, fault, 3)
    with pytest.raises(StoreError) as err:
        run(engine)
    assert reader.injected is not None and err.value.errno == errno.EIO
    assert str(kv_path) in str(err.value) and "check the device" in str(err.value)
    assert files_under(kv_path) == []
    engine.reader = inner
    assert run(engine) == want


def test_a_read_that_hangs_past_the_deadline_fails_the_request_and_the_next_one_runs(engine, kv_path):
    want = run(engine)
    inner = engine.reader
    reader = inject(engine, "hang", 2)
    reader.hang_s = 30.0
    with pytest.raises(StoreError) as err:
        run(engine)
    assert err.value.errno == errno.ETIMEDOUT and "read_deadline_s=0.5" in str(err.value)
    assert files_under(kv_path) == []
    reader.released.set()  # the device answers at last: its read lands in memory kept for it
    engine.reader = inner
    assert run(engine) == want


def _failing_pwrite(after: int):
    calls = {"n": 0}
    real = os.pwrite

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)
    return pwrite


@pytest.mark.parametrize("after,phase", [(1, "prefill"), (4, "flush")])
def test_a_full_disk_during_prefill_or_a_group_flush_is_named(engine, kv_path, monkeypatch, after, phase):
    """4 layer writes of prefill (2 sequences x 2 layers), then the flushes of decode."""
    want = run(engine)
    steps = []
    engine.events.subscribe(lambda e: steps.append(e) if e.kind == "decode_step_start" else None)
    monkeypatch.setattr(disk_store_mod.os, "pwrite", _failing_pwrite(after))
    with pytest.raises(StoreError) as err:
        run(engine)
    assert err.value.errno == errno.ENOSPC and "free space there or pick another --kv-path" in str(err.value)
    assert str(kv_path) in str(err.value)
    assert bool(steps) == (phase == "flush")
    assert files_under(kv_path) == []
    monkeypatch.undo()
    assert run(engine) == want


@pytest.fixture
def small_fs(tmp_path):
    """A real 192 KiB tmpfs: prefill's 4 x 14 records of 4 KiB fit, the first flushes do not.  Root only."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=232k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({done.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_filesystem_fails_the_request_cleanly(model_dirs, small_fs):
    with Engine.from_pretrained(model_dirs["llama"], kv_path=small_fs, config=CFG, policy="kvswap",
                                device="cpu") as engine:
        with pytest.raises(StoreError) as err:
            engine.generate(PROMPTS, max_new_tokens=40, stop_token_ids=[])
        assert err.value.errno == errno.ENOSPC and str(small_fs) in str(err.value)
        assert files_under(small_fs) == []
        assert len(engine.generate(PROMPTS[:1], max_new_tokens=2, stop_token_ids=[])[0].token_ids) == 2


def test_a_kv_path_that_disappears_mid_decode(engine, kv_path):
    """Open files outlive their folder (the request finishes, the same tokens); the next request names the path."""
    want = run(engine)
    gone = []

    def remove(event):
        if event.kind == "decode_step_start" and event.info["step"] == 2 and not gone:
            shutil.rmtree(kv_path)
            gone.append(True)
    engine.events.subscribe(remove)
    assert run(engine) == want and gone
    with pytest.raises(StoreError, match=f"{kv_path} does not exist"):
        run(engine)
    kv_path.mkdir()
    assert run(engine) == want


# ---- the store's own checks, many faults at a time -----------------------------------------------

@pytest.mark.parametrize("gap_records", [0, 4])  # 4: a damaged record may sit between gaps read through
def test_a_thousand_flipped_torn_and_misplaced_records_are_all_caught(tmp_path, gap_records):
    layout = RecordLayout(4, 2, 16, torch.float16)
    rng = np.random.default_rng(0)
    reader = open_reader("python", 8)
    store = DiskKVStore(tmp_path, 2, layout, reader, max_groups=64, gap_bytes=gap_records * layout.stride_bytes)
    try:
        store.open_sequence(0)
        for layer in range(2):
            k, v = (torch.randn(2, 64 * 4, 16, dtype=torch.float16, generator=torch.Generator().manual_seed(layer))
                    for _ in range(2))
            store.write_groups(0, layer, 0, layout.pack(k, v))
        out = aligned_zeros((8, layout.stride_bytes), layout.align_bytes)
        caught = 0
        for trial in range(1200):
            layer, groups = int(rng.integers(2)), rng.choice(64, 8, replace=False)
            target = int(rng.integers(8))
            fd, offset = int(store._fds[0, layer, 0]), int(groups[target]) * layout.stride_bytes
            original = _get(fd, layout.record_bytes, offset)
            kind = trial % 3
            if kind == 0:  # one bit
                byte, bit = int(rng.integers(layout.record_bytes)), int(rng.integers(8))
                damaged = bytearray(original)
                damaged[byte] ^= 1 << bit
            elif kind == 1:  # torn: the tail never written
                cut = int(rng.integers(1, layout.record_bytes))
                damaged = original[:cut] + bytes(layout.record_bytes - cut)
            else:  # a whole, valid record of another group at this offset (a misdirected write)
                other = (int(groups[target]) + 1 + int(rng.integers(63))) % 64
                damaged = _get(fd, layout.record_bytes, other * layout.stride_bytes)
            _put(fd, offset, bytes(damaged))
            batch = store.batch(layer, np.zeros(8, dtype=np.int64), groups, out.ctypes.data + np.arange(8) * layout.stride_bytes)
            with pytest.raises(CorruptRecord) as err:
                store.read(batch)
            e = err.value
            caught += (e.layer, e.group, e.seq, e.record) == (layer, int(groups[target]), 0, int(groups[target]))
            assert e.path.endswith(f"seq0_layer{layer}.kv") and e.blob is None
            _put(fd, offset, original)
        assert caught == 1200
        store.read(batch)  # restored: reads clean again
    finally:
        store.close()
        reader.close()


def _get(fd: int, nbytes: int, offset: int) -> bytes:
    own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    try:
        return os.pread(own, nbytes, offset)
    finally:
        os.close(own)


def _put(fd: int, offset: int, data: bytes) -> None:
    rewrite(fd, offset, len(data), lambda _: data)


# ---- the context store: a damaged chunk is a miss ---------------------------------------------------

@pytest.fixture
def stored(model_dirs, tmp_path):
    ids = torch.randint(1, 160, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    kv = tmp_path / "kv"
    kv.mkdir()
    engine = Engine.from_pretrained(model_dirs["llama"], kv_path=kv, config=CFG, policy="kvswap", device="cpu")
    engine.open_context_store(tmp_path / "store", chunk_tokens=32)
    want = engine.generate([ids], max_new_tokens=6, stop_token_ids=[])[0].token_ids
    saved = engine.save_context(ids[:96], name="doc")
    yield engine, ids, want, saved
    engine.close()


def _flip_blob(engine, ref, offset: int) -> None:
    path = engine.context_store.backend.blob_path(ref.hash)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["record", "trailer"])
def test_a_damaged_stored_chunk_is_a_miss_computed_again_and_saved_again(stored, where, caplog):
    engine, ids, want, saved = stored
    ref = saved.chunks[1]
    records = engine.context_store.read_bytes_per_chunk_layer(ref) * engine.model.dims.n_layers
    _flip_blob(engine, ref, 5000 if where == "record" else records + 70)
    fresh = engine.context_store
    fresh._trailers.clear()  # as a new process would: nothing read yet
    engine.ttft = TTFTOptions("load_only")  # every stored chunk is read at prefill (a planner may compute some)
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        got = engine.generate([ids], max_new_tokens=6, stop_token_ids=[])[0].token_ids
    assert got == want
    assert "is damaged" in caplog.text or "failed its checksum twice" in caplog.text
    assert ref.hash not in fresh._index["chunks"] and not fresh.backend.blob_path(ref.hash).exists()
    assert fresh.contexts()[0]["complete"] is False
    engine.save_context(ids[:96], name="doc")  # replaced
    assert fresh.contexts()[0]["complete"] is True
    assert engine.generate([ids], max_new_tokens=6, stop_token_ids=[])[0].token_ids == want


def test_a_stored_chunk_damaged_where_decode_reads_it_in_place_is_dropped_and_the_batch_runs_again(stored, caplog):
    """Prefill computes every chunk (the stored blobs still serve decode's reads in place): the damage meets a
    decode step, which names the blob; the chunk is dropped and the batch runs again from its tokens."""
    engine, ids, want, saved = stored
    store, stride = engine.context_store, engine.context_store.layout.stride_bytes
    damaged = [r for r in saved.chunks[:-1]]
    for ref in damaged:  # one bit in every record of every full chunk: whatever decode picks there fails
        for record in range(store.read_bytes_per_chunk_layer(ref) * engine.model.dims.n_layers // stride):
            _flip_blob(engine, ref, record * stride + 7)
    store._trailers.clear()
    engine.ttft = TTFTOptions("full_prefill")
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        got = engine.generate([ids], max_new_tokens=6, stop_token_ids=[])[0].token_ids
    assert got == want
    assert "failed its checksum twice" in caplog.text and "chunks" in caplog.text  # the blob's path
    assert sum(ref.hash not in store._index["chunks"] for ref in damaged) >= 1


def test_a_damaged_chunk_read_directly_raises_chunk_corrupt_naming_it(stored):
    engine, _, _, saved = stored
    ref = saved.chunks[0]
    _flip_blob(engine, ref, 100)
    out = aligned_zeros((ref.n_tokens // 4, engine.context_store.layout.stride_bytes), 4096)
    with pytest.raises(ChunkCorrupt, match=ref.hash[:16]):
        engine.context_store.read(ref, 0, out)


def test_the_trailer_names_what_it_checks():
    sums = np.arange(6, dtype=np.uint32).reshape(2, 3)
    fp = "ab" * 32
    data = Trailer(fp, 1024, 8, sums).pack(4096)
    assert len(data) == Trailer.nbytes(2, 3, 4096) == 4096
    back = Trailer.unpack(data, 2, 3, 1024, 8, fp)
    assert (back.sums == sums).all()
    for args, what in [((2, 3, 1024, 9, fp), "first_group"), ((2, 3, 512, 8, fp), "record_bytes"),
                       ((2, 3, 1024, 8, "cd" * 32), "fingerprint"), ((3, 3, 1024, 8, fp), "layers")]:
        with pytest.raises(ValueError, match=what):
            Trailer.unpack(data, *args)


# ---- the context store's other files: one flipped byte anywhere ----------------------------------------------

def test_every_file_of_a_stored_context_survives_flipped_bytes():
    """The CI share of the campaign (docs/results/faults/faults-store-flips.json runs 700): every file flipped 6 times."""
    result = run_store_flips(42, progress=False, device="cpu")
    assert result["undamaged_equals_no_store"]
    assert {k: (r["files"], r["flips"]) for k, r in result["by_kind"].items()} == {
        "store.json": (1, 6), "index.json": (1, 6), "context": (1, 6), "blob": (4, 24)}
    assert result["totals"]["wrong"] == 0 and result["totals"]["opaque"] == 0, result["failures"]
    assert result["by_kind"]["context"]["named_error"] == 6  # its ids are nowhere else: asking for it names the file
    assert result["by_kind"]["index.json"]["same"] == result["by_kind"]["store.json"]["same"] == 6  # rebuilt, restored


def test_the_store_campaign_catches_a_store_that_trusts_its_context_files(monkeypatch):
    """The campaign can fail: a context file read without its checks gives other ids (wrong tokens) or a bare
    JSON error (opaque)."""
    def trusting(self, rel, data, name=None, entry=None):
        return json.loads(data)

    monkeypatch.setattr(ContextStore, "_context_body", trusting)
    result = run_store_flips(8, kinds=("context",), progress=False, device="cpu")
    assert result["totals"]["wrong"] + result["totals"]["opaque"] > 0


def test_generate_with_a_context_whose_index_or_store_json_was_damaged_answers_as_before(tmp_path, capsys):
    """The issue's repro: one flipped byte of index.json made `edgekv generate --context doc` fail with
    "error: Expecting value"; now the store rebuilds it and the answer is unchanged."""
    doc, store = tmp_path / "doc.json", tmp_path / "store"
    doc.write_text(json.dumps(list(range(3, 90))))
    base = ["--model", "fixture", "--store", str(store)]
    assert main(["context", "save", "doc", str(doc), "--chunk-tokens", "32", *base]) == 0
    generate = ["generate", *base, "--policy", "full", "--context", "doc", "--prompt", "[5, 6]", "--json",
                "--max-new-tokens", "6"]
    capsys.readouterr()
    assert main(generate) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    for name in ("index.json", "store.json"):
        data = bytearray((store / name).read_bytes())
        data[0] ^= 0x5A  # '{' -> '!': no longer JSON
        (store / name).write_bytes(bytes(data))
        assert main(generate) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["token_ids"] == want


@pytest.mark.parametrize("policy", ["full", "kvswap"])
def test_a_step_past_a_rows_max_context_is_refused_by_name(model_dirs, kv_path, policy):
    """The batch API (a bench's or a server's loop) stepping a row that holds max_context tokens gets a named error,
    not a shape error from deep in a cache that has no room for the token."""
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CFG, policy=policy,
                                device="cpu") as engine, engine.open_batch(1, CFG["max_context"]) as batch:
        batch.join(0, [1 + i % 150 for i in range(CFG["max_context"] - 3)])
        batch.end_prefill()
        for _ in range(3):  # the last three tokens that fit
            batch.step(torch.tensor([5]))
        with pytest.raises(ValueError, match=f"row 0 holds max_context={CFG['max_context']} tokens"):
            batch.step(torch.tensor([5]))
