"""The ``ggml`` weight format (runtime/ggml_weights.py): each linear layer in the smallest GGUF block type that gives
its weight back (ggml's own quantizer, checked), else Q8_0, multiplied by ggml's CPU dot products with the activations
quantized to the type's 8-bit partner, as llama.cpp computes; a prefill chunk widens the weight and runs one float32
GEMM.  The library is the one ``make ggml`` builds (or llama-cpp-python's); without it these tests skip and the format
is refused by name."""
import pytest
import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from edgekv.runtime import Engine
from edgekv.runtime.aside import AsideThread
from edgekv.runtime.ggml_weights import GEMM_TOKENS, dequantized, ggml, ggml_unavailable, quantized
from edgekv.runtime.model import ModelError, load_model
from edgekv.runtime.store.fingerprint import model_fingerprint
from edgekv.runtime.norms import rms_norm_of
from edgekv.runtime.weights import GgmlLinear, PackedSlice, RescoredHead, linear_weight, normed_call, packed_call

pytestmark = pytest.mark.skipif(ggml_unavailable() is not None, reason=str(ggml_unavailable()))
PROMPT = [(i * 7) % 250 + 4 for i in range(120)]
CPU = torch.device("cpu")


def _linear(out_features: int, in_features: int, grid: str | None = None, bias: bool = False, seed: int = 0
            ) -> nn.Linear:
    """A linear layer of random weights, put on ``grid``'s blocks (a GGUF tensor of that type) where one is named."""
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) / 8)
        if grid is not None:
            linear.weight.copy_(dequantized(ggml(), grid, quantized(ggml(), grid, linear.weight), in_features))
    return linear


@pytest.mark.parametrize("grid", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_a_weight_on_a_gguf_grid_keeps_that_type_and_every_value(grid):
    linear = _linear(48, 96, grid)
    layer = GgmlLinear(linear)
    assert layer.kernel.type_name == grid
    assert torch.equal(linear_weight(layer), linear.weight)


def test_a_weight_on_no_grid_is_q8_0():
    layer = GgmlLinear(_linear(40, 64))
    assert layer.kernel.type_name == "Q8_0"
    torch.testing.assert_close(linear_weight(layer), _linear(40, 64).weight, rtol=0, atol=1 / 8 * 4 / 127)


@pytest.mark.parametrize("tokens", [1, 3, GEMM_TOKENS - 1])
@pytest.mark.parametrize("bias", [False, True])
def test_a_decode_call_is_the_product_with_8_bit_activations(tokens, bias):
    linear = _linear(96, 128, "Q4_1", bias)
    layer = GgmlLinear(linear)
    x = torch.randn(1, tokens, 128, generator=torch.Generator().manual_seed(1))  # under GEMM_TOKENS in all
    got = layer(x)
    assert got.shape == (1, tokens, 96) and got.dtype == torch.float32
    want = nn.functional.linear(x, linear.weight, linear.bias)
    # Q8_1 activations: a step of 1/127 of a block's largest, summed over 128 inputs
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert not torch.equal(got, want)  # the activations were quantized: not the float product


@pytest.mark.parametrize("grid", ["Q4_1", "Q4_0", None])  # partners Q8_1, Q8_0; Q8_0 itself
def test_a_prefill_chunk_rounds_its_activations_as_the_decode_steps_do(grid):
    # one GEMM over the widened weight, the activations through the partner type: what the dot products compute token
    # by token, up to the order of the sums (and Q8_1's block sums, kept in fp16), so a teacher-forced perplexity over
    # whole windows measures the decode's format
    linear = _linear(64, 96, grid, bias=True)
    layer = GgmlLinear(linear)
    x = torch.randn(GEMM_TOKENS + 5, 96, generator=torch.Generator().manual_seed(2))
    chunk = layer(x)
    torch.testing.assert_close(chunk, torch.cat([layer(row[None]) for row in x]), rtol=0, atol=4e-3)
    float_error = (chunk - nn.functional.linear(x, linear.weight, linear.bias)).abs().max()
    assert float_error > 0.01  # the activations' rounding, far above the two paths' difference


@pytest.mark.parametrize("spin_us", [0, 300])
def test_rows_shared_with_the_helper_thread_are_the_same_bits(spin_us):
    # a sleeping helper takes only layers of SHARED_WEIGHTS weights or more; a spinning one every layer
    small, large = GgmlLinear(_linear(700, 256, "Q4_1")), GgmlLinear(_linear(700, 256, "Q4_1", seed=1))
    large.kernel._shares = True  # as if of SHARED_WEIGHTS weights: 700 rows are units of 88, the last one short
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    alone = [small(x), large(x)]
    aside = AsideThread.open(spin_us=spin_us)
    if aside is None:
        pytest.skip("one core: no helper thread")
    calls = []
    share = aside.share
    aside.share = lambda *args: (calls.append(args[2]), share(*args))
    try:
        small.kernel.aside = large.kernel.aside = aside
        for _ in range(20):  # one call after another, as a decode step's layers come
            assert torch.equal(small(x), alone[0]) and torch.equal(large(x), alone[1])
        assert calls == [8] * (40 if spin_us else 20)
    finally:
        aside.close()


def test_a_bfloat16_input_comes_back_in_bfloat16():
    layer = GgmlLinear(_linear(32, 64, "Q4_1"))
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), layer(x.bfloat16().float()).bfloat16().float())


