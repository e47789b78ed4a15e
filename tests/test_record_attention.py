"""The native decode attention over a disk policy's slots (runtime/record_attention.py) against the torch path's
gather and ``decode_attention``, on the CPU."""
import platform

import numpy as np
import pytest
import torch

from edgekv.runtime.disk_store import RecordLayout, aligned_zeros
from edgekv.runtime.forward import decode_attention
from edgekv.runtime.kernels import Backend, resolve_backend
from edgekv.runtime.record_attention import RecordAttention

NATIVE = resolve_backend("cpu")
from tests.conftest import assert_same_decodes


class _Model:
    def __init__(self, head_dim):
        self.scaling = head_dim ** -0.5


def _case(batch, n_heads, n_kv, head_dim, G, picks, dtype, seed=0, record_dtype="auto"):
    gen = torch.Generator().manual_seed(seed)
    layout = RecordLayout(G, n_kv, head_dim, dtype, record_dtype=record_dtype)
    n_slots = batch * picks + 3
    if record_dtype == "auto":
        records = aligned_zeros((n_slots, layout.stride_bytes), layout.align_bytes)
        typed = layout.typed(records)  # [n_slots, 2, H_kv, G, d]
        typed.copy_(torch.randn(typed.shape, generator=gen).to(dtype))
    else:  # codes as a flush packs them, keys with an offset per channel (what per-channel scales are for)
        k, v = (torch.randn(n_kv, n_slots * G, head_dim, generator=gen) for _ in range(2))
        records = layout.pack(k + torch.randn(n_kv, 1, head_dim, generator=gen) * 3, v)
    slots = torch.randperm(n_slots, generator=gen)[: batch * picks].view(batch, picks).numpy()
    valid = (torch.rand(batch, picks, generator=gen) < 0.8).numpy()
    sinks = torch.randn(batch, 2, n_kv, 2 * G, head_dim, generator=gen).to(dtype)
    ring = torch.randn(batch, 2, n_kv, 3 * G, head_dim, generator=gen).to(dtype)
    resident = torch.rand(batch, 5 * G, generator=gen) < 0.7
    resident[:, -1] = True  # the step's own token
    q = torch.randn(batch, n_heads, 1, head_dim, generator=gen).to(dtype)
    return layout, records, slots, valid, [sinks, ring], resident, q


def _torch_attention(layout, records, slots, valid, dense, resident, q):
    """What offload.attention.GatheredAttention gathers, then forward.decode_attention, in float64."""
    picked = layout.decode(records, torch.float32)[torch.from_numpy(slots)].double()  # [B, M, 2, H_kv, G, d]
    b, m, _, h_kv, g, d = picked.shape
    kv = picked.permute(2, 0, 3, 1, 4, 5).reshape(2, b, h_kv, m * g, d)
    kv = torch.cat([kv, *[s.double().transpose(0, 1) for s in dense]], dim=3)
    mask = torch.cat([torch.from_numpy(np.repeat(valid, g, axis=1)), resident], dim=1)[:, None, None, :]
    return decode_attention(_Model(d), q.double(), kv[0], kv[1], mask)


