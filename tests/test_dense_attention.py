"""The native decode attention over an in-memory cache (runtime/dense_attention.py, full's on a CPU) against
``forward.decode_attention`` over the same positions, on the CPU."""
import platform

import numpy as np
import pytest
import torch

from edgekv.runtime.dense_attention import DenseAttention
from edgekv.runtime.forward import decode_attention
from edgekv.runtime.kernels import resolve_backend
from tests.conftest import assert_same_decodes


class _Model:
    def __init__(self, head_dim):
        self.scaling = head_dim ** -0.5


def _case(batch, n_heads, n_kv, head_dim, tokens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, batch, n_kv, tokens, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, n_heads, 1, head_dim, generator=gen).to(dtype)
    return q, kv


def _torch_attention(q, k, v, start, stop):
    """forward.decode_attention in float64 over positions [start, stop) of each row."""
    positions = torch.arange(k.shape[2])
    mask = (positions >= torch.from_numpy(start)[:, None]) & (positions < torch.from_numpy(stop)[:, None])
    return decode_attention(_Model(q.shape[-1]), q.double(), k.double(), v.double(), mask[:, None, None, :])


def _attention(dtype, n_heads, n_kv, head_dim):
    attention = DenseAttention.for_cache(resolve_backend("cpu"), dtype, n_heads, n_kv, head_dim, head_dim ** -0.5)
    assert attention is not None
    return attention


@pytest.mark.parametrize("batch, n_heads, n_kv, head_dim, tokens, stops", [
    (1, 9, 3, 64, 1000, [1000]),  # SmolLM2's heads, a span not a whole number of parts
    (3, 4, 4, 128, 700, [700, 1, 257]),  # MHA; rows of other lengths, one of a single position
    (2, 8, 1, 256, 300, [256, 300]),  # one KV head, head_dim 256 (Gemma 3), a span of exactly one part
    (1, 16, 2, 80, 90, [90]),  # head_dim neither 64, 128 nor 256: its loops run with a variable bound
    (2, 6, 3, 72, 40, [33, 40]),  # head_dim not a whole number of vectors: the scalar sums
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_native_attention_equals_decode_attention_over_the_same_positions(batch, n_heads, n_kv, head_dim, tokens,
                                                                              stops, dtype):
    q, kv = _case(batch, n_heads, n_kv, head_dim, tokens, dtype)
    start, stop = np.zeros(batch, dtype=np.int64), np.array(stops)
    out = _attention(dtype, n_heads, n_kv, head_dim)(q, kv[0], kv[1], start, stop)
    assert out.dtype == dtype and out.shape == q.shape
    # float32 sums in another order; bfloat16 and float16: the output rounded once
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), _torch_attention(q, kv[0], kv[1], start, stop), **tol)


def test_a_slice_of_a_larger_cache_attends_its_own_positions_from_where_they_start():
    """K and V as full holds them (a layer's slice of [L, 2, B, H_kv, S, d], rows apart by the whole context), each
    row from a start of its own (a window's first position): the positions are read where they lie."""
    cache = torch.randn(3, 2, 2, 3, 600, 64)
    q = torch.randn(2, 9, 1, 64)
    start, stop = np.array([100, 0]), np.array([599, 37])
    out = _attention(torch.float32, 9, 3, 64)(q, cache[1, 0], cache[1, 1], start, stop)
    torch.testing.assert_close(out.double(), _torch_attention(q, cache[1, 0], cache[1, 1], start, stop),
                               atol=2e-6, rtol=1e-5)


def test_a_row_with_nothing_to_attend_gets_zeros_and_the_others_their_attention():
    q, kv = _case(2, 4, 2, 64, 50, torch.float32)
    start, stop = np.array([7, 0]), np.array([7, 50])
    out = _attention(torch.float32, 4, 2, 64)(q, kv[0], kv[1], start, stop)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:].double(), _torch_attention(q, kv[0], kv[1], start, stop)[1:], atol=2e-6,
                               rtol=1e-5)


def test_attention_shared_with_the_helper_thread_is_the_same_bits_as_on_the_caller_alone(monkeypatch):
    from edgekv.runtime import aside
    monkeypatch.setattr(aside, "cores", lambda: 2)
    q, kv = _case(3, 9, 3, 64, 1500, torch.bfloat16)
    start, stop = np.zeros(3, dtype=np.int64), np.array([1500, 900, 3])
    attention = _attention(torch.bfloat16, 9, 3, 64)
    alone = attention(q, kv[0], kv[1], start, stop)
    attention.aside = aside.AsideThread.open()
    assert attention.aside is not None
    for _ in range(3):
        assert torch.equal(attention(q, kv[0], kv[1], start, stop), alone)
    attention.aside.close()


