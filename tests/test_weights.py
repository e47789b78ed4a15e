"""The linear layers' weight format (runtime/model.py WEIGHT_FORMATS): int8 is PyTorch's dynamic int8 linear on the
CPU; it has its own fingerprint (its K/V differ), and a device or dtype it cannot run on is refused before loading."""
import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.model import ModelError, load_model
from edgekv.runtime.store.fingerprint import model_fingerprint

PROMPT = [(i * 7) % 250 + 4 for i in range(120)]


def test_int8_weights_quantize_every_linear_layer_and_name_themselves(tmp_path):
    native = load_model(_fixture(), torch.device("cpu"), torch.float32, 256)
    int8 = load_model(_fixture(), torch.device("cpu"), torch.float32, 256, weights="int8")
    assert int8.weights == "int8" and native.weights == "native"
    quantized = [m for m in int8.hf.modules() if type(m).__name__ == "Linear" and callable(getattr(m, "weight", None))]
    assert len(quantized) == len([m for m in native.hf.modules() if isinstance(m, torch.nn.Linear)])
    fp_native, fp_int8 = model_fingerprint(native), model_fingerprint(int8)
    assert fp_native["id"] != fp_int8["id"] and fp_int8["weights"] == "int8" and "weights" not in fp_native


def test_int8_weights_decode_close_to_fp32(tmp_path):
    tokens = {}
    for weights in ("native", "int8"):
        (tmp_path / weights).mkdir()
        with Engine.from_pretrained("fixture", kv_offload_path=tmp_path / weights, policy="full", device="cpu",
                                    config={"max_context": 256, "max_batch": 1}, weights=weights) as engine:
            tokens[weights] = engine.generate([PROMPT], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    assert sum(a == b for a, b in zip(tokens["native"], tokens["int8"])) >= 6  # a trained model's margins hold


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16), ("cuda", torch.float32)])
def test_int8_weights_refused_where_they_cannot_run(tmp_path, device, dtype):
    with pytest.raises(ModelError, match="int8.*--weights native"):
        load_model(_fixture(), torch.device(device), dtype, 256, weights="int8")


def test_an_unknown_weight_format_is_named(tmp_path):
    with pytest.raises(ModelError, match="'int3'.*native, int8"):
        Engine.from_pretrained("fixture", kv_offload_path=tmp_path, policy="full", device="cpu", weights="int3")


def _fixture():
    from edgekv.runtime.checkpoints import resolve_checkpoint

    return resolve_checkpoint("fixture")


def test_eval_takes_a_weight_format_for_perplexity_only(capsys):
    from edgekv.cli import main

    assert main(["eval", "--model", "fixture", "--weights", "int8", "--contexts", "512"]) == 2
    assert "--weights int8 is measured by perplexity only: add --ppl" in capsys.readouterr().err