@pytest.mark.parametrize("tokens", [1, 2, GEMM_TOKENS + 3])
def test_a_slice_of_a_packed_layer_computes_its_rows_alone_to_the_bit(tokens):
    # the next layer's query is q_proj called alone: its rows' dot products only, not k's and v's too
    layer = GgmlLinear(_linear(160, 96, "Q4_1", bias=True))
    q, v = PackedSlice(layer, 0, 96), PackedSlice(layer, 128, 160)
    x = torch.randn(1, tokens, 96, generator=torch.Generator().manual_seed(5))
    whole = layer(x)
    assert torch.equal(q(x), whole[..., :96]) and torch.equal(v(x), whole[..., 128:])
    assert [k.rows for k in layer.kernels] == [160, 96, 32]  # each slice its own kernel over its rows' blocks
    assert all(k.blocks.base is layer.kernel.blocks.base or k.blocks.base is layer.kernel.blocks
               for k in layer.kernels[1:])  # views, no copy


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Gemma3RMSNorm])
@pytest.mark.parametrize("tokens", [1, 4, GEMM_TOKENS + 3])
def test_a_norm_taken_in_the_call_is_the_norm_then_the_call(cls, tokens):
    # the glue norms each row before quantizing it: the same 8-bit activations as torch's norm then the layer, but
    # where the two norms' last bits put a value on the other side of a rounding step
    norm = cls(128, eps=1e-6)
    norm.weight.data = torch.randn(128, generator=torch.Generator().manual_seed(9)) * 0.3
    layer = GgmlLinear(_linear(96, 128, "Q4_1", bias=True))
    x = torch.randn(2, tokens, 128, generator=torch.Generator().manual_seed(10)) * 4
    fused, composed = normed_call(norm, layer)(x), layer(norm(x))
    assert fused.shape == composed.shape == (2, tokens, 96)
    torch.testing.assert_close(fused, composed, rtol=0, atol=2e-2)
    assert (fused == composed).float().mean() > 0.9
    assert not torch.equal(fused, layer(x))  # normed: not the raw input's product


def test_a_slice_takes_the_norm_over_its_rows_alone_to_the_bit():
    norm = LlamaRMSNorm(96)
    layer = GgmlLinear(_linear(160, 96, "Q4_1", bias=True))
    q, v = PackedSlice(layer, 0, 96), PackedSlice(layer, 128, 160)
    x = torch.randn(1, 2, 96, generator=torch.Generator().manual_seed(11))
    whole = normed_call(norm, layer)(x)
    assert torch.equal(normed_call(norm, q)(x), whole[..., :96])
    gate_up, packed = packed_call(q, v, norm=norm)
    assert packed and all(torch.equal(a, b) for a, b in zip(gate_up(x), (whole[..., :96], whole[..., 128:])))


def test_a_norm_no_kernel_takes_is_called_before_the_layer():
    norm, linear = LlamaRMSNorm(64), _linear(32, 64)
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(12))
    assert torch.equal(normed_call(norm, linear)(x), linear(norm(x)))  # a plain layer: the two calls
    offset = type("OffsetNorm", (LlamaRMSNorm,), {"forward": lambda self, h: LlamaRMSNorm.forward(self, h) + 1})(64)
    ggml_layer = GgmlLinear(linear)
    assert rms_norm_of(offset) is None and torch.equal(normed_call(offset, ggml_layer)(x), ggml_layer(offset(x)))


