"""The shipped fixture model: a real retriever, and the low-rank predictor, not luck, keeps its answers."""
import json

import numpy as np
import pytest
from transformers import LlamaForCausalLM

from edgekv.evals import harness
from edgekv.evals.tasks import TASKS
from edgekv.runtime.checkpoints import resolve_checkpoint

FIXTURE = resolve_checkpoint("fixture")
CONTEXT = 1024
SAMPLES = 8


@pytest.fixture(scope="module")
def accuracy(tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    variants = [harness.Variant("full"), harness.Variant("kvswap", 1 / 13), harness.Variant("kvswap", 1 / 13, selector="random", ablation="random")]
    results = harness.evaluate(FIXTURE, kv, variants, [CONTEXT], list(TASKS), SAMPLES, seed=0,
                               quiet=True)
    return {label: np.mean([r.accuracy for r in results if r.variant == label]) for label in
            ("full", "kvswap@1/13", "kvswap@1/13,random")}


def test_fixture_is_a_small_gqa_llama():
    model = LlamaForCausalLM.from_pretrained(FIXTURE)
    cfg = model.config
    assert cfg.num_hidden_layers >= 4 and cfg.num_key_value_heads >= 2
    assert cfg.num_attention_heads // cfg.num_key_value_heads >= 2 and 64 <= cfg.head_dim <= 128
    assert sum(f.stat().st_size for f in FIXTURE.glob("*.safetensors")) < 8 * 2**20
    log = json.loads((FIXTURE / "train_log.json").read_text())
    assert log["trained_context"] >= CONTEXT


def test_full_kv_accuracy_on_the_fixed_set(accuracy):
    assert accuracy["full"] >= 0.90


def test_random_groups_score_much_worse(accuracy):
    """The same budget with uniformly drawn groups: retrieval collapses, so the predictor is what works."""
    assert accuracy["kvswap@1/13,random"] <= accuracy["full"] - 0.30
    assert accuracy["kvswap@1/13"] >= accuracy["kvswap@1/13,random"] + 0.30


def test_kvswap_keeps_full_kv_answers(accuracy):
    """The comparison that matters: the same tasks with 1/13 of the KV in memory answer as the whole cache does
    (measured 0.925 against 0.900 at 1K; within 5 points)."""
    assert accuracy["kvswap@1/13"] >= accuracy["full"] - 0.05
