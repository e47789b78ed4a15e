"""Synthetic checkpoints (``--model synth:NAME``): the named architectures' exact shapes, random weights built on
the device, usable in generate and bench, and marked synthetic in what they report."""
import json

import pytest
import torch

from edgekv.cli import main
from edgekv.runtime import Engine, synth
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.model import ModelError, load_model

# parameter counts of the public checkpoints (their model cards: 1.24B, 3.21B, 8.03B, 7.62B)
PUBLISHED = {"llama-3.2-1b": 1.2358e9, "llama-3.2-3b": 3.2128e9, "llama-3.1-8b": 8.0301e9, "qwen2.5-7b": 7.6156e9}
TINY = {**synth.ARCHITECTURES["llama-3.2-1b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300}


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(synth.ARCHITECTURES, "tiny-llama", TINY)
    return "synth:tiny-llama"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_named_architecture_has_the_published_parameter_count(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_checkpoint(f"synth:{name}"))
    with torch.device("meta"):  # shapes only: nothing allocated
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert count == pytest.approx(PUBLISHED[name], rel=2e-3)


def test_an_unknown_architecture_is_refused_with_the_known_ones():
    with pytest.raises(ModelError, match=r"no synthetic architecture 'gpt-9'; pick one of \['llama-3.1-8b'"):
        resolve_checkpoint("synth:gpt-9")


def test_random_weights_are_built_on_the_device_in_the_dtype_and_marked(tiny):
    model = load_model(resolve_checkpoint(tiny), torch.device("cpu"), torch.bfloat16, 256)
    assert model.synthetic and model.dtype == torch.bfloat16 and model.dims.n_layers == 3
    assert model.hf.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()  # llama-3.2 ties its head
    assert model.hf.model.rotary_emb.inv_freq.dtype == torch.float32 and model.embed.weight.std() > 0.01


def test_generate_and_bench_run_synthetic_weights_and_say_so(tiny, kv_path, tmp_path, capsys):
    with Engine.from_pretrained(tiny, kv_path=kv_path, config={"max_context": 256, "G": 4, "M": 8, "C": 16},
                                device="cpu") as engine:
        result = engine.generate([list(range(3, 60))], max_new_tokens=4, stop_token_ids=[])[0]
        assert engine.model.dtype == torch.bfloat16  # the real checkpoint's dtype unless one is named, CPU too
    assert result.stats["synthetic_weights"] is True and len(result.token_ids) == 4
    assert main(["generate", "--model", tiny, "--prompt", "[5, 6, 7]", "--max-new-tokens", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["stats"]["synthetic_weights"] is True and "synthetic weights" in err
    bench_json = tmp_path / "bench.json"
    assert main(["bench", "--model", tiny, "--batches", "1", "--contexts", "256", "--budgets", "1/4", "--steps", "2",
                 "--warmup", "1", "--disk-seconds", "0.3", "--kv-path", str(tmp_path), "--policies", "full,kvswap",
                 "--json", str(bench_json), "--quiet"]) == 0
    meta = json.loads(bench_json.read_text())["meta"]
    assert meta["synthetic_weights"] is True and meta["device"] == "cpu" and "synthetic weights" in capsys.readouterr().out