@pytest.mark.parametrize("batch, n_heads, n_kv, head_dim, G, picks", [
    (1, 9, 3, 64, 4, 50),  # SmolLM2's heads
    (3, 4, 4, 128, 3, 7),  # MHA, a group of 3 tokens
    (2, 8, 1, 256, 8, 5),  # one KV head, head_dim 256
    (1, 16, 2, 80, 4, 1),  # head_dim neither 64, 128 nor 256: its loops run with a variable bound
    (2, 6, 3, 72, 2, 9),  # head_dim not a whole number of vectors: the scalar sums
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_attention_equals_attention_over_the_gathered_copy(batch, n_heads, n_kv, head_dim, G, picks, dtype):
    layout, records, slots, valid, dense, resident, q = _case(batch, n_heads, n_kv, head_dim, G, picks, dtype)
    attention = RecordAttention.for_layout(NATIVE, layout, n_heads, head_dim ** -0.5, dtype)
    assert attention is not None
    out = attention(q, records, slots, valid, dense, resident)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _torch_attention(layout, records, slots, valid, dense, resident, q)
    # float32 sums in another order; bfloat16: the output rounded once
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("batch, n_heads, n_kv, head_dim, G, picks", [
    (1, 9, 3, 64, 4, 50),  # SmolLM2's heads, keys scaled per channel over the group
    (2, 4, 4, 128, 2, 7),  # MHA, a group too small for channels: keys scaled per token
    (2, 8, 1, 256, 16, 5),  # one KV head, head_dim 256
    (1, 6, 3, 72, 4, 9),  # head_dim not a whole number of vectors
])
@pytest.mark.parametrize("record_dtype", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_attention_over_codes_equals_attention_over_their_dequantised_copy(batch, n_heads, n_kv, head_dim,
                                                                                      G, picks, record_dtype, dtype):
    """The kernel widens each code with its float16 scale and zero as it reads it: the same keys and values as
    RecordLayout.decode gives the torch path, the dense segments in the model's dtype beside them."""
    layout, records, slots, valid, dense, resident, q = _case(batch, n_heads, n_kv, head_dim, G, picks, dtype,
                                                              record_dtype=record_dtype)
    attention = RecordAttention.for_layout(NATIVE, layout, n_heads, head_dim ** -0.5, dtype)
    assert attention is not None
    out = attention(q, records, slots, valid, dense, resident)
    expected = _torch_attention(layout, records, slots, valid, dense, resident, q)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), expected, **tol)


def test_a_sequence_with_nothing_to_attend_gets_zeros_and_the_others_their_attention():
    layout, records, slots, valid, dense, resident, q = _case(2, 4, 2, 64, 4, 6, torch.float32)
    valid[0], resident[0] = False, False
    out = RecordAttention.for_layout(NATIVE, layout, 4, 0.125, torch.float32)(
        q, records, slots, valid, dense, resident)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:].double(), _torch_attention(layout, records, slots, valid, dense, resident, q)[1:],
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("record_dtype", ["auto", "int4"])
def test_attention_shared_with_the_helper_thread_is_the_same_bits_as_on_the_caller_alone(record_dtype, monkeypatch):
    """With the policy's helper thread lent, the (sequence, KV head) units are shared with it, each worker in a part
    of the scratch of its own: the same output, bit for bit, call after call; a bad slot is still refused."""
    from edgekv.runtime import aside
    monkeypatch.setattr(aside, "cores", lambda: 2)
    layout, records, slots, valid, dense, resident, q = _case(3, 9, 3, 64, 4, 40, torch.bfloat16,
                                                              record_dtype=record_dtype)
    attention = RecordAttention.for_layout(NATIVE, layout, 9, 0.125, torch.bfloat16)
    alone = attention(q, records, slots, valid, dense, resident)
    attention.aside = aside.AsideThread.open()
    for _ in range(3):
        assert torch.equal(attention(q, records, slots, valid, dense, resident), alone)
    slots[2, 0], valid[2, 0] = records.shape[0], True
    with pytest.raises(RuntimeError, match="slot lies outside the slots"):
        attention(q, records, slots, valid, dense, resident)
    attention.aside.close()


def test_a_pick_outside_the_slots_is_an_error_not_a_read_past_them():
    layout, records, slots, valid, dense, resident, q = _case(1, 4, 2, 64, 4, 6, torch.float32)
    slots[0, 0], valid[0, 0] = records.shape[0], True
    with pytest.raises(RuntimeError, match="slot lies outside the slots"):
        RecordAttention.for_layout(NATIVE, layout, 4, 0.125, torch.float32)(
            q, records, slots, valid, dense, resident)


@pytest.mark.parametrize("record_dtype, dtype, backend", [
    ("fp16", torch.float32, "native"),  # float16 records: torch decodes them
    ("auto", torch.float16, "native"), ("int8", torch.float16, "native"),  # a model dtype the kernel does not read
    ("auto", torch.float32, "cuda"),  # a GPU's slots (no native attention on its backend)
    ("auto", torch.float32, "torch"),  # the torch reference asked for
])
def test_the_torch_path_attends_what_the_kernel_does_not_read(record_dtype, dtype, backend):
    layout = RecordLayout(4, 2, 64, dtype, record_dtype=record_dtype)
    backend = Backend("cuda", torch.device("cuda")) if backend == "cuda" else resolve_backend("cpu", backend)
    assert RecordAttention.for_layout(backend, layout, 4, 0.125, dtype) is None


def test_records_of_another_dtype_than_the_dense_segments_attend_through_torch():
    layout = RecordLayout(4, 2, 64, torch.float32)
    assert RecordAttention.for_layout(NATIVE, layout, 4, 0.125, torch.bfloat16) is None


def test_an_edited_shared_header_renames_the_libraries_that_include_it(tmp_path, monkeypatch):
    """A cached library is named by the hash of its source and its headers: an edit to ekv_float.h must rebuild the
    scorer and the attention kernels, never load them stale."""
    import shutil

    from edgekv.runtime import native_build

    shutil.copytree(native_build.SOURCES, tmp_path / "native")
    monkeypatch.setattr(native_build, "SOURCES", tmp_path / "native")
    before = {name: native_build.library_path(name) for name in ("score", "attend", "dense", "qattn", "crc32c")}
    with open(tmp_path / "native" / "ekv_float.h", "a") as header:
        header.write("/* edited */\n")
    after = {name: native_build.library_path(name) for name in before}
    assert all(after[name] != before[name] for name in ("score", "attend", "dense", "qattn"))
    assert after["crc32c"] == before["crc32c"]