def test_q_k_v_and_gate_up_pack_as_one_layer_each_and_the_head_is_rescored():
    model = load_model(_fixture(), CPU, torch.float32, 256, weights="ggml")
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        assert [type(m) for m in (attn.qkv_packed, attn.o_proj, mlp.gate_up_packed, mlp.down_proj)] == [GgmlLinear] * 4
        assert all(isinstance(p, PackedSlice) and p.fused is attn.qkv_packed
                   for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert packed_call(mlp.gate_proj, mlp.up_proj)[1]
    assert isinstance(model.lm_head, RescoredHead) and isinstance(model.lm_head.approx, GgmlLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.hf.modules())
    assert model_fingerprint(model)["weights"] == "ggml"
    int4 = load_model(_fixture(), CPU, torch.float32, 256, weights="int4")
    assert model_fingerprint(model)["id"] != model_fingerprint(int4)["id"]


@pytest.mark.parametrize("weights, torch_norms", [("ggml", 1), ("native", 4)])
def test_under_ggml_a_layers_norms_are_taken_in_its_projections_calls(monkeypatch, weights, torch_norms):
    # a decode layer (its QKV, the next layer's query, its MLP) and the final norm: under ggml only the final norm
    # is torch's, the fixture's Llama blocks' input and MLP norms ride in the projections' calls
    model = load_model(_fixture(), CPU, torch.float32, 256, weights=weights)
    calls = []
    rms_norm = nn.functional.rms_norm
    monkeypatch.setattr(nn.functional, "rms_norm", lambda *a, **k: (calls.append(1), rms_norm(*a, **k))[1])
    x = torch.randn(1, 1, model.dims.hidden, generator=torch.Generator().manual_seed(13))
    rope = model.rope(torch.tensor([[5]]))
    q, _, _ = model.qkv(0, x, rope)
    model.query(1, x, rope)
    model.finish_layer(0, x, torch.zeros_like(q))
    model.logits(x)
    assert len(calls) == torch_norms


@pytest.mark.parametrize("spin_us", [None, 0, 300])  # no helper thread, a sleeping one, a spinning one
@pytest.mark.parametrize("batch", [1, 3])
def test_a_blocks_end_in_one_native_call_is_its_layers_calls(spin_us, batch):
    """The output projection, residual, MLP norm, gate/up, SiLU, down and residual of a Llama block in one call
    (ekv_ggml_block_end; the fixture's output projection has a bias): the torch path's result within SiLU's
    exponential's rounding (glibc's against torch's), with
    the layers' rows shared with a helper thread or not; what it does not take (a bfloat16 input, a prefill chunk)
    goes the torch path."""
    model = load_model(_fixture(), CPU, torch.float32, 256, weights="ggml")
    aside = None if spin_us is None else AsideThread.open(spin_us)
    model.lend_aside(aside, "test")
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 1, model.dims.hidden, generator=generator)
    attn = torch.randn(batch, model.dims.n_heads, 1, model.dims.head_dim, generator=generator)
    for layer, plan in enumerate(model.plans):
        fused, plan.block_end = plan.block_end, None
        expected = model.finish_layer(layer, x, attn)
        plan.block_end = fused
        assert fused is not None and fused(x, attn) is not None
        torch.testing.assert_close(model.finish_layer(layer, x, attn), expected, rtol=1e-5, atol=1e-5)
        assert fused(x.bfloat16(), attn.bfloat16()) is None and fused(x, attn.expand(-1, -1, 2, -1)) is None
    if aside is not None:
        aside.close()


@pytest.mark.parametrize("spin_us", [None, 300])
@pytest.mark.parametrize("batch", [1, 3])
def test_projections_into_rotated_heads_in_one_native_call_are_the_torch_paths_to_the_bit(spin_us, batch):
    """A packed q/k/v layer (the fixture's has biases) with its input norm, heads and RoPE in one call
    (ekv_ggml_heads), and the next layer's query from q's rows alone: the torch path's tensors bit for bit, at
    different positions a row; a bfloat16 input or a prefill chunk goes the torch path."""
    model = load_model(_fixture(), CPU, torch.float32, 256, weights="ggml")
    aside = None if spin_us is None else AsideThread.open(spin_us)
    model.lend_aside(aside, "test")
    x = torch.randn(batch, 1, model.dims.hidden, generator=torch.Generator().manual_seed(batch))
    rope = model.rope(torch.tensor([[5 + 70 * row] for row in range(batch)]))
    for layer, plan in enumerate(model.plans):
        fused = plan.qkv_heads, plan.q_heads
        assert None not in fused
        got = model.qkv(layer, x, rope), model.query(layer, x, rope)
        plan.qkv_heads = plan.q_heads = None
        expected = model.qkv(layer, x, rope), model.query(layer, x, rope)
        plan.qkv_heads, plan.q_heads = fused
        for mine, theirs in zip([*got[0], got[1]], [*expected[0], expected[1]]):
            assert mine.shape == theirs.shape and torch.equal(mine, theirs)
        assert fused[0](x.bfloat16(), *rope.at(layer)) is None
        assert fused[1](x.expand(-1, 2, -1), *rope.at(layer)) is None
    if aside is not None:
        aside.close()


