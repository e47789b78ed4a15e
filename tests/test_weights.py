"""The linear layers' weight format (runtime/weights.py WEIGHT_FORMATS): int8 is PyTorch's dynamic int8 linear on the
CPU, int4 torch's weight-only int4 kernel in groups of 32 (a GGUF Q4 block) where a layer's weights lie on such a
grid and int8 weight-only elsewhere, with an int8 head rescored in fp32; each
has its own fingerprint (its K/V differ), and a device or dtype it cannot run on is refused before loading."""
import shutil

import pytest
import torch
from torch import nn

from edgekv.runtime import Engine
from edgekv.runtime.model import ModelError, load_model
from edgekv.runtime.store.fingerprint import model_fingerprint
from edgekv.runtime.weights import (INT4_GROUP, Int4Linear, Int8Linear, RescoredHead, linear_weight, packed_call,
                                   on_int4_grid, quantize_linears)

PROMPT = [(i * 7) % 250 + 4 for i in range(120)]


def test_int8_weights_quantize_every_linear_layer_and_name_themselves(tmp_path):
    native = load_model(_fixture(), torch.device("cpu"), torch.float32, 256)
    int8 = load_model(_fixture(), torch.device("cpu"), torch.float32, 256, weights="int8")
    assert int8.weights == "int8" and native.weights == "native"
    quantized = [m for m in int8.hf.modules() if type(m).__name__ == "Linear" and callable(getattr(m, "weight", None))]
    assert len(quantized) == len([m for m in native.hf.modules() if isinstance(m, torch.nn.Linear)])
    fp_native, fp_int8 = model_fingerprint(native), model_fingerprint(int8)
    assert fp_native["id"] != fp_int8["id"] and fp_int8["weights"] == "int8" and "weights" not in fp_native


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_decode_close_to_fp32(tmp_path, weights):
    tokens = {}
    for weights in ("native", weights):
        (tmp_path / weights).mkdir()
        with Engine.from_pretrained("fixture", kv_path=tmp_path / weights, policy="full", device="cpu",
                                    config={"max_context": 256, "max_batch": 1}, weights=weights) as engine:
            tokens[weights] = engine.generate([PROMPT], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    assert sum(a == b for a, b in zip(tokens["native"], tokens[weights])) >= 6  # a trained model's margins hold


@pytest.mark.parametrize("weights, device, dtype, runs_in", [
    ("int8", "cpu", torch.bfloat16, "float32"), ("int8", "cuda", torch.float32, "float32"),
    ("int4", "cpu", torch.float16, "float32 or bfloat16"), ("int4", "cuda", torch.float32, "float32 or bfloat16")])
def test_quantized_weights_refused_where_they_cannot_run(tmp_path, weights, device, dtype, runs_in):
    with pytest.raises(ModelError, match=f"'{weights}' runs on the CPU in {runs_in} .*--weights native"):
        load_model(_fixture(), torch.device(device), dtype, 256, weights=weights)


def test_int4_runs_in_a_bfloat16_model_as_its_kernels_take_it(tmp_path):
    tokens = {}
    for weights in ("native", "int4"):
        (tmp_path / weights).mkdir()
        with Engine.from_pretrained("fixture", kv_path=tmp_path / weights, policy="full", device="cpu",
                                    dtype="bfloat16", config={"max_context": 256, "max_batch": 1},
                                    weights=weights) as engine:
            assert engine.model.dtype == torch.bfloat16
            tokens[weights] = engine.generate([PROMPT], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    assert sum(a == b for a, b in zip(tokens["native"], tokens["int4"])) >= 6


@pytest.fixture(scope="module")
def q4_fixture(tmp_path_factory):
    """The fixture checkpoint with its decoder's linear layers snapped onto Q4_1 grids, as a GGUF's Q4 tensors are
    (its own weights are random floats, on no 4-bit grid)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("q4") / "fixture-q4"
    shutil.copytree(_fixture(), out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        for linear in model.model.layers.modules():
            if isinstance(linear, nn.Linear):
                linear.weight.copy_(_snapped(linear.weight))
    model.save_pretrained(out)
    return out


def _snapped(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` on a Q4_1 grid of its own groups (min + scale * q, the scale and minimum exact in bfloat16)."""
    groups = weight.float().view(weight.shape[0], -1, INT4_GROUP)
    low = groups.amin(dim=-1, keepdim=True).bfloat16().float()
    scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15).bfloat16().float()
    return (low + scale * torch.round((groups - low) / scale).clamp(0, 15)).view_as(weight)


def test_int4_packs_every_decoder_linear_on_a_4_bit_grid_and_rescores_the_head(q4_fixture):
    native = load_model(q4_fixture, torch.device("cpu"), torch.float32, 256)
    int4 = load_model(q4_fixture, torch.device("cpu"), torch.float32, 256, weights="int4")
    for block in int4.layers:  # q/k/v packed as one layer, gate/up as one: four int4 layers where there were seven
        attn, mlp = block.self_attn, block.mlp
        assert [type(m) for m in (attn.qkv_packed, attn.o_proj, mlp.gate_up_packed, mlp.down_proj)] == [Int4Linear] * 4
        assert all(p.fused is attn.qkv_packed for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert all(p.fused is mlp.gate_up_packed for p in (mlp.gate_proj, mlp.up_proj))
        assert len([m for m in block.modules() if isinstance(m, Int4Linear)]) == 4
    assert isinstance(int4.lm_head, RescoredHead) and int4.lm_head is int4.hf.lm_head
    assert not any(isinstance(m, nn.Linear) for m in int4.hf.modules())
    assert model_fingerprint(int4)["weights"] == "int4"
    assert model_fingerprint(int4)["id"] not in (model_fingerprint(native)["id"], _int8_fingerprint(q4_fixture))


def test_int4_keeps_layers_off_a_4_bit_grid_in_int8_packed_alike():
    # the fixture's own weights are random floats: 4 bits over them would be a new rounding, so every layer is int8
    # weight-only, q/k/v still one layer and gate/up another
    int4 = load_model(_fixture(), torch.device("cpu"), torch.float32, 256, weights="int4")
    for block in int4.layers:
        attn, mlp = block.self_attn, block.mlp
        assert [type(m) for m in (attn.qkv_packed, attn.o_proj, mlp.gate_up_packed, mlp.down_proj)] == [Int8Linear] * 4
        assert all(p.fused is attn.qkv_packed for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert not any(isinstance(m, Int4Linear) for m in int4.hf.modules())


def test_a_q4_k_sub_block_short_of_the_top_code_keeps_its_own_step():
    # Q4_K rounds a sub-block's scale to 6 bits, so its codes may stop below 15: its maximum and minimum alone would
    # give a step of span / 15, off its grid; the smallest gap between its values gives the step
    linear = _q4_grid_linear(32, 64)
    with torch.no_grad():
        groups = linear.weight.view(32, 2, INT4_GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        step = (groups.amax(dim=-1, keepdim=True) - low) / 15
        codes = torch.round((groups - low) / step).clamp(max=12)  # codes 0..12 only
        groups.copy_(low + step * codes)
    assert on_int4_grid(linear.weight)
    assert torch.equal(linear_weight(Int4Linear(linear)), linear.weight)


def test_a_4_bit_grid_rounded_to_bfloat16_is_still_found_and_a_5_bit_one_is_not():
    # a bfloat16 model holds a GGUF's grid rounded to 8 bits of mantissa: the rounding is not a new grid
    on_grid = _q4_grid_linear(32, 64).weight + 0.3  # a minimum far from 0: the values round, the grid does not move
    assert on_grid.bfloat16().float().ne(on_grid).any()
    assert on_int4_grid(on_grid.bfloat16())
    five_bit = on_grid.clone().view(32, 2, INT4_GROUP)
    five_bit[:, :, 2:6] += (five_bit[:, :, 1] - five_bit[:, :, 0])[..., None] / 30
    assert not on_int4_grid(five_bit.view(32, 64).bfloat16())


def test_a_weight_is_on_a_4_bit_grid_only_when_its_groups_are_found_again():
    on_grid = _q4_grid_linear(32, 64).weight
    assert on_int4_grid(on_grid)
    assert on_int4_grid(_snapped(torch.randn(32, 64, generator=torch.Generator().manual_seed(5))))
    five_bit = on_grid.clone().view(32, 2, INT4_GROUP)
    five_bit[:, :, 2] += (five_bit[:, :, 1] - five_bit[:, :, 0]) / 30  # one value a group half a step off: a 5-bit grid
    assert not on_int4_grid(five_bit.view(32, 64))
    assert not on_int4_grid(torch.randn(32, 64, generator=torch.Generator().manual_seed(6)))


def _int8_fingerprint(checkpoint):
    return model_fingerprint(load_model(checkpoint, torch.device("cpu"), torch.float32, 256, weights="int8"))["id"]


def _q4_grid_linear(out_features: int, in_features: int, bias: bool = False) -> nn.Linear:
    """A linear layer whose every group of 32 inputs is a Q4_1 block: min + scale * q, q in 0..15, both present, the
    scale and minimum exact in bfloat16 (as the kernel keeps them)."""
    gen = torch.Generator().manual_seed(0)
    groups = in_features // INT4_GROUP
    q = torch.randint(0, 16, (out_features, groups, INT4_GROUP), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    scale = 2.0 ** torch.randint(-8, -4, (out_features, groups, 1), generator=gen).float()
    low = -8 * scale * torch.randint(1, 3, (out_features, groups, 1), generator=gen)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_((low + scale * q).view(out_features, in_features))
    return linear


@pytest.mark.parametrize("bias", [False, True])
def test_int4_keeps_a_q4_block_grid_and_computes_its_product(bias):
    linear = _q4_grid_linear(48, 96, bias)
    packed = Int4Linear(linear)
    assert torch.equal(linear_weight(packed), linear.weight)  # every weight on the grid, none rounded
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(1))
    want = nn.functional.linear(x.bfloat16().float(), linear.weight, linear.bias)  # the input crosses in bf16
    got = packed(x)
    assert got.shape == (3, 5, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1 / 128, atol=1e-2)  # the output's own bf16 rounding


def test_a_packed_projection_computes_what_it_computes_packed_alone():
    gen = torch.Generator().manual_seed(4)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (_q4_grid_linear(64, 64, True), _q4_grid_linear(32, 64),
                                             _q4_grid_linear(32, 64))
    alone = {n: Int4Linear(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")}
    model = nn.Module()
    model.attn = attn
    quantize_linears(model, "int4")
    x = torch.randn(2, 3, 64, generator=gen)
    call, packed = packed_call(attn.q_proj, attn.k_proj, attn.v_proj)
    assert packed
    one_call = call(x)
    for name, out in zip(("q_proj", "k_proj", "v_proj"), one_call):
        torch.testing.assert_close(out, alone[name](x), rtol=1e-2, atol=1e-2)  # bf16 outputs, rounded alike
        torch.testing.assert_close(getattr(attn, name)(x), out)  # called alone, as Hugging Face's modules call it
        torch.testing.assert_close(linear_weight(getattr(attn, name)), linear_weight(alone[name]))
    call, packed = packed_call(attn.q_proj, nn.Linear(64, 64))  # not one layer's slices: each its own call
    assert not packed and torch.equal(call(x)[0], attn.q_proj(x))


def test_a_decode_step_makes_one_int4_call_for_q_k_v_and_one_for_gate_up(tmp_path, monkeypatch, q4_fixture):
    calls = []
    matmul = Int4Linear.matmul
    monkeypatch.setattr(Int4Linear, "matmul", lambda self, x: calls.append(self) or matmul(self, x))
    with Engine.from_pretrained(str(q4_fixture), kv_path=tmp_path, policy="full", device="cpu",
                                config={"max_context": 256, "max_batch": 1}, weights="int4") as engine:
        with engine.open_batch(1, 256) as batch:
            batch.join(0, PROMPT)
            batch.end_prefill()
            calls.clear()
            batch.step(torch.tensor([5]))
    assert len(calls) == 4 * engine.model.dims.n_layers  # qkv, o, gate/up, down a layer


def test_int4_falls_back_to_int8_or_to_the_loaded_layer_where_its_kernel_cannot_pack():
    # inputs not of the group, outputs not of 16, inputs not of 16 (neither kernel's); the first on a 4-bit grid
    body = nn.Sequential(_q4_grid_linear(48, 64), nn.Linear(48, 24), nn.Linear(24, 32))
    want = body(x := torch.randn(2, 64, generator=torch.Generator().manual_seed(2)))
    model = nn.Module()
    model.body, model.lm_head = body, nn.Linear(32, 10)
    quantize_linears(model, "int4")
    assert [type(m) for m in model.body] == [Int4Linear, Int8Linear, nn.Linear]
    assert isinstance(model.lm_head, RescoredHead)
    torch.testing.assert_close(model.body(x), want, rtol=0.05, atol=0.05)


def test_the_rescored_head_gives_the_fp32_logits_of_its_best_tokens():
    head = nn.Linear(64, 500, bias=True)
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(3))
    want = head(x)
    rescored = RescoredHead(head, top=8)
    got = rescored(x)
    best = rescored.approx(x).topk(8, dim=-1).indices  # the candidates, as the int8 logits rank them
    torch.testing.assert_close(got.gather(-1, best), want.gather(-1, best), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() > 1e-3  # the rest are the int8 kernel's, not fp32's


def test_an_unknown_weight_format_is_named(tmp_path):
    with pytest.raises(ModelError, match="'int3'.*native, int8, int4"):
        Engine.from_pretrained("fixture", kv_path=tmp_path, policy="full", device="cpu", weights="int3")


def _fixture():
    from edgekv.runtime.checkpoints import resolve_checkpoint

    return resolve_checkpoint("fixture")


def test_eval_takes_a_weight_format_for_perplexity_only(capsys):
    from edgekv.cli import main

    assert main(["eval", "--model", "fixture", "--weights", "int8", "--contexts", "512"]) == 2
    assert "--weights int8 is measured by perplexity only: add --ppl" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", [1, 5])
def test_packed_q_and_k_are_rotated_in_one_pass_to_the_same_bits(tokens):
    # q's and k's heads side by side in the packed layer's output take one RoPE pass instead of one each
    model = load_model(_fixture(), torch.device("cpu"), torch.float32, 256, weights="int4")
    assert all(plan.qkv_whole is not None for plan in model.plans)
    x = torch.randn(2, tokens, model.dims.hidden, generator=torch.Generator().manual_seed(tokens))
    rope = model.rope(torch.arange(7, 7 + tokens).repeat(2, 1))
    for layer, plan in enumerate(model.plans):
        fused = model.qkv(layer, x, rope)
        plan.qkv_whole = None  # each projection's heads rotated on their own
        apart = model.qkv(layer, x, rope)
        assert [t.shape for t in fused] == [t.shape for t in apart]
        assert all(torch.equal(a, b) for a, b in zip(fused, apart))