@pytest.mark.parametrize("arch, dtype, record_dtype", [
    ("llama", "float32", "auto"), ("qwen2", "float32", "auto"), ("llama", "bfloat16", "auto"),
    ("qwen2", "bfloat16", "auto"), ("llama", "float32", "int8"), ("qwen2", "bfloat16", "int4"),
])
def test_a_disk_policy_decodes_the_same_through_the_kernel_as_through_the_gathered_copy(model_dirs, tmp_path,
                                                                                       monkeypatch, arch, dtype,
                                                                                       record_dtype):
    from edgekv.runtime import Engine
    from edgekv.runtime.offload import attention, pipeline

    prompts = [[3 + i % 150 for i in range(157)], [7 + (i * 13) % 150 for i in range(141)]]  # not a multiple of G
    config = {"G": 4, "M": 6, "C": 12, "sigma": 2, "max_context": 256, "max_batch": 2, "window_tokens": 4,
              "kv_record_dtype": record_dtype}
    runs, used = {}, []
    monkeypatch.setattr(pipeline, "picked_attention", lambda *a: used.append(attention.picked_attention(*a)) or
                        used[-1])
    for name in ("native", "torch"):  # the backend's kernel, the torch reference's gathered copy
        (tmp_path / name).mkdir()
        with Engine.from_pretrained(model_dirs[arch], kv_path=tmp_path / name, config=config, policy="kvswap",
                                    device="cpu", dtype=dtype, backend=name) as engine:
            runs[name] = engine.generate(prompts, max_new_tokens=8, stop_token_ids=[], output_logits=True)
        assert used and all(isinstance(a, attention.SlotAttention) for a in used) == (name == "native")
        used.clear()
    assert_same_decodes(runs["native"], runs["torch"], dtype)


def test_a_strided_query_attends_as_its_contiguous_copy():
    """A float32 query that is a view (every other element of a wider row) is read by its values, not its memory."""
    layout, records, slots, valid, dense, resident, q = _case(2, 4, 2, 64, 4, 6, torch.float32)
    wide = torch.zeros(*q.shape[:-1], 2 * q.shape[-1])
    wide[..., ::2] = q
    attention = RecordAttention.for_layout(NATIVE, layout, 4, 0.125, torch.float32)
    assert torch.equal(attention(wide[..., ::2], records, slots, valid, dense, resident),
                       attention(q, records, slots, valid, dense, resident))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":")[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 targets")
@pytest.mark.parametrize("march, flag, fused", [("x86-64", "sse2", False), ("x86-64-v3", "avx2", True)])
def test_the_kernels_built_for_narrower_vectors_compute_the_same(tmp_path, march, flag, fused):
    """The scorer and the attention built for SSE (4 floats a vector) and AVX2 (8), as a machine without AVX-512 (16)
    builds them: the scorer's scores to the bit where the target fuses multiply-adds as this one does (each sum still
    runs over the rank in order), within float32 rounding where it does not; the attention within float32 rounding."""
    from edgekv.runtime import native_build
    from edgekv.runtime.kernels import load_library

    if flag not in _cpu_flags():
        pytest.skip(f"this CPU lacks {flag}")
    built = {}
    for name in ("score", "attend"):
        lib = native_build.LIBRARIES[name]
        flags = [f if f != "-march=native" else f"-march={march}" for f in lib.flags]
        built[name] = load_library(name, native_build.compile_units(lib, tmp_path / f"{name}-{march}.so", flags))
    torch.manual_seed(3)
    # K_lr's stored blocks of 64 tokens (runtime/selector.py KLR_BLOCK_TOKENS): 11 a sequence, rank 33
    rows, scales = torch.randint(-127, 128, (2, 11, 33, 64), dtype=torch.int8), torch.rand(2, 704).bfloat16()
    q = torch.randn(2, 9, 33)
    scores = []
    for lib in (NATIVE.lib("score"), built["score"]):
        out, scratch = torch.empty(2, 176), torch.empty(lib.ekv_score_scratch_floats(2, 9, 704, 4))
        assert lib.ekv_group_scores(rows.data_ptr(), rows.stride(1), rows.stride(0), scales.data_ptr(), scales.stride(0),
                                    q.data_ptr(), 2, 9, 33, 704, 4, 2, 1, None, scratch.data_ptr(), scratch.numel(),
                                    out.data_ptr(), 176) == 0
        scores.append(out)
    if fused:
        assert torch.equal(scores[0], scores[1])
    torch.testing.assert_close(scores[0], scores[1], atol=1e-6, rtol=2e-5)
    for shape, record_dtype in [((1, 9, 3, 64, 4, 50), "auto"), ((2, 8, 1, 256, 8, 5), "int8"),
                                ((2, 6, 3, 72, 2, 9), "auto"), ((1, 9, 3, 64, 4, 50), "int4")]:
        layout, records, slots, valid, dense, resident, q = _case(*shape, torch.float32, record_dtype=record_dtype)
        native = RecordAttention.for_layout(NATIVE, layout, shape[1], shape[3] ** -0.5, torch.float32)
        narrow = RecordAttention(built["attend"], layout, shape[3] ** -0.5, torch.float32)
        torch.testing.assert_close(narrow(q, records, slots, valid, dense, resident),
                                   native(q, records, slots, valid, dense, resident), atol=2e-6, rtol=1e-5)
