"""Bad input gets a clear error naming the problem, and leaves no files behind."""
import json

import pytest

from edgekv.runtime import BudgetError, ConfigError, Engine, ModelError, StoreError
from tests.conftest import files_under

SMALL_CFG = {"G": 4, "M": 8, "C": 16, "max_context": 128, "max_batch": 2}


def test_a_missing_kv_path_is_refused(model_dirs, tmp_path):
    with pytest.raises(StoreError, match="kv_path .* does not exist"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=tmp_path / "absent", config=SMALL_CFG, device="cpu")
    with pytest.raises(StoreError, match="required"):
        Engine.from_pretrained(model_dirs["llama"], config=SMALL_CFG, device="cpu")
    assert not (tmp_path / "absent").exists()


def test_the_old_kv_offload_path_keyword_still_works_and_warns(model_dirs, kv_path):
    """``kv_offload_path`` is read as ``kv_path`` for one release, in either constructor, with a DeprecationWarning
    naming the new keyword at the caller's line; both keywords at once are refused."""
    with pytest.warns(DeprecationWarning, match="'kv_offload_path' is now 'kv_path'") as warned:
        engine = Engine.from_pretrained(model_dirs["llama"], kv_offload_path=kv_path, config=SMALL_CFG, device="cpu")
    assert [w.filename for w in warned] == [__file__]
    with engine:
        assert (engine.kv_path, engine.kv_paths, engine.policy_name) == (kv_path, [kv_path], "kvswap")
        with pytest.warns(DeprecationWarning, match="'kv_offload_path' is now 'kv_path'") as warned:
            again = Engine(engine.model, engine.config, "full", kv_offload_path=[kv_path])
        assert [w.filename for w in warned] == [__file__]
        with again:
            assert (again.kv_paths, again.policy_name) == ([kv_path], "full")
    with pytest.raises(TypeError, match="kv_path and kv_offload_path"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, kv_offload_path=kv_path, config=SMALL_CFG,
                               device="cpu")


def test_unsupported_architecture_names_it_and_the_list(tmp_path, kv_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match=r"GPT2LMHeadModel.*llama.*qwen2.*qwen3.*mistral"):
        Engine.from_pretrained(tmp_path / "gpt2", kv_path=kv_path, config=SMALL_CFG, device="cpu")
    with pytest.raises(ModelError, match="no config.json"):
        Engine.from_pretrained(tmp_path, kv_path=kv_path, config=SMALL_CFG, device="cpu")


@pytest.mark.parametrize("edit, named", [
    ({"layer_types": ["sliding_attention"]}, "field 'layer_types' must list 3"),
    ({"layer_types": ["sliding_attention", "local", "full_attention"]}, "field 'layer_types'"),
    ({"sliding_window": 0}, "field 'sliding_window' must be a positive integer"),
    ({"sliding_window": None}, "'sliding_window' is None"),
    ({"attn_logit_softcapping": 50.0}, "soft-capping"),
])
def test_a_bad_window_layout_is_named_before_loading(tmp_path, kv_path, edit, named):
    """Sliding-window checkpoints are served (tests/test_model_matrix.py); a config.json whose window layout is
    malformed is refused naming the field, before any weight is read."""
    import json

    from tests.conftest import save_model

    folder = save_model(tmp_path / "m", "gemma3", num_hidden_layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    cfg_path = tmp_path / "m" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **edit}))
    with pytest.raises(ModelError, match=named):
        Engine.from_pretrained(folder, kv_path=kv_path, config=SMALL_CFG, device="cpu")


@pytest.mark.parametrize("policy", ["kvswap", "full"])
def test_prompt_longer_than_max_context_and_empty_prompts(model_dirs, kv_path, policy):
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=SMALL_CFG, policy=policy,
                                device="cpu") as engine:
        with pytest.raises(ValueError, match="prompt 1 has 200 tokens but max_context is 128"):
            engine.generate([[1, 2, 3], [5] * 200])
        with pytest.raises(ValueError, match="prompts is empty"):
            engine.generate([])
        with pytest.raises(ValueError, match="prompt 0 is empty"):
            engine.generate([[]])
        with pytest.raises(ValueError, match="has no tokenizer"):
            engine.generate(["some text"])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.generate([[1, 99999]])
    assert files_under(kv_path) == []


def test_over_budget_config_names_budget_and_need(model_dirs, kv_path):
    with pytest.raises(BudgetError, match=r"needs \d+\.\d MiB .* max_kv_mem_mib is 0\.01 MiB"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**SMALL_CFG, "max_kv_mem_mib": 0.01},
                               device="cpu")
    assert files_under(kv_path) == []


@pytest.mark.parametrize("policy, extra", [("kvswap", {}), ("kvswap", {"replacement": "cost", "clustering": True}),
                                           ("hillinfer", {}), ("token", {})])
def test_budget_counts_what_is_allocated(model_dirs, kv_path, policy, extra):
    """Every array the policy keeps counts: slots, the slot table's index, placement tables, HillInfer's index."""
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**SMALL_CFG, **extra},
                                policy=policy, device="cpu") as engine:
        result = engine.generate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], max_new_tokens=3, stop_token_ids=[])
        assert result[0].stats["kv_resident_bytes"] == engine.memory_plan.total_bytes
        fits = engine.memory_plan.total_bytes / 2**20
    Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**SMALL_CFG, **extra, "max_kv_mem_mib": fits},
                           policy=policy, device="cpu").close()


@pytest.mark.parametrize(
    "config, field",
    [({"G": 0}, "'G'"), ({"bogus": 1}, "bogus"), ({"C": 4, "M": 8}, "'C'"), ({"sigma": None}, "'sigma'"),
     ({"reader_backend": "dma"}, "reader_backend"), ({"io_align_bytes": 1000}, "io_align_bytes")],
)
def test_bad_config_names_the_field(model_dirs, kv_path, config, field):
    with pytest.raises(ConfigError, match=field):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu")


def test_unknown_policy(model_dirs, kv_path):
    with pytest.raises(ConfigError, match="unknown policy 'magic'"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=SMALL_CFG, policy="magic",
                               device="cpu")


def test_config_from_json_file(model_dirs, kv_path, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_CFG))
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=str(path), device="cpu") as engine:
        assert engine.config.M == 8
    with pytest.raises(ConfigError, match="does not exist"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=str(tmp_path / "nope.json"),
                               device="cpu")
