"""A prompt whose prefix is in the context store, through the engine and the CLI.

Every TTFT method must give full prefill's first token and greedy continuation (the stored KV is
lossless); the store must survive a restart, refuse another model's KV, and a remote store whose
server dies mid-transfer must only cost a recompute.
"""
import http.server
import json
import subprocess
import sys
import threading
from functools import partial

import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.ttft.prefill import METHODS, TTFTOptions

CONTEXT_TOKENS, QUESTION_TOKENS, NEW_TOKENS = 400, 37, 6  # 400 = 3 chunks of 128 + a 16-token partial chunk


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (CONTEXT_TOKENS + QUESTION_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def reference(ids):
    with Engine.from_pretrained("fixture", policy="full", device="cpu") as engine:
        return engine.generate([ids], max_new_tokens=NEW_TOKENS)[0].token_ids


def _engine(store_dir, policy="full", kv_path=None, dtype=None):
    engine = Engine.from_pretrained("fixture", policy=policy, kv_path=kv_path, dtype=dtype, device="cpu")
    engine.open_context_store(store_dir, chunk_tokens=128)
    return engine


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_full_prefills_tokens(tmp_path, ids, reference, method):
    with _engine(tmp_path / "store") as engine:
        stored = engine.save_context(ids[:CONTEXT_TOKENS], name="doc")
        assert stored.n_tokens == CONTEXT_TOKENS
        engine.ttft = TTFTOptions(method, link_mib_s=200.0)
        out = engine.generate([ids], max_new_tokens=NEW_TOKENS)[0]
        assert out.token_ids == reference
        stats = engine.prefill_stats[0]
        assert stats["stored_tokens"] == (0 if method == "full_prefill" else CONTEXT_TOKENS)
        if method == "load_only":
            assert stats["loaded"] == 4 * engine.model.dims.n_layers and stats["computed"] == 0


@pytest.mark.parametrize("policy", ["kvswap", "flexgen", "hillinfer"])
def test_disk_policies_decode_from_a_stored_prefix(tmp_path, ids, policy):
    kv = tmp_path / "kv"
    kv.mkdir()
    with Engine.from_pretrained("fixture", policy=policy, kv_path=kv, device="cpu") as plain:
        expected = plain.generate([ids], max_new_tokens=NEW_TOKENS)[0].token_ids
    with _engine(tmp_path / "store", policy=policy, kv_path=kv) as engine:
        engine.save_context(ids[:CONTEXT_TOKENS])
        out = engine.generate([ids], max_new_tokens=NEW_TOKENS)[0]
    assert engine.prefill_stats[0]["stored_tokens"] == CONTEXT_TOKENS
    assert out.token_ids == expected


def test_a_restart_keeps_contexts_and_another_dtype_is_refused(tmp_path, ids, reference):
    with _engine(tmp_path / "store") as engine:
        engine.save_context(ids[:CONTEXT_TOKENS], name="doc")
    with _engine(tmp_path / "store") as engine:  # a new process would see the same files
        out = engine.generate([ids[CONTEXT_TOKENS:]], max_new_tokens=NEW_TOKENS, context="doc")[0]
        assert out.token_ids == reference
        assert engine.prefill_stats[0]["stored_tokens"] == CONTEXT_TOKENS
    with _engine(tmp_path / "store", dtype=torch.bfloat16) as other:
        with pytest.raises(ValueError, match="doc"):
            other.context_ids("doc")
        other.generate([ids], max_new_tokens=1)
        assert other.prefill_stats == []  # no stored prefix of this dtype: computed, never loaded


class _Ranges(http.server.SimpleHTTPRequestHandler):
    """Static files with single Range requests (RFC 9110 §14.2); ``cut_after`` bytes into the n-th ranged
    response, the connection is closed (a server dying mid-transfer)."""

    ranged = 0
    cut_at = None

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.translate_path(self.path)
        rng = self.headers.get("Range")
        try:
            data = open(path, "rb").read()
        except OSError:
            self.send_error(404)
            return
        if not rng:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        first, last = (int(x) for x in rng.split("=")[1].split("-"))
        body = data[first:last + 1]
        type(self).ranged += 1
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.cut_at is not None and type(self).ranged == self.cut_at:
            self.wfile.write(body[: len(body) // 3])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


@pytest.mark.parametrize("cut_at", [None, 2, 5])
def test_remote_store_over_http_ranges_and_a_server_dying_mid_transfer(tmp_path, ids, reference, cut_at):
    with _engine(tmp_path / "store") as engine:
        engine.save_context(ids[:CONTEXT_TOKENS], name="doc")
    handler = type("H", (_Ranges,), {"ranged": 0, "cut_at": cut_at})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(tmp_path / "store")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        with Engine.from_pretrained("fixture", policy="full", device="cpu") as engine:
            engine.open_context_store(url, chunk_tokens=128)
            engine.ttft = TTFTOptions("load_only")
            out = engine.generate([ids[CONTEXT_TOKENS:]], max_new_tokens=NEW_TOKENS, context="doc")[0]
    finally:
        server.shutdown()
    assert out.token_ids == reference
    stats = engine.prefill_stats[0]
    assert stats["failed_loads"] == (0 if cut_at is None else 1)
    assert stats["computed"] == (0 if cut_at is None else stats["computed"]) and handler.ranged > 0


def _cli(*args, stdin=None):
    proc = subprocess.run([sys.executable, "-m", "edgekv.cli", *args], capture_output=True, text=True, input=stdin)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_save_list_generate_rm(tmp_path):
    text = json.dumps(list(b"The quick brown fox jumps over the lazy dog. " * 8))  # the fixture reads bytes as tokens
    saved = json.loads(_cli("context", "save", "fox", "--model", "fixture", "--kv-path", str(tmp_path),
                            "--chunk-tokens", "128", "-", stdin=text))  # the Interface's order: FILE after the options
    assert saved["name"] == "fox" and saved["stored_tokens"] > 0
    listed = [json.loads(line) for line in _cli("context", "list", "--kv-path", str(tmp_path)).splitlines()]
    assert [row["name"] for row in listed] == ["fox"]
    out = json.loads(_cli("generate", "--model", "fixture", "--policy", "full", "--kv-path", str(tmp_path),
                          "--context", "fox", "--prompt", json.dumps(list(b"And then")), "--max-new-tokens", "3", "--json"))
    assert out["stats"]["prompt_tokens"] > saved["stored_tokens"]
    alone = json.loads(_cli("generate", "--model", "fixture", "--policy", "full", "--kv-path", str(tmp_path),
                            "--context", "fox", "--max-new-tokens", "2", "--json"))  # the context alone, no prompt
    assert alone["stats"]["prompt_tokens"] == len(json.loads(text))
    _cli("context", "rm", "fox", "--kv-path", str(tmp_path))
    assert _cli("context", "list", "--kv-path", str(tmp_path)).strip() == ""


def test_ttft_command_writes_the_interface_json(tmp_path):
    out = tmp_path / "ttft.json"
    _cli("ttft", "--model", "fixture", "--contexts", "640", "--link-mib-s", "50", "--chunk-tokens", "128",
         "--new-tokens", "3", "--json", str(out), "--png", str(tmp_path / "ttft.png"), "--quiet", "--kv-path", str(tmp_path))
    runs = json.loads(out.read_text())["runs"]
    assert {r["method"] for r in runs} == set(METHODS)
    for r in runs:
        assert {"method", "context", "link_mib_s", "ttft_s", "tokens_match_full"} <= set(r)
        assert r["tokens_match_full"] is True and r["context"] == 640 and r["ttft_s"] > 0
    assert {r["link_mib_s"] for r in runs if r["method"] == "edgekv" and not r["crossover"]} == {50.0}
    assert (tmp_path / "ttft.png").stat().st_size > 0


def test_overlap_bound_is_below_every_schedule():
    import numpy as np

    from edgekv.runtime.ttft.grid import ChunkGrid
    from edgekv.runtime.ttft.plan import greedy_plan, plan_from_depths, random_plan, simulate
    from edgekv.ttft_bench import overlap_bound_s

    rng = np.random.default_rng(0)
    for _ in range(20):
        grid = ChunkGrid(int(rng.integers(2, 6)) * 64, 64, int(rng.integers(1, 6)))
        compute_s, load_s = rng.uniform(0.1, 2.0, grid.shape), rng.uniform(0.1, 2.0, grid.shape)
        bound = overlap_bound_s(compute_s, load_s)
        plans = [greedy_plan(grid, load_s, compute_s), random_plan(grid, rng),
                 plan_from_depths(grid, [0] * grid.n_chunks), plan_from_depths(grid, [grid.n_layers] * grid.n_chunks)]
        assert all(bound <= simulate(p, load_s, compute_s) + 1e-9 for p in plans)
        assert bound > 0
    assert overlap_bound_s(np.array([1.0, 1.0]), np.array([1.0, 1.0])) == 1.0
    assert abs(overlap_bound_s(np.array([2.0, 2.0]), np.array([1.0, 1.0])) - 4 / 3) < 1e-12


def test_the_disk_store_reads_a_stored_prefix_in_place_and_writes_only_the_rest(tmp_path, ids):
    """kvswap decodes straight from the store's blobs: a group of the prefix is read from its blob (chunk
    t = g // groups per chunk, layer-major inside), the sequence's own file gets only the groups after it."""
    import numpy as np

    from edgekv.runtime.disk_store import DiskKVStore, aligned_zeros
    from edgekv.runtime.reader import open_reader
    from edgekv.runtime.ttft.compute import PrefixKV
    from edgekv.runtime.forward import prefill

    with _engine(tmp_path / "store") as engine:
        model, store = engine.model, engine.context_store
        kv = PrefixKV(model, len(ids))
        prefill(model, ids, kv.put_prompt)
        stored = store.put(ids[:CONTEXT_TOKENS], [kv.layer(layer) for layer in range(model.dims.n_layers)])
        layout, G = store.layout, store.layout.group_tokens
        (tmp_path / "kv").mkdir()
        reader = open_reader("python", 8)
        disk = DiskKVStore(tmp_path / "kv", model.dims.n_layers, layout, reader)
        try:
            disk.open_sequence(0)
            disk.attach_prefix(0, [(store.backend.blob_path(r.hash), r.n_tokens // G, store.record_sums(r))
                                  for r in stored.chunks])
            n_groups, prefix = len(ids) // G, stored.n_tokens // G
            for layer in range(model.dims.n_layers):
                k, v = kv.layer(layer)
                disk.write_groups(0, layer, 0, layout.pack(k[:, : n_groups * G], v[:, : n_groups * G]))
            assert disk.bytes_written == model.dims.n_layers * (n_groups - prefix) * layout.stride_bytes
            groups = np.array([0, prefix // 2, prefix - 1, prefix, n_groups - 1])  # both sides of the boundary
            for layer in range(model.dims.n_layers):
                out = aligned_zeros((len(groups), layout.stride_bytes), layout.align_bytes)
                addresses = out.ctypes.data + np.arange(len(groups)) * layout.stride_bytes
                disk.read(disk.batch(layer, np.zeros(len(groups), np.int64), groups, addresses))
                k, v = kv.layer(layer)
                expected = layout.pack(k[:, : n_groups * G], v[:, : n_groups * G])[groups]
                assert (out[:, : layout.record_bytes] == expected[:, : layout.record_bytes]).all()
        finally:
            disk.close()
            reader.close()
        assert all(store.backend.blob_path(r.hash).exists() for r in stored.chunks)  # closed, never deleted


def test_a_deployed_cost_model_is_used_and_a_bad_one_is_named(tmp_path):
    from edgekv.runtime.config import ConfigError
    from edgekv.runtime.ttft.costs import ComputeCostModel

    model = ComputeCostModel((1e-4, 1e-6), (1e-3, 5e-5, 2e-8, 0.0))
    path = tmp_path / "ttft_costs.json"
    path.write_text(json.dumps({"predictor": model.to_json()}))
    with Engine.from_pretrained("fixture", policy="full", config={"ttft_costs_path": str(path)},
                                device="cpu") as engine:
        assert engine.ttft.compute_costs == model
    with pytest.raises(ConfigError, match="ttft_costs_path"):
        Engine.from_pretrained("fixture", policy="full", config={"ttft_costs_path": str(tmp_path / "missing.json")},
                               device="cpu")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("policy", ["full", "kvswap"])
def test_a_hybrid_model_from_a_stored_prefix_keeps_its_windows(tmp_path, policy, method):
    """Gemma 3 layers with an 8-token window over a stored 400-token context: every chunk computed again attends
    within its window, the local layers' rings are filled from the store, and the tokens are those of a prefill."""
    from tests.conftest import save_model

    folder = save_model(tmp_path / "gemma", "gemma3", num_hidden_layers=3, vocab_size=256,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    ids = torch.randint(0, 256, (CONTEXT_TOKENS + QUESTION_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()
    kv = tmp_path / "kv"
    kv.mkdir()
    config = {"max_context": 512, "G": 4, "M": 128, "C": 128, "sigma": 4}  # every group selected: exact
    with Engine.from_pretrained(folder, policy=policy, kv_path=kv, config=config, device="cpu") as plain:
        expected = plain.generate([ids], max_new_tokens=NEW_TOKENS)[0].token_ids
    with Engine.from_pretrained(folder, policy=policy, kv_path=kv, config=config, device="cpu") as engine:
        engine.open_context_store(tmp_path / "store", chunk_tokens=128)
        engine.save_context(ids[:CONTEXT_TOKENS])
        engine.ttft = TTFTOptions(method, link_mib_s=200.0)
        out = engine.generate([ids], max_new_tokens=NEW_TOKENS)[0]
    assert out.token_ids == expected
