"""Quantized KV formats: int8 and int4 codes with their scales, the one place that packs and unpacks them.

Keys are quantized per channel over a group of tokens and values per token (the KIVI split: key
outliers sit in fixed channels, value outliers in tokens); a record of fewer than ``KEY_CHANNEL_MIN_TOKENS``
tokens (``token``'s G = 1) scales its keys per token too.  Asymmetric min-max: a slice's codes are
round((x - zero) / scale) in [0, 2^bits - 1], with ``zero`` the slice's minimum and ``scale`` its range
over the levels, both stored as float16 beside the codes.  Both are rounded outward to float16 before
the codes are taken (zero down, scale up), so every code is in range and the reconstruction
``code * scale + zero`` is within ``scale / 2`` of x, plus float32 rounding (``error_bound``).
int4 packs two codes per byte along the last dimension: the even index in the low nibble.

Used by the disk records of the offloading policies (``RecordLayout`` with ``kv_record_dtype``) and by
the quantized state of ``arkv``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUANT_DTYPES = ("int8", "int4")
RECORD_DTYPES = ("auto", "fp16", *QUANT_DTYPES)
SCALE_DTYPE = torch.float16
# Keys go per channel over a group from this many tokens on; a smaller group's per-channel scales would cost as
# much as its int8 codes, so its keys go per token (SmolLM2 keys, int8: attention within 0.5 % total variation).
KEY_CHANNEL_MIN_TOKENS = 4


@dataclass(frozen=True)
class QuantFormat:
    name: str
    bits: int

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def code_bytes(self, n_values: int) -> int:
        """Bytes of ``n_values`` packed codes (n_values even for int4)."""
        return n_values * self.bits // 8


def quant_format(name: str) -> QuantFormat:
    if name not in QUANT_DTYPES:
        raise ValueError(f"unknown quantized KV format {name!r}; choose one of {QUANT_DTYPES}")
    return QuantFormat(name, int(name[3:]))


@dataclass(frozen=True)
class Quantized:
    """codes uint8 [..., d * bits / 8]; scale and zero float16, the reduced dimension kept with size 1."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    fmt: QuantFormat

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """code * scale + zero, in two passes over the float32 result (into ``out`` when given)."""
        codes = unpack_codes(self.codes, self.fmt.bits)
        if out is None:
            out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        out.copy_(codes)
        torch.addcmul(self.zero.float(), out, self.scale.float(), out=out)
        return out if dtype == torch.float32 else out.to(dtype)