@pytest.mark.parametrize("start, stop", [([0], [51]), ([-1], [10]), ([9], [8])])
def test_positions_outside_the_cache_are_an_error_not_a_read_past_it(start, stop):
    q, kv = _case(1, 4, 2, 64, 50, torch.float32)
    with pytest.raises(ValueError, match="outside the cache's 50"):
        _attention(torch.float32, 4, 2, 64)(q, kv[0], kv[1], np.array(start), np.array(stop))


def test_keys_and_values_of_other_layouts_are_refused():
    q, kv = _case(1, 4, 2, 64, 50, torch.float32)
    attention = _attention(torch.float32, 4, 2, 64)
    with pytest.raises(ValueError, match="rows of d contiguous"):
        attention(q, kv[0].transpose(-1, -2).contiguous().transpose(-1, -2), kv[1], np.array([0]), np.array([5]))
    with pytest.raises(ValueError, match="one dtype"):
        attention(q, kv[0], kv[1].bfloat16(), np.array([0]), np.array([5]))


@pytest.mark.parametrize("dtype, backend, head_dim, n_heads", [
    (torch.float64, "native", 64, 4),  # a dtype the kernel does not read
    (torch.float32, "cuda", 64, 4),  # a GPU's cache: SDPA's kernels (no native attention on its backend)
    (torch.float32, "torch", 64, 4),  # the torch reference asked for
    (torch.float32, "native", 512, 4),  # head_dim above the kernel's maximum
    (torch.float32, "native", 64, 66),  # 33 query heads a KV head: above its maximum
])
def test_torch_attends_what_the_kernel_does_not_read(dtype, backend, head_dim, n_heads):
    from edgekv.runtime.kernels import Backend

    backend = Backend("cuda", torch.device("cuda")) if backend == "cuda" else resolve_backend("cpu", backend)
    assert DenseAttention.for_cache(backend, dtype, n_heads, 2, head_dim, 0.1) is None


@pytest.mark.parametrize("arch, dtype, policy", [("llama", "float32", "full"), ("qwen2", "bfloat16", "full"),
                                                 ("gemma3", "float32", "full"), ("gemma3", "bfloat16", "kvswap")])
def test_a_model_decodes_the_same_through_the_kernel_as_through_torch(tmp_path, monkeypatch, arch, dtype, policy):
    """``full``'s cache and a hybrid model's window rings (Gemma 3's: 8 slots, filled and wrapped around) on the CPU
    attend through the kernel (the native backend), else through ``decode_attention`` (the torch backend): the same
    tokens, logits within float rounding, rows of different lengths in one batch."""
    from edgekv.runtime import Engine
    from tests.conftest import save_model

    prompts = [[3 + i % 150 for i in range(157)], [7 + (i * 13) % 150 for i in range(5)]]  # the second fills a ring
    runs, calls = {}, []
    native_call = DenseAttention.__call__
    monkeypatch.setattr(DenseAttention, "__call__", lambda self, *a: calls.append(1) or native_call(self, *a))
    folder = save_model(tmp_path / arch, arch)
    config = {"max_context": 256, "max_batch": 2, **({"G": 4, "M": 6, "C": 12, "sigma": 2} if policy == "kvswap" else {})}
    for name in ("native", "torch"):
        with Engine.from_pretrained(folder, kv_path=tmp_path, config=config, policy=policy, device="cpu",
                                    dtype=dtype, backend=name) as engine:
            runs[name] = engine.generate(prompts, max_new_tokens=8, stop_token_ids=[], output_logits=True)
        assert bool(calls) == (name == "native")
        calls.clear()
    assert_same_decodes(runs["native"], runs["torch"], dtype)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 targets")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_the_kernel_built_for_narrower_vectors_computes_the_same(tmp_path, march):
    """Built for SSE (4 floats a vector) and AVX2 (8), as a machine without AVX-512 (16) builds it: the same
    attention within float32 rounding, float16 widened by F16C or from its bits."""
    from edgekv.runtime import native_build
    from edgekv.runtime.kernels import load_library

    lib = native_build.LIBRARIES["dense"]
    flags = [f if f != "-march=native" else f"-march={march}" for f in lib.flags]
    built = load_library("dense", native_build.compile_units(lib, tmp_path / f"dense-{march}.so", flags))
    q, kv = _case(2, 9, 3, 64, 700, torch.float16)
    start, stop = np.array([0, 5]), np.array([700, 300])
    expected = _attention(torch.float16, 9, 3, 64)(q, kv[0], kv[1], start, stop)
    out = DenseAttention(built, 0.125)(q, kv[0], kv[1], start, stop)
    torch.testing.assert_close(out.double(), expected.double(), atol=1e-3, rtol=1e-3)
