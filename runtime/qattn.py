"""Decode attention over quantized KV groups without dequantizing them (arkv's quantized state).

A group record holds ``group_tokens`` tokens of every KV head: key codes per channel over the group
and value codes per token (runtime/quant.py formats), their float16 scales and zeros, the tokens'
positions (< 0: a hole, an evicted token) and their attention statistics (``stats``: observations,
mean, mean square; read by the policy, not by attention).  ``group_kernels`` gives a backend's scores and values
over one sequence's rows: the C kernel (native/ekv_qattn.c) on the native backend, else the torch reference, which
dequantizes a block of groups at a time (never the whole cache at once); ``batch_group_scores`` and
``batch_group_values`` are that reference over a batch (a GPU's path).
"""
from __future__ import annotations

import ctypes

import torch

from .kernels import Backend
from .quant import SCALE_DTYPE, QuantFormat, unpack_codes

KERNEL_FIELDS = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "pos")  # the C enum's order
TORCH_BLOCK_GROUPS = 64  # groups a CPU dequantizes together on the torch path (a GPU takes them all in one go)


def align16(n: int) -> int:
    return -(-n // 16) * 16


class GroupLayout:
    """Byte layout of one quantized group record; every field starts 16-byte aligned."""

    def __init__(self, n_kv_heads: int, group_tokens: int, head_dim: int, fmt: QuantFormat):
        if fmt.bits == 4 and head_dim % 2:
            raise ValueError(f"int4 codes need an even head_dim; got {head_dim}")
        h, g, d = n_kv_heads, group_tokens, head_dim
        self.h, self.g, self.d, self.fmt = h, g, d, fmt
        self.code_bytes = fmt.code_bytes(d)
        half = SCALE_DTYPE.itemsize
        sizes = {"k_codes": h * g * self.code_bytes, "v_codes": h * g * self.code_bytes, "k_scale": h * d * half,
                 "k_zero": h * d * half, "v_scale": h * g * half, "v_zero": h * g * half, "pos": g * 4, "stats": g * 12}
        self.offsets, start = {}, 0
        for name, size in sizes.items():
            self.offsets[name] = start
            start += align16(size)
        self.record_bytes = start
        self._sizes = sizes
        self.kernel_offsets = torch.tensor([self.offsets[f] for f in KERNEL_FIELDS], dtype=torch.int64)

    def fields(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of uint8 rows [..., n, record_bytes] (any leading dims: a batch of sequences' rows): codes
        [..., n, H, g, db], key scale/zero [..., n, H, 1, d], value scale/zero [..., n, H, g, 1], pos [..., n, g]
        int32, stats [..., n, g, 3] float32."""
        lead, h, g, d = rows.shape[:-1], self.h, self.g, self.d

        def raw(name):
            a = self.offsets[name]
            return rows[..., a: a + self._sizes[name]]

        return {
            "k_codes": raw("k_codes").view(*lead, h, g, self.code_bytes),
            "v_codes": raw("v_codes").view(*lead, h, g, self.code_bytes),
            "k_scale": raw("k_scale").view(SCALE_DTYPE).view(*lead, h, 1, d),
            "k_zero": raw("k_zero").view(SCALE_DTYPE).view(*lead, h, 1, d),
            "v_scale": raw("v_scale").view(SCALE_DTYPE).view(*lead, h, g, 1),
            "v_zero": raw("v_zero").view(SCALE_DTYPE).view(*lead, h, g, 1),
            "pos": raw("pos").view(torch.int32),
            "stats": raw("stats").view(torch.float32).view(*lead, g, 3),
        }


class TorchGroups:
    """Scores and values over one sequence's group rows by the torch reference (``batch_group_scores`` and
    ``batch_group_values`` of a batch of one)."""

    def scores(self, q: torch.Tensor, rows: torch.Tensor, layout: GroupLayout, scaling: float) -> torch.Tensor:
        """scaling * q . k for every token of ``rows`` (uint8 [n, record_bytes]): q [H_kv, rep, d] float32 ->
        [H_kv, rep, n * group_tokens] float32, -inf at holes."""
        return batch_group_scores(q.float()[None], rows[None], layout, scaling)[0]

    def values(self, w: torch.Tensor, rows: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
        """sum_t w_t v_t over ``rows``: w [H_kv, rep, n * group_tokens] float32 (0 at holes) -> [H_kv, rep, d]."""
        return batch_group_values(w.float()[None], rows[None], layout)[0]


class NativeGroups(TorchGroups):
    """``TorchGroups``'s scores and values by the C kernel (runtime/native/ekv_qattn.c), on the CPU's threads."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def scores(self, q, rows, layout, scaling):
        h, rep, d = q.shape
        n = _records(rows).shape[0]
        q = q.float().contiguous()
        out = torch.empty(h, rep, n * layout.g, dtype=torch.float32)
        self.lib.ekv_qscores(q.data_ptr(), h, rep, d, layout.fmt.bits, rows.data_ptr(), rows.stride(0), n, layout.g,
                             layout.kernel_offsets.data_ptr(), scaling, out.data_ptr(), torch.get_num_threads())
        return out

    def values(self, w, rows, layout):
        h, rep, _ = w.shape
        w = w.float().contiguous()
        out = torch.empty(h, rep, layout.d, dtype=torch.float32)
        if self.lib.ekv_qvalues(w.data_ptr(), h, rep, layout.d, layout.fmt.bits, _records(rows).data_ptr(),
                                rows.stride(0), rows.shape[0], layout.g, layout.kernel_offsets.data_ptr(),
                                out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("the quantized attention kernel could not allocate its per-thread sums")
        return out


def group_kernels(backend: Backend) -> TorchGroups:
    """The scores and values over quantized groups on ``backend``: the C kernel's where it has it, else torch's."""
    lib = backend.lib("qattn")
    return TorchGroups() if lib is None else NativeGroups(lib)


def _records(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the kernel reads them: each record's bytes contiguous (a ValueError otherwise)."""
    if rows.stride(1) != 1:
        raise ValueError("group rows must be byte-contiguous records")
    return rows


def _block_groups(rows: torch.Tensor) -> int:
    """Groups dequantized per torch call (rows [B, n, record_bytes]): a bounded block on a CPU (the float codes stay
    in cache), every group at once on a GPU (a loop of small blocks is a few kernel launches per 64 groups, ~10^5 a
    step at batch 8, 32K)."""
    return TORCH_BLOCK_GROUPS if rows.device.type == "cpu" else max(1, rows.shape[1])


def _unusable(f: dict, usable: torch.Tensor | None, start: int) -> torch.Tensor:
    """[B, n, g] True where a token takes no part: a hole, or any token of a row ``usable`` [B, rows] rules out
    (this block's rows are usable's from ``start`` on)."""
    hole = f["pos"] < 0
    if usable is None:
        return hole
    return hole | ~usable[:, start: start + hole.shape[1], None]


def batch_group_scores(q: torch.Tensor, rows: torch.Tensor, layout: GroupLayout, scaling: float,
                       usable: torch.Tensor | None = None) -> torch.Tensor:
    """The scores of B sequences' group rows in one pass, on torch (the reference, and the GPU's path): q [B, H_kv, rep, d]
    float32, rows uint8 [B, n, record_bytes] -> [B, H_kv, rep, n * group_tokens], -inf at holes and at the rows
    ``usable`` [B, n] rules out (a row that is not one of that sequence's groups: its bytes may be anything).
    The scales fold into q as the kernel does; codes are unpacked a block of groups at a time."""
    parts = []
    block = _block_groups(rows)
    for start in range(0, rows.shape[1], block):
        f = layout.fields(rows[:, start: start + block])
        codes = unpack_codes(f["k_codes"], layout.fmt.bits).float()  # [B, n, H, g, d]
        scale, zero = f["k_scale"].float()[..., 0, :], f["k_zero"].float()[..., 0, :]  # [B, n, H, d]
        qs = q[:, None] * scale[..., None, :] * scaling  # [B, n, H, rep, d]
        s = torch.einsum("bnhjd,bnhtd->bhjnt", qs, codes) \
            + torch.einsum("bhjd,bnhd->bhjn", q * scaling, zero)[..., None]
        parts.append(s.masked_fill(_unusable(f, usable, start)[:, None, None], float("-inf")).flatten(3))
    return torch.cat(parts, dim=-1) if parts else q.new_zeros(*q.shape[:3], 0)


def batch_group_values(w: torch.Tensor, rows: torch.Tensor, layout: GroupLayout,
                       usable: torch.Tensor | None = None) -> torch.Tensor:
    """The values of B sequences' group rows weighed in one pass: w [B, H_kv, rep, n * group_tokens] float32 -> [B, H_kv, rep, d];
    holes and rows ``usable`` rules out weigh nothing (their scales too: 0 x a NaN is a NaN)."""
    out = w.new_zeros(*w.shape[:3], layout.d)
    g, block = layout.g, _block_groups(rows)
    for start in range(0, rows.shape[1], block):
        f = layout.fields(rows[:, start: start + block])
        n = f["pos"].shape[1]
        drop = _unusable(f, usable, start)  # [B, n, g]
        wb = w[..., start * g: (start + n) * g].unflatten(-1, (n, g)).masked_fill(drop[:, None, None], 0.0)
        codes = unpack_codes(f["v_codes"], layout.fmt.bits).float()  # [B, n, H, g, d]
        scale, zero = (f[name].float()[..., 0].masked_fill(drop[:, :, None], 0.0).transpose(1, 2)[:, :, None]
                       for name in ("v_scale", "v_zero"))  # [B, H, 1, n, g]
        out += torch.einsum("bhjnt,bnhtd->bhjd", wb * scale, codes)
        out += (wb * zero).sum((-1, -2))[..., None]
    return out