def _round_outward(low: torch.Tensor, high: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 zero <= low and float16 scale with zero + levels * scale >= high (so codes never clip)."""
    big = torch.finfo(SCALE_DTYPE).max
    zero = low.clamp(-big, big).to(SCALE_DTYPE)
    zero = torch.where(zero.float() > low, torch.nextafter(zero, torch.full_like(zero, -float("inf"))), zero)
    step = ((high - zero.float()) / levels).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
    scale = step.clamp(max=big).to(SCALE_DTYPE)
    scale = torch.where(scale.float() < step, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return zero, scale


def quantize(x: torch.Tensor, fmt: QuantFormat, dim: int) -> Quantized:
    """One (scale, zero) per slice along ``dim``; x float of any dtype, codes packed along the last dim."""
    xf = x.float()
    low, high = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    limit = torch.finfo(SCALE_DTYPE).max / 2
    if not (bool(torch.isfinite(low).all() & torch.isfinite(high).all())
            and max(-float(low.min()), float(high.max())) <= limit):
        raise ValueError(f"KV values must be finite and within +-{limit:g} for {fmt.name} codes (float16 scales); "
                         "this cache holds values beyond that: keep it unquantized (kv_record_dtype auto)")
    zero, scale = _round_outward(low, high, fmt.levels)
    codes = ((xf - zero.float()) / scale.float()).round_().clamp_(0, fmt.levels).to(torch.uint8)
    return Quantized(pack_codes(codes, fmt.bits), scale, zero, fmt)


def quantize_keys(k: torch.Tensor, fmt: QuantFormat) -> Quantized:
    """k [..., T, d]: per channel over the T tokens given (call it on one group)."""
    return quantize(k, fmt, dim=-2)


def quantize_values(v: torch.Tensor, fmt: QuantFormat) -> Quantized:
    """v [..., T, d]: per token."""
    return quantize(v, fmt, dim=-1)


def error_bound(q: Quantized) -> torch.Tensor:
    """Largest |x - dequantize| a slice may show: half a step, plus float32 rounding of the reconstruction."""
    scale = q.scale.float()
    magnitude = q.zero.float().abs() + q.fmt.levels * scale
    return scale / 2 + magnitude * 2 * torch.finfo(torch.float32).eps


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 codes pack in pairs along the last dimension; got an odd size {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


class FloatRecord:
    """K [H, G, d] then V [H, G, d] in one float dtype: the unquantized record."""

    def __init__(self, n_kv_heads: int, group_tokens: int, head_dim: int, dtype: torch.dtype):
        self.shape = (2, n_kv_heads, group_tokens, head_dim)
        self.dtype = dtype
        self.record_bytes = int(np.prod(self.shape)) * torch.empty(0, dtype=dtype).element_size()

    def encode_into(self, dest: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """dest uint8 [n, >= record_bytes]; k, v [n, H, G, d]."""
        typed = dest[:, : self.record_bytes].view(self.dtype).unflatten(-1, self.shape)
        typed[:, 0] = k
        typed[:, 1] = v

    def decode(self, records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [..., >= record_bytes] -> [..., 2, H, G, d]: a view when ``dtype`` is the record's."""
        typed = records[..., : self.record_bytes].view(self.dtype).unflatten(-1, self.shape)
        return typed if dtype == self.dtype else typed.to(dtype)


class QuantRecord:
    """One group as codes then scales: K codes [H, G, d*b/8], V codes [H, G, d*b/8], K scale and zero [H, d]
    (per token, [H, G], below ``KEY_CHANNEL_MIN_TOKENS``), V scale and zero [H, G] (float16).
    Codes first keeps them aligned for vector loads."""

    def __init__(self, n_kv_heads: int, group_tokens: int, head_dim: int, fmt: QuantFormat):
        h, g, d = n_kv_heads, group_tokens, head_dim
        if fmt.bits == 4 and d % 2:
            raise ValueError(f"int4 records need an even head_dim; got {d}")
        self.fmt, self.h, self.g, self.d = fmt, h, g, d
        code = fmt.code_bytes(h * g * d)
        half = SCALE_DTYPE.itemsize
        self.keys_per_channel = g >= KEY_CHANNEL_MIN_TOKENS
        self.k_scale_shape = (h, 1, d) if self.keys_per_channel else (h, g, 1)
        k_scales = h * (d if self.keys_per_channel else g) * half
        sizes = {"k_codes": code, "v_codes": code, "k_scale": k_scales, "k_zero": k_scales,
                 "v_scale": h * g * half, "v_zero": h * g * half}
        self.spans, start = {}, 0
        for name, size in sizes.items():
            self.spans[name] = (start, start + size)
            start += size
        self.record_bytes = start

    def _field(self, records: torch.Tensor, name: str) -> torch.Tensor:
        a, b = self.spans[name]
        return records[..., a:b]

    def encode_into(self, dest: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        qk = quantize(k, self.fmt, dim=-2 if self.keys_per_channel else -1)
        qv = quantize_values(v, self.fmt)
        n = k.shape[0]
        for name, t in (("k_codes", qk.codes), ("v_codes", qv.codes)):
            self._field(dest, name).copy_(t.reshape(n, -1))
        for name, t in (("k_scale", qk.scale), ("k_zero", qk.zero), ("v_scale", qv.scale), ("v_zero", qv.zero)):
            self._field(dest, name).view(SCALE_DTYPE).copy_(t.reshape(n, -1))

    def quantized(self, records: torch.Tensor) -> tuple[Quantized, Quantized]:
        """The records' keys and values as ``Quantized`` (views, no copy): [..., H, G, ...]."""
        lead = records.shape[:-1]
        h, g, d, fmt = self.h, self.g, self.d, self.fmt
        scales = lambda name, shape: self._field(records, name).view(SCALE_DTYPE).reshape(*lead, *shape)  # noqa: E731
        codes = lambda name: self._field(records, name).reshape(*lead, h, g, fmt.code_bytes(d))  # noqa: E731
        ks = self.k_scale_shape
        return (Quantized(codes("k_codes"), scales("k_scale", ks), scales("k_zero", ks), fmt),
                Quantized(codes("v_codes"), scales("v_scale", (h, g, 1)), scales("v_zero", (h, g, 1)), fmt))

    def decode(self, records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantise straight into one [..., 2, H, G, d] float32 tensor (no per-half temporaries)."""
        qk, qv = self.quantized(records)
        out = torch.empty((*records.shape[:-1], 2, self.h, self.g, self.d), dtype=torch.float32, device=records.device)
        qk.dequantize(out=out[..., 0, :, :, :])
        qv.dequantize(out=out[..., 1, :, :, :])
        return out if dtype == torch.float32 else out.to(dtype)


def record_codec(record_dtype: str, n_kv_heads: int, group_tokens: int, head_dim: int, model_dtype: torch.dtype):
    """The codec of one group record: "auto" keeps the model's dtype (exact), "fp16" float16, "int8"/"int4" codes."""
    if record_dtype == "auto":
        return FloatRecord(n_kv_heads, group_tokens, head_dim, model_dtype)
    if record_dtype == "fp16":
        return FloatRecord(n_kv_heads, group_tokens, head_dim, torch.float16)
    if record_dtype in QUANT_DTYPES:
        return QuantRecord(n_kv_heads, group_tokens, head_dim, quant_format(record_dtype))
    raise ValueError(f"unknown KV record dtype {record_dtype!r}; choose one of {RECORD_DTYPES}")
