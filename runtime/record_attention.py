"""A disk policy's decode attention straight from its host slots' records (runtime/native/ekv_attend.c), on a CPU.

The torch path (runtime/offload/attention.py ``GatheredAttention``) gathers the picked records into a new
tensor, permutes it, concatenates the sinks and the ring, and attends the copy.  The kernel reads each key and value
where it lies, once: SmolLM2 8K, batch 1, the deployed configuration (~900 keys a KV head), 0.29 -> 0.11 ms a layer
in the decode step.  It serves float32, bfloat16, int8 and int4 records in host memory (codes widened with their
scales as they are read, never dequantised into a copy) on the native backend (runtime/kernels.py); the torch
backend, the slots a GPU holds and float16 records attend through torch.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from .native_build import address
from .aside import AsideThread
from .disk_store import RecordLayout
from .kernels import Backend
from .quant import FloatRecord, QuantRecord

KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the float dtypes the kernel reads (its KV_F32, KV_BF16)
CODE_KINDS = {8: 2, 4: 3}  # records of codes, by their bits (KV_INT8, KV_INT4)
SCALES = ("k_scale", "k_zero", "v_scale", "v_zero")  # QuantRecord's float16 fields, in the kernel's order


class RecordAttention:
    """One query token per sequence over its picked records and the dense segments held in memory; ``for_layout``
    says whether it serves.  With the policy's helper thread lent (``aside``), its (sequence, KV head) units are
    shared with it."""

    aside: AsideThread | None = None

    def __init__(self, lib: ctypes.CDLL, layout: RecordLayout, scaling: float, dtype: torch.dtype):
        self.lib, self.layout, self.scaling, self.dtype = lib, layout, scaling, dtype
        codec = layout.codec
        coded = isinstance(codec, QuantRecord)
        self.record_kind = CODE_KINDS[codec.fmt.bits] if coded else KINDS[codec.dtype]
        self.dense_kind = KINDS[dtype]
        self.scales = np.array([codec.spans[name][0] for name in SCALES] if coded else [0] * 4, dtype=np.int64)
        self.keys_per_channel = int(coded and codec.keys_per_channel)
        self._scratch = np.empty(0, dtype=np.uint8)
        self._job: np.ndarray | None = None  # a shared call's job, made once (the call returns once it is done)
        self._worker_bytes: dict[tuple[int, int, int], int] = {}  # (picks, dense tokens, group queries) -> scratch
        self._mask_of, self._mask_args = None, ()  # the last dense mask, and (its uint8 view, address, row stride)

    @classmethod
    def for_layout(cls, backend: Backend, layout: RecordLayout, n_heads: int, scaling: float, dtype: torch.dtype
                   ) -> "RecordAttention | None":
        """The native attention for records of ``layout`` in host memory beside dense segments of ``dtype``, or None
        where torch attends: a backend without the kernel (torch, a GPU's slots), a model dtype other than float32 or
        bfloat16, float records not in it (float16), head shapes above the kernel's maxima."""
        codec, lib = layout.codec, backend.lib("attend")
        if lib is None or dtype not in KINDS or (isinstance(codec, FloatRecord) and codec.dtype != dtype):
            return None
        if layout.head_dim > lib.max_head_dim or n_heads // layout.n_kv_heads > lib.max_group_queries:
            return None
        return cls(lib, layout, scaling, dtype)

    def segments(self, dense: list[torch.Tensor]) -> np.ndarray:
        """Dense segments [B, 2, H_kv, S_i, d] as the kernel takes them, [n, 2] int64 (address, S_i): made once by a
        caller whose segments stay where they are (a policy's sinks and ring, a layer each)."""
        if any(segment.dtype != self.dtype or not segment.is_contiguous() for segment in dense):
            raise ValueError(f"dense segments of {[(s.dtype, s.is_contiguous()) for s in dense]} (dtype, contiguous): "
                             f"the kernel reads contiguous {self.dtype}, the model's dtype")
        return np.array([[segment.data_ptr(), segment.shape[3]] for segment in dense], dtype=np.int64).reshape(-1, 2)

    def __call__(self, q: torch.Tensor, records: np.ndarray, slots: np.ndarray, valid: np.ndarray,
                 dense: list[torch.Tensor] | np.ndarray, dense_mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, 1, d]; records uint8 [n_slots, stride] (the slots); slots int64 and valid bool [B, M] (flat slot
        of each pick); dense: segments [B, 2, H_kv, S_i, d] in the model's dtype, or ``segments`` of them;
        dense_mask bool [B, sum S_i] (a step's layers pass the same one: it is prepared once).  Returns the attention
        output [B, H, 1, d] in q's dtype."""
        b, h, _, d = q.shape
        layout, group_queries = self.layout, h // self.layout.n_kv_heads
        query = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
        out = torch.empty(b, h, 1, d)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        valid = np.ascontiguousarray(valid, dtype=bool).view(np.uint8)
        if dense_mask is not self._mask_of:  # held, so no later mask takes its id
            mask = dense_mask.contiguous().view(torch.uint8)
            self._mask_of, self._mask_args = dense_mask, (mask, mask.data_ptr(), mask.stride(0))
        segments = dense if isinstance(dense, np.ndarray) else self.segments(dense)
        sizes = (slots.shape[1], int(segments[:, 1].sum()), group_queries)
        worker_bytes = self._worker_bytes.get(sizes)
        if worker_bytes is None:
            worker_bytes = self._worker_bytes[sizes] = -(-self.lib.ekv_attend_scratch_bytes(
                sizes[0], layout.group_tokens, sizes[1], group_queries) // 64) * 64
        workers = 1 if self.aside is None else 2  # the caller's part of the scratch, then the helper's
        if self._scratch.nbytes < workers * worker_bytes:
            self._scratch = np.empty(workers * worker_bytes, dtype=np.uint8)
        arguments = (query.data_ptr(), b, layout.n_kv_heads, group_queries, d, self.scaling, address(records),
                     records.strides[0], records.shape[0], address(slots), address(valid), slots.shape[1],
                     layout.group_tokens, self.record_kind, address(self.scales), self.keys_per_channel,
                     address(segments), len(segments), *self._mask_args[1:], self.dense_kind,
                     address(self._scratch), worker_bytes, out.data_ptr())
        if self.aside is None:
            code = self.lib.ekv_attend(*arguments)
        else:
            if self._job is None:
                self._job = np.empty(self.lib.job_bytes, dtype=np.uint8)
            code = self.lib.ekv_attend_job(address(self._job), *arguments)
            if code > 0:
                self.aside.share(self.lib.unit, self._job, code)
            code = min(code, 0)
        if code != 0:  # for_layout checked the head shape, the slot table gives slots inside the buffer: a bug
            raise RuntimeError("the native attention refused its input: " + (
                "a valid pick's slot lies outside the slots" if code == -1 else "a head shape above its maxima, an "
                "unknown kind or a short scratch"))
        return out if q.dtype == torch.float32 else out.to(q.dtype)