def test_a_block_end_is_fused_only_where_every_part_is_ggml_and_llamas():
    """An activation other than SiLU and non-ggml weights keep the torch path (as Gemma 3's blocks do: their
    attention and MLP outputs are normed)."""
    from edgekv.runtime.model import LayerPlan

    model = load_model(_fixture(), CPU, torch.float32, 256, weights="ggml")
    block = model.layers[0]
    assert LayerPlan(block).block_end is not None
    block.mlp.act_fn = nn.GELU()
    assert LayerPlan(block).block_end is None
    block.mlp.act_fn = nn.SiLU()
    assert LayerPlan(block).block_end is not None
    native = load_model(_fixture(), CPU, torch.float32, 256)
    assert all(plan.block_end is plan.qkv_heads is plan.q_heads is None for plan in native.plans)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["full", "kvswap"])
def test_ggml_weights_decode_close_to_the_models_own(tmp_path, dtype, policy):
    tokens = {}
    for weights in ("native", "ggml"):
        (tmp_path / weights).mkdir()
        with Engine.from_pretrained("fixture", kv_path=tmp_path / weights, policy=policy, device="cpu",
                                    dtype=dtype, config={"max_context": 256, "max_batch": 1, "G": 4, "M": 8},
                                    weights=weights) as engine:
            tokens[weights] = engine.generate([PROMPT], max_new_tokens=4, stop_token_ids=[])[0].token_ids
    # the fixture's margins are thin: past its first few tokens 8-bit activations part its greedy path from fp32's
    # (its int8 weights with bf16 activations hold longer); SmolLM2's ppl ratio is 1.004 (docs/results)
    assert tokens["ggml"] == tokens["native"]


def test_ggml_weights_cost_the_fixture_little_perplexity():
    from edgekv.install.weights import scored

    windows = [[(i * 13 + k) % 250 + 4 for i in range(96)] for k in range(2)]
    base_nll, base_top = scored(load_model(_fixture(), CPU, torch.float32, 256), windows)
    nll, top = scored(load_model(_fixture(), CPU, torch.float32, 256, weights="ggml"), windows)
    assert abs(nll - base_nll) < 0.02 and (top == base_top).float().mean() >= 0.9


def test_a_layer_whose_inputs_fill_no_block_stays_as_loaded():
    model = nn.Module()
    model.proj = nn.Linear(40, 32)  # 40 inputs: no whole block of 32
    from edgekv.runtime.weights import quantize_linears

    quantize_linears(model, "ggml")
    assert type(model.proj) is nn.Linear


@pytest.mark.parametrize("device, dtype, runs_in", [("cpu", torch.float16, "float32 or bfloat16"),
                                                    ("cuda", torch.float32, "float32 or bfloat16")])
def test_ggml_refused_where_it_cannot_run(device, dtype, runs_in):
    with pytest.raises(ModelError, match=f"'ggml' runs on the CPU in {runs_in} \\(ggml's CPU dot products\\)"):
        load_model(_fixture(), torch.device(device), dtype, 256, weights="ggml")


def test_ggml_refused_by_name_without_the_library(monkeypatch):
    import edgekv.runtime.weights as weights

    monkeypatch.setattr(weights, "ggml_unavailable", lambda: "ggml's CPU library is not installed: pip install x")
    with pytest.raises(ModelError, match="weights 'ggml': ggml's CPU library is not installed.*or use --weights int4"):
        load_model(_fixture(), CPU, torch.float32, 256, weights="ggml")


def _fixture():
    from edgekv.runtime.checkpoints import resolve_checkpoint

    return resolve_checkpoint("fixture")
