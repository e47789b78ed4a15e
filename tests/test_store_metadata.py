"""The context store's JSON files: paths from an index stay inside the store, --store takes only the
schemes it can serve, and damage to store.json, index.json or a context file is a miss named by file, never an
opaque error (the engine-level campaign is in test_faults.py)."""
import json
import logging
import re
import shutil

import pytest

from edgekv.cli import main
from edgekv.runtime.disk_store import aligned_zeros
from edgekv.runtime.store import ContextStore, ContextStoreError, HttpBackend, LocalBackend
from edgekv.runtime.store.meta import seal, unseal

from tests.store_helpers import C, assert_same_kv, blobs, make_kv, open_store, read_back

IDS = list(range(1, 30))  # 28 stored tokens: chunks of 8, 8, 8, 4


@pytest.fixture
def saved(tmp_path):
    """A store with a named context ``doc`` and an unnamed prefix; returns (root, kv of doc)."""
    root = tmp_path / "store"
    kv = make_kv(29, seed=3)
    store = open_store(root)
    store.put(IDS, kv, name="doc")
    store.put(list(range(200, 217)), make_kv(17, seed=4))
    return root, kv


def context_file(root):
    (path,) = (root / "contexts").glob("doc-*.json")
    return path


def flip(path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


# ---- paths from an index (defect 4) -------------------------------------------------------------------

@pytest.mark.parametrize("target", ["absolute", "dotdot"])
def test_an_index_naming_a_file_outside_the_store_is_refused_by_name(saved, tmp_path, caplog, target):
    root, _ = saved
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    named = str(victim) if target == "absolute" else "../victim"  # relative to the store folder
    pristine = (root / "index.json").read_bytes()

    def craft():
        """A hand-made index with a valid checksum: a context naming the victim, a chunk hash that is a path."""
        body, _ = unseal(pristine)
        body["contexts"]["doc"]["file"] = named
        body["chunks"]["../../x"] = next(iter(body["chunks"].values()))
        (root / "index.json").write_bytes(seal(body))

    craft()
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        assert main(["context", "rm", "doc", "--store", str(root)]) == 0
    assert "context 'doc'" in caplog.text and named in caplog.text and "'../../x'" in caplog.text
    assert "index.json no longer lists it" in caplog.text and victim.read_text() == "keep me"
    craft()
    store = open_store(root)
    with pytest.raises(ContextStoreError) as err:
        store.context_ids("doc")
    assert "'doc'" in str(err.value) and named in str(err.value) and "save the context again" in str(err.value)
    assert store.match(IDS + [0]).n_tokens == 28  # its chunks stay usable as prefixes
    store.remove("doc")
    assert victim.read_text() == "keep me"


def test_a_hand_edited_index_without_its_checksum_is_rebuilt_and_follows_nothing(saved, tmp_path):
    root, _ = saved
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    index = json.loads((root / "index.json").read_bytes())
    index["contexts"]["doc"]["file"] = str(victim)
    (root / "index.json").write_text(json.dumps(index))
    assert main(["context", "rm", "doc", "--store", str(root)]) == 0
    assert victim.read_text() == "keep me"
    assert open_store(root).contexts() == []


# ---- --store schemes (defect 5) ----------------------------------------------------------------------

@pytest.mark.parametrize("url", ["ftp://host/x", "s3://bucket/x", "file://otherhost/x"])
def test_a_store_url_of_another_scheme_is_refused_before_anything_is_created(tmp_path, monkeypatch, capsys, url):
    monkeypatch.chdir(tmp_path)
    scheme = url.split(":")[0]
    for call in (lambda: open_store(url), lambda: ContextStore.geometry_at(url)):
        with pytest.raises(ContextStoreError, match=f"{scheme}.*file:///folder, http://host/path or https://"):
            call()
    assert main(["context", "list", "--store", url]) == 2
    assert main(["generate", "--model", "fixture", "--store", url, "--prompt", "[1, 2]"]) == 2
    err = capsys.readouterr().err
    assert err.count(f"--store: context store {url!r}") == 2
    assert list(tmp_path.iterdir()) == []


def test_a_file_url_names_the_local_folder(saved, tmp_path, monkeypatch, capsys):
    root, kv = saved
    monkeypatch.chdir(tmp_path)  # where the old code made the folder ./file:/...
    store = open_store(f"file://{root}")
    assert store.root == root and store.context_ids("doc") == IDS
    assert ContextStore.geometry_at(f"file://{root}")["chunk_tokens"] == C
    assert main(["context", "list", "--store", f"file://{root}"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "doc"
    assert not (tmp_path / "file:").exists()


# ---- damaged metadata (defect 9) -----------------------------------------------------------------------

def test_a_damaged_index_is_rebuilt_from_the_context_files_and_the_blobs(saved, caplog):
    root, kv = saved
    before = json.loads((root / "index.json").read_bytes())
    flip(root / "index.json", 40)
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        store = open_store(root)
    assert "index.json is damaged" in caplog.text and "rebuilt" in caplog.text
    after, sealed = unseal((root / "index.json").read_bytes())
    assert sealed and after["contexts"]["doc"]["chunks"] == before["contexts"]["doc"]["chunks"]
    assert set(after["chunks"]) == set(before["contexts"]["doc"]["chunks"])  # the unnamed prefix cannot be placed
    assert {p.stem for p in blobs(root)} == set(after["chunks"])  # index ⊆ blobs, orphans removed
    assert store.context_ids("doc") == IDS
    assert_same_kv(read_back(store, store.match(IDS + [0])), kv, 28)


def test_a_rebuild_admits_no_blob_whose_trailer_names_another_chunk(saved):
    root, _ = saved
    hashes = json.loads((root / "index.json").read_bytes())["contexts"]["doc"]["chunks"]
    shutil.copyfile(root / "chunks" / f"{hashes[0]}.kv", root / "chunks" / f"{hashes[1]}.kv")  # same size, group 0
    (root / "index.json").write_text("{")
    store = open_store(root)
    assert store.match(IDS + [0]).n_tokens == 8
    (doc,) = store.contexts()
    assert doc["usable_tokens"] == 8 and not doc["complete"]


def test_a_damaged_store_json_is_restored_from_the_index(saved, caplog):
    root, kv = saved
    pristine = (root / "store.json").read_bytes()
    flip(root / "store.json", pristine.index(b'"group_tokens": 4') + 16)  # 4 -> 5
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        assert ContextStore.geometry_at(root)["group_tokens"] == 4
        store = open_store(root)
    assert "store.json is damaged" in caplog.text and "restored from index.json" in caplog.text
    assert (root / "store.json").read_bytes() == pristine
    assert_same_kv(read_back(store, store.match(store.context_ids("doc") + [0])), kv, 28)
    (root / "store.json").write_text("")
    (root / "index.json").write_text("{")
    with pytest.raises(ContextStoreError, match=r"store.json is damaged .* holds no intact copy .* move the folder away"):
        open_store(root)


def test_a_damaged_context_file_drops_that_context_by_name_and_keeps_its_chunks(saved, caplog):
    root, kv = saved
    path = context_file(root)
    data = path.read_bytes()
    flip(path, re.search(rb'"ids": ?\[1, ?2, ?3', data).end() - 1)  # an id 3 -> 2: another context, still JSON
    store = open_store(root)
    with caplog.at_level(logging.WARNING, logger="edgekv"), pytest.raises(ContextStoreError) as err:
        store.context_ids("doc")
    assert path.name in str(err.value) and "save it again" in str(err.value) and path.name in caplog.text
    with pytest.raises(ContextStoreError, match=path.name):  # asked again: the same answer
        store.context_ids("doc")
    assert open_store(root).contexts() == [] and not path.exists()
    assert_same_kv(read_back(store, store.match(IDS + [0])), kv, 28)


def test_a_format_2_store_is_migrated_with_its_blobs_unchanged(saved):
    root, kv = saved
    blob_bytes = {p.name: p.read_bytes() for p in blobs(root)}
    geometry, _ = unseal((root / "store.json").read_bytes())
    (root / "store.json").write_text(json.dumps({**geometry, "format": 2}, indent=1))
    index, _ = unseal((root / "index.json").read_bytes())
    (root / "index.json").write_text(json.dumps({**{k: v for k, v in index.items() if k != "geometry"}, "format": 2}))
    body, _ = unseal(context_file(root).read_bytes())
    context_file(root).write_text(json.dumps({k: v for k, v in body.items() if k != "saved_at"}))

    store = open_store(root)
    assert store.context_ids("doc") == IDS
    assert_same_kv(read_back(store, store.match(IDS + [0])), kv, 28)
    for path in (root / "store.json", root / "index.json", context_file(root)):
        found, sealed = unseal(path.read_bytes())
        assert sealed and found.get("format", 3) == 3
    assert {p.name: p.read_bytes() for p in blobs(root)} == blob_bytes
    (root / "store.json").write_text(json.dumps({**geometry, "format": 1}))
    with pytest.raises(ContextStoreError, match="has format 1 .*store.json.* move that folder away"):
        open_store(root)


def test_a_published_store_with_a_damaged_index_computes_every_prompt_and_says_why(range_server, caplog):
    local = open_store(range_server.root)
    local.put(IDS, make_kv(29), name="doc")
    flip(range_server.root / "index.json", 10)
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        remote = open_store(range_server.url, timeout_s=5)
    assert "index.json is damaged" in caplog.text and "publish the store folder again" in caplog.text
    assert remote.match(IDS + [0]) is None
    with pytest.raises(ContextStoreError, match=r"no saved context named 'doc'.*index.json is damaged"):
        remote.context_ids("doc")


def test_the_backends_refuse_paths_and_blob_names_that_leave_the_store(tmp_path):
    out = aligned_zeros((4096,), 4096)
    for backend in (LocalBackend(tmp_path), HttpBackend("http://127.0.0.1:9/store/", timeout_s=1)):
        for rel in ("/etc/passwd", "../x", "contexts/../../x"):
            with pytest.raises(ContextStoreError, match="not a path inside the store"):
                backend.read_file(rel)
        with pytest.raises(ContextStoreError, match="not a chunk hash"):
            backend.read_range("../../x", 0, 4096, out)
