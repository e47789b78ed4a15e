"""RMS norms as one ``torch.nn.functional.rms_norm`` call where Hugging Face's modules make five to seven: on a 2-core
CPU a decode step of SmolLM2 runs about 90 of them, each paying torch's per-call dispatch (47 against 31 us a norm).
Only a module whose ``forward`` is Llama's or Gemma 3's own code is replaced, and only on the CPU, where the fused
call gives HF's result to the bit (float32, bfloat16, float16; tests/test_norms.py); anything else keeps its module."""
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _hf_norms() -> tuple[type, type | None]:
    """(LlamaRMSNorm, Gemma3RMSNorm or None where this transformers lacks Gemma 3), imported when first asked for,
    as the runtime imports transformers only where it loads a model."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    try:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    except ImportError:
        Gemma3RMSNorm = None
    return LlamaRMSNorm, Gemma3RMSNorm


def _same_code(module: nn.Module, cls: type | None) -> bool:
    """Whether ``module``'s forward runs ``cls``'s (copied classes such as Qwen3RMSNorm have the same bytecode)."""
    if cls is None:
        return False
    mine, theirs = type(module).forward.__code__, cls.forward.__code__
    return (mine.co_code, mine.co_consts, mine.co_names) == (theirs.co_code, theirs.co_consts, theirs.co_names)


class RmsNorm(NamedTuple):
    """A Llama- or Gemma-3-style RMS norm as data, for a kernel taking it on its input (runtime/native/ekv_ggml.c):
    (x * 1/sqrt(mean(x^2) + eps)) * scale, in float32."""

    scale: torch.Tensor  # float32 [in], contiguous: Llama's weight, Gemma 3's 1 + weight
    eps: float


def rms_norm_of(module: nn.Module | None) -> RmsNorm | None:
    """``module`` as an ``RmsNorm`` where its forward is Llama's or Gemma 3's on the CPU (else None)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.device.type != "cpu" or weight.dim() != 1:
        return None
    llama_norm, gemma3_norm = _hf_norms()
    if _same_code(module, llama_norm):
        return RmsNorm(weight.detach().float().contiguous(), float(module.variance_epsilon))
    if _same_code(module, gemma3_norm):
        return RmsNorm((1.0 + weight.detach().float()).contiguous(), float(module.eps))
    return None


def norm_call(module: nn.Module | None):
    """``module``'s forward as a function of x, fused where it is a Llama- or Gemma-3-style RMS norm on the CPU;
    None stays None (a model without that norm)."""
    if module is None:
        return None
    weight = getattr(module, "weight", None)
    if weight is None or weight.device.type != "cpu" or weight.dim() != 1:
        return module.forward
    shape = tuple(weight.shape)
    llama_norm, gemma3_norm = _hf_norms()
    if _same_code(module, llama_norm):  # weight * (x normed in float32, cast back): the weight last
        eps = module.variance_epsilon

        def llama(x: torch.Tensor) -> torch.Tensor:
            if x.dtype == torch.float32 and weight.dtype == torch.float32:
                return F.rms_norm(x, shape, weight, eps)
            return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)
        return llama
    if _same_code(module, gemma3_norm):  # (x normed in float32 times 1 + weight), cast back
        eps, scale = module.eps, 1.0 + weight.float()
        return lambda x: (F.rms_norm(x.float(), shape, None, eps) * scale).type_as(x)
    return module.forward
