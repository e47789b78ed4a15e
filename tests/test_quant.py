"""The quantized KV formats (runtime/quant.py): bit-exact packing, error bounds, the record codecs."""
import numpy as np
import pytest
import torch

from edgekv.runtime.disk_store import RecordLayout
from edgekv.runtime.quant import (QUANT_DTYPES, error_bound, pack_codes, quant_format, quantize, quantize_keys,
                                  quantize_values, record_codec, unpack_codes)


def kv_like(shape, seed=0):
    """Keys with per-channel offsets and a few outlier channels, as real post-RoPE keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x += torch.randn(shape[-1], generator=g) * 4
    x[..., 3] *= 20
    return x


@pytest.mark.parametrize("bits", [8, 4])
def test_packing_round_trips_every_code_bit_exactly(bits):
    codes = torch.randint(0, 1 << bits, (5, 3, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_int4_packs_the_even_index_in_the_low_nibble():
    packed = pack_codes(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8), 4)
    assert packed.tolist() == [[0x21, 0x0F]]


@pytest.mark.parametrize("name", QUANT_DTYPES)
@pytest.mark.parametrize("case", ["keys", "values", "constant", "negative", "spike", "tiny"])
def test_every_value_is_within_half_a_step(name, case):
    fmt = quant_format(name)
    x = kv_like((3, 16, 64))
    if case == "constant":
        x = torch.full((3, 16, 64), -2.75)
    elif case == "negative":
        x = -x.abs() - 100
    elif case == "spike":
        x[1, 5, 7] = 3000.0
    elif case == "tiny":
        x = x * 1e-6
    q = quantize_values(x, fmt) if case == "values" else quantize_keys(x, fmt)
    assert q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float16
    err = (q.dequantize() - x).abs()
    assert (err <= error_bound(q)).all(), float((err - error_bound(q)).max())


@pytest.mark.parametrize("name", QUANT_DTYPES)
def test_the_kivi_split_scales_keys_per_channel_and_values_per_token(name):
    fmt = quant_format(name)
    x = kv_like((2, 8, 64))
    assert quantize_keys(x, fmt).scale.shape == (2, 1, 64)
    assert quantize_values(x, fmt).scale.shape == (2, 8, 1)


def test_per_channel_keys_beat_per_token_keys_on_outlier_channels():
    """Why keys are quantized per channel: an outlier channel ruins every per-token scale."""
    fmt = quant_format("int4")
    x = kv_like((4, 16, 64))
    per_channel = (quantize_keys(x, fmt).dequantize() - x).pow(2).mean()
    per_token = (quantize(x, fmt, dim=-1).dequantize() - x).pow(2).mean()
    assert per_channel < per_token / 4


def test_a_finer_format_is_closer():
    x = kv_like((3, 16, 64))
    errors = [(quantize_keys(x, quant_format(n)).dequantize() - x).abs().mean() for n in ("int8", "int4")]
    assert errors[0] < errors[1] / 8


def test_values_beyond_float16_scales_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_record_dtype auto"):
        quantize_keys(torch.full((1, 4, 64), 1e6), quant_format("int8"))
    with pytest.raises(ValueError, match="finite"):
        quantize_values(torch.full((1, 4, 64), float("nan")), quant_format("int8"))


def test_unknown_formats_are_named():
    with pytest.raises(ValueError, match="int3.*int8"):
        quant_format("int3")
    with pytest.raises(ValueError, match="bf8"):
        record_codec("bf8", 2, 4, 64, torch.float32)


@pytest.mark.parametrize("record_dtype", ["auto", "fp16", "int8", "int4"])
@pytest.mark.parametrize("align", [512, 4096])
def test_records_decode_to_what_in_memory_quantization_gives(record_dtype, align):
    H, G, D, n = 3, 8, 64, 5
    layout = RecordLayout(G, H, D, torch.float32, align, record_dtype)
    k, v = kv_like((H, n * G, D), 1), kv_like((H, n * G, D), 2)
    records = layout.pack(k, v)
    assert records.shape == (n, layout.stride_bytes) and layout.stride_bytes % align == 0
    assert records.ctypes.data % align == 0
    decoded = layout.decode(records, torch.float32)  # [n, 2, H, G, D]
    grouped = [t.reshape(H, n, G, D).transpose(0, 1) for t in (k, v)]
    if record_dtype == "auto":
        expect = grouped
    elif record_dtype == "fp16":
        expect = [t.half().float() for t in grouped]
    else:
        fmt = quant_format(record_dtype)
        expect = [quantize_keys(grouped[0], fmt).dequantize(), quantize_values(grouped[1], fmt).dequantize()]
    assert torch.equal(decoded[:, 0], expect[0]) and torch.equal(decoded[:, 1], expect[1])
    again = layout.pack(decoded[:, 0].transpose(0, 1).reshape(H, n * G, D), decoded[:, 1].transpose(0, 1).reshape(H, n * G, D))
    if record_dtype in ("auto", "fp16"):
        assert np.array_equal(again, records)


@pytest.mark.parametrize("record_dtype,ratio", [("int8", 0.5), ("int4", 0.25)])
def test_quantized_records_are_the_code_bytes_plus_their_scales(record_dtype, ratio):
    H, G, D = 3, 16, 64
    fp16 = RecordLayout(G, H, D, torch.float32, 512, "fp16").record_bytes
    quant = RecordLayout(G, H, D, torch.float32, 512, record_dtype).record_bytes
    assert quant == int(fp16 * ratio) + 2 * 2 * (H * D + H * G)  # float16 scale and zero per key channel, per value token


@pytest.mark.parametrize("G,per_channel", [(1, False), (2, False), (4, True), (16, True)])
def test_small_groups_scale_their_keys_per_token(G, per_channel):
    """One or two tokens give a channel no statistics: per-channel scales would outweigh the codes."""
    layout = RecordLayout(G, 2, 64, torch.float32, 512, "int8")
    k = kv_like((2, 3 * G, 64))
    qk, _ = layout.codec.quantized(torch.from_numpy(layout.pack(k, k)))
    assert qk.scale.shape[-2:] == ((1, 64) if per_channel else (G, 1))
    assert layout.record_bytes == 2 * 2 * G * 64 + 2 * 2 * 2 * ((64 if per_channel else G) + G)
    assert layout.record_bytes < RecordLayout(G, 2, 64, torch.float32, 512, "fp16").record_bytes


def test_float_records_are_views_and_quantized_ones_refuse_the_float_view():
    layout = RecordLayout(4, 2, 64, torch.float32, 512)
    records = layout.pack(torch.randn(2, 8, 64), torch.randn(2, 8, 64))
    view = layout.typed(records)
    view[0, 0, 0, 0, 0] = 7.0
    assert layout.decode(records, torch.float32)[0, 0, 0, 0, 0] == 7.0
    with pytest.raises(TypeError, match="decode"):
        RecordLayout(4, 2, 64, torch.float32, 512, "int8").typed(records)


def test_odd_head_dim_cannot_hold_int4_pairs():
    with pytest.raises(ValueError, match="even head_dim"):
        RecordLayout(4, 2, 63, torch.float32, 512, "int4").record_bytes
