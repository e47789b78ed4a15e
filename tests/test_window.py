"""Sinks and the local window: attended whatever the predictor says, counted in the memory plan."""
from __future__ import annotations

import pytest
import torch

from edgekv.runtime import Engine, RuntimeConfig
from edgekv.runtime.config import ConfigError
from edgekv.runtime.memory import plan_memory
from edgekv.runtime.model import ModelDims
from edgekv.runtime.selector import LowRankSelector

PROMPTS = [list(range(3, 62)), list(range(80, 103))]  # 59 and 23 tokens: not multiples of G
BASE = {"G": 4, "max_context": 96, "max_batch": 2, "sigma": 1, "reuse": False}


def scripted_scores(self, layer, q, n_tokens):
    """A predictor that ranks the first and the newest tokens lowest: distance to the nearer end."""
    position = torch.arange(n_tokens, dtype=torch.float32)
    return torch.minimum(position, n_tokens - 1 - position).expand(q.shape[0], -1).clone()


def run(model_dir, kv_path, policy, config):
    with Engine.from_pretrained(model_dir, kv_path=kv_path, config=config, policy=policy,
                                device="cpu") as engine:
        return engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[], output_logits=True)


@pytest.mark.parametrize("policy, M", [("kvswap", 17), ("token", 18)])
def test_sinks_and_window_are_attended_whatever_the_predictor_says(model_dirs, kv_path, monkeypatch, policy, M):
    """The longest history is 70 tokens on disk (17 groups of 4); M covers it only with the ends protected."""
    reference = run(model_dirs["llama"], kv_path, "full", BASE)
    monkeypatch.setattr(LowRankSelector, "token_scores", scripted_scores)
    kept = run(model_dirs["llama"], kv_path, policy, {**BASE, "M": M, "sink_tokens": 4, "window_tokens": 8})
    for ref, got in zip(reference, kept):
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
    # the same picks without the protection: the predictor drops the ends it scores lowest, and the output changes
    dropped = run(model_dirs["llama"], kv_path, policy, {**BASE, "M": M - 3})
    assert not torch.allclose(dropped[0].logits, reference[0].logits, rtol=1e-4, atol=1e-4)


def test_memory_plan_counts_sinks_and_window():
    dims = ModelDims(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden=64, vocab=256)
    token_bytes = 2 * 2 * 16 * 4
    cfg = RuntimeConfig.load({"G": 4, "M": 20, "C": 20, "sink_tokens": 6, "window_tokens": 32, "max_context": 512})
    parts = plan_memory("kvswap", cfg, dims, 4, 8, 512).per_sequence_bytes
    assert parts["sinks"] == 3 * 8 * token_bytes  # 6 tokens round up to 2 groups
    assert parts["rolling"] == 3 * (32 + 4) * token_bytes  # the window and the group being filled
    assert cfg.picked_groups == 20 - 2 - 8
    no_window = plan_memory("kvswap", RuntimeConfig.load({"G": 4, "M": 20, "C": 20, "max_context": 512}), dims, 4, 8, 512)
    assert no_window.per_sequence_bytes["sinks"] == 0 and no_window.per_sequence_bytes["rolling"] == 3 * 4 * token_bytes


def test_resident_bytes_match_the_plan_with_a_window(model_dirs, kv_path):
    config = {**BASE, "M": 10, "C": 10, "reuse": True, "sink_tokens": 4, "window_tokens": 16}
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu") as engine:
        result = engine.generate(PROMPTS, max_new_tokens=4, stop_token_ids=[])[0]
        assert result.stats["kv_resident_bytes"] == engine.memory_plan.total_bytes
        assert engine.memory_plan.per_sequence_bytes["sinks"] > 0


@pytest.mark.parametrize("fields, named", [({"sink_tokens": -1}, "'sink_tokens'"), ({"window_tokens": 2.5}, "'window_tokens'"),
                                           ({"M": 4, "sink_tokens": 4, "window_tokens": 12}, "raise M"),
                                           ({"M": 12, "C": 4, "window_tokens": 16}, "'C'")])
def test_bad_sink_and_window_fields_are_named(fields, named):
    with pytest.raises(ConfigError, match=named):
        RuntimeConfig.load({"G": 4, **fields})
