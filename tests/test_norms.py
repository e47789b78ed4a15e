"""runtime/norms.py: the fused RMS norm gives Hugging Face's modules' result to the bit, and only replaces the modules
whose code it knows."""
import pytest
import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from edgekv.runtime.norms import norm_call, rms_norm_of

DEVICE = torch.device("cpu")


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm, Gemma3RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 256, 576, 640])
def test_the_fused_norm_is_the_modules_to_the_bit(cls, dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    module = cls(dim, eps=1e-6).to(DEVICE)
    module.weight.data = torch.randn(dim, generator=generator) * 0.5
    module = module.to(dtype)
    fused = norm_call(module)
    assert fused != module.forward  # a known norm is replaced
    for shape in [(1, 1, dim), (4, 1, dim), (1, 19, dim), (2, 9, 3, dim)]:  # decode, batch, prefill, per-head
        x = (torch.randn(*shape, generator=generator) * 7).to(dtype)
        assert torch.equal(fused(x), module(x)), shape


def test_an_unknown_norm_keeps_its_module_and_none_stays_none():
    class OffsetNorm(LlamaRMSNorm):  # a subclass with its own forward: not Llama's code
        def forward(self, x):
            return super().forward(x) + 1

    module = OffsetNorm(8)
    assert norm_call(module) == module.forward
    layer_norm = nn.LayerNorm(8)
    assert norm_call(layer_norm) == layer_norm.forward
    assert norm_call(None) is None


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm, Gemma3RMSNorm])
def test_a_known_norm_as_data_is_its_formula(cls):
    # what a kernel taking the norm on its input computes (runtime/native/ekv_ggml.c): (x / rms(x)) * scale
    module = cls(96, eps=1e-5).to(DEVICE)
    module.weight.data = torch.randn(96, generator=torch.Generator().manual_seed(7))
    norm = rms_norm_of(module)
    assert norm.scale.dtype == torch.float32 and norm.scale.is_contiguous() and norm.eps == 1e-5
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(8)) * 5
    formula = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.scale
    torch.testing.assert_close(formula, module(x), rtol=1e-6, atol=1e-6)


def test_an_unknown_norm_is_no_data():
    class OffsetNorm(LlamaRMSNorm):
        def forward(self, x):
            return super().forward(x) + 1

    assert rms_norm_of(OffsetNorm(8)) is None and rms_norm_of(nn.LayerNorm(8)) is None and rms_norm_of(None) is None
