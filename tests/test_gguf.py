"""GGUF checkpoints through edgekv: a tiny file written like llama.cpp's converter (tests/gguf_writer.py),
served exactly like the safetensors checkpoint it came from, converted once and never stale."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from edgekv.runtime import Engine, ModelError  # noqa: E402
from edgekv.runtime import checkpoints  # noqa: E402
from tests.gguf_writer import save_bpe_text_model, write_gguf  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} : {{ m['content'] }} .{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant :{% endif %}")
CONFIG = {"G": 4, "M": 64, "C": 64, "max_context": 256, "max_batch": 2, "sigma": 4}  # every group selected: exact
PROMPTS = ["The grass is green. The sky is blue. A quiet river runs past the old mill,",
           "People walk to the market, and the morning light falls on the stones."]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_and_gguf(request, tmp_path_factory):
    """(HF folder, GGUF file in a folder of its own) of the same random weights: llama (GQA) and qwen2 (q/k/v bias)."""
    root = tmp_path_factory.mktemp(request.param)
    hf = save_bpe_text_model(root / "hf", request.param)
    (root / "gguf").mkdir()
    return hf, write_gguf(hf, root / "gguf" / "tiny.gguf", chat_template=TEMPLATE)


def generate(model, kv_path, policy):
    with Engine.from_pretrained(model, kv_path=kv_path, config=CONFIG, policy=policy, device="cpu") as engine:
        return engine.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[], output_logits=True)


@pytest.mark.parametrize("policy", ["full", "kvswap"])
def test_gguf_serves_exactly_like_its_safetensors_checkpoint(hf_and_gguf, kv_path, policy):
    hf, gguf_file = hf_and_gguf
    reference = generate(hf, kv_path, policy)
    got = generate(gguf_file, kv_path, policy)
    for ref, res in zip(reference, got):
        assert res.token_ids == ref.token_ids and res.stats["prompt_tokens"] == ref.stats["prompt_tokens"]
        torch.testing.assert_close(res.logits, ref.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "kvswap", "token", "arkv"])
def test_a_gemma3_gguf_serves_hybrid_attention_like_hf(tmp_path, kv_path, policy):
    """A Gemma 3 file (its extra norms stored as 1 + w, a window of 8 tokens, the default six-layer pattern over 7
    layers: local x5, global, local) gives Hugging Face's greedy tokens from the folder it was written from."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import save_model

    hf = save_model(tmp_path / "hf", "gemma3", num_hidden_layers=7)
    gguf_file = write_gguf(hf, tmp_path / "gemma.gguf", tokenizer=False)
    prompt = list(range(3, 40))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    with Engine.from_pretrained(gguf_file, kv_path=kv_path, config=CONFIG, policy=policy, device="cpu") as engine:
        assert engine.model.dims.global_layers == (5,)
        got = engine.generate([prompt], max_new_tokens=8, stop_token_ids=[])[0]
    assert got.token_ids == expected[0, len(prompt):].tolist()


def test_tokenizer_and_chat_template_come_from_the_file(hf_and_gguf, kv_path):
    _, gguf_file = hf_and_gguf
    with Engine.from_pretrained(gguf_file.parent, kv_path=kv_path, config=CONFIG,
                                policy="full", device="cpu") as engine:
        assert engine.tokenizer.chat_template == TEMPLATE
        out = engine.generate(["the value of bab"], chat=True, max_new_tokens=3, stop_token_ids=[])[0]
        assert engine.tokenizer.decode(out.token_ids) == out.text
        expected = engine.tokenizer.apply_chat_template([{"role": "user", "content": "the value of bab"}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=True)
        assert out.stats["prompt_tokens"] == len(expected["input_ids"])


def test_conversion_is_cached_by_content_and_never_stale(hf_and_gguf, tmp_path, monkeypatch):
    hf, gguf_file = hf_and_gguf
    first = checkpoints.resolve_checkpoint(gguf_file)
    assert checkpoints.gguf_source(first) == gguf_file.resolve()
    calls = []
    real = checkpoints._write_hf_folder
    monkeypatch.setattr(checkpoints, "_write_hf_folder", lambda *a: calls.append(a) or real(*a))
    assert checkpoints.resolve_checkpoint(gguf_file) == first and calls == []  # reused, not converted again
    changed = tmp_path / "changed" / "tiny.gguf"
    changed.parent.mkdir()
    write_gguf(hf, changed, chat_template=TEMPLATE, dtype="f16")  # same path name, other content
    second = checkpoints.resolve_checkpoint(changed)
    assert second != first and len(calls) == 1
    assert not [p for p in second.parent.iterdir() if p.name.startswith(".")]  # no staging folders left


def test_unsupported_gguf_architecture_is_refused_before_conversion(hf_and_gguf, tmp_path, monkeypatch):
    hf, _ = hf_and_gguf
    odd = write_gguf(hf, tmp_path / "odd.gguf", arch="gpt2", tokenizer=False)
    monkeypatch.setattr(checkpoints, "_write_hf_folder", lambda *a: pytest.fail("converted an unsupported model"))
    with pytest.raises(ModelError, match=r"'gpt2' model; edgekv serves \['llama', 'qwen2', 'qwen3', 'mistral', 'gemma3'\]"):
        checkpoints.resolve_checkpoint(odd)


def test_a_damaged_gguf_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelError, match="bad.gguf is not a readable GGUF file"):
        checkpoints.resolve_checkpoint(bad)


def test_a_gguf_beside_other_files_brings_its_own_tokenizer(hf_and_gguf, tmp_path):
    """transformers would read a tokenizer.json next to the file (here: one without the chat template)."""
    import shutil

    hf, gguf_file = hf_and_gguf
    beside = tmp_path / "beside"
    shutil.copytree(hf, beside)
    shutil.copy(gguf_file, beside / "tiny.gguf")
    folder = checkpoints.resolve_checkpoint(beside / "tiny.gguf")
    assert checkpoints.load_tokenizer(folder).chat_template == TEMPLATE
