"""Decode attention over an in-memory KV cache in one native call (runtime/native/ekv_dense.c), on a CPU: ``full``'s.

torch's path (``forward.decode_attention``) is two grouped matmuls and a softmax over the cache; at a small model's
shapes (three query heads a KV head) the first matmul runs far below the memory's speed.  The kernel reads each key
and value once for all the query heads of its KV head, in parts of 256 positions shared with the decode step's
helper thread (runtime/aside.py).  float32, bfloat16 and float16 caches on the native backend (runtime/kernels.py);
others, the torch backend and a GPU attend through torch.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from .native_build import address
from .aside import AsideThread
from .kernels import Backend

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's KV_F32, KV_BF16, KV_F16


class DenseAttention:
    """One query token per sequence over positions [start, stop) of a cache [B, H_kv, S, d] per K and V; ``for_cache``
    says whether it serves.  With a helper thread lent (``aside``), its parts are shared with it."""

    aside: AsideThread | None = None

    def __init__(self, lib: ctypes.CDLL, scaling: float):
        self.lib, self.scaling = lib, scaling
        self._partial = torch.empty(0)
        self._job = np.empty(lib.job_bytes, dtype=np.uint8)
        self._job_at = self._job.ctypes.data
        self._positions: tuple | None = None  # (start, stop, tokens) as last given -> their int64 arrays and parts

    @classmethod
    def for_cache(cls, backend: Backend, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int,
                  scaling: float) -> "DenseAttention | None":
        """The native attention for a cache of ``dtype`` on ``backend``, or None where torch attends: a backend
        without the kernel (torch, a GPU), another dtype, head shapes above the kernel's maxima."""
        lib = backend.lib("dense")
        if lib is None or dtype not in KINDS or head_dim > lib.max_head_dim or \
                n_heads // n_kv_heads > lib.max_group_queries:
            return None
        return cls(lib, scaling)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: np.ndarray, stop: np.ndarray
                 ) -> torch.Tensor:
        """q [B, H, 1, d]; k, v [B, H_kv, S, d] of one dtype and strides, each row of d contiguous (a slice of a
        larger cache serves); start/stop int64 [B]: the positions each sequence attends.  Returns [B, H, 1, d] in q's
        dtype."""
        b, h, _, d = q.shape
        n_kv = k.shape[1]
        strides = k.stride()
        if k.dtype != v.dtype or strides != v.stride() or strides[2:] != (d, 1) or any(x % d for x in strides[:2]):
            raise ValueError(f"K {k.dtype} {strides} and V {v.dtype} {v.stride()}: the kernel reads K and V of one "
                             "dtype and strides, in rows of d contiguous")
        start, stop, parts = self._checked(start, stop, k.shape[2])
        query = q.reshape(b, h, d).float().contiguous()
        out = torch.empty(b, h, d)
        floats = b * n_kv * parts * (h // n_kv) * (d + 2)
        if self._partial.numel() < floats:
            self._partial = torch.empty(floats)
        units = self.lib.ekv_dense_job(self._job_at, query.data_ptr(), b, n_kv, h // n_kv, d, self.scaling,
                                       k.data_ptr(), v.data_ptr(), strides[1] // d, strides[0] // d, KINDS[k.dtype],
                                       address(start), address(stop), self._partial.data_ptr(),
                                       self._partial.numel())
        if units < 0:  # for_cache checked the head shapes and the dtype, _checked the positions: a bug
            raise RuntimeError("the native dense attention refused its input: " + (
                "positions outside the cache" if units == -1 else "a head shape above its maxima or an unknown kind"))
        if self.aside is None:
            self.lib.ekv_dense_run(self._job_at, out.data_ptr())
        else:
            self.aside.share(self.lib.unit, self._job, units)
            self.lib.ekv_dense_merge(self._job_at, out.data_ptr())
        return out.to(q.dtype).view(b, h, 1, d)

    def _checked(self, start: np.ndarray, stop: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
        """start and stop as int64 arrays and the parts of the longest span, checked inside the cache's ``tokens``
        positions; once for the arrays a step passes to each of its layers (a caller never changes them in place)."""
        last = self._positions
        if last is None or last[0][0] is not start or last[0][1] is not stop or last[0][2] != tokens:
            starts, stops = np.ascontiguousarray(start, dtype=np.int64), np.ascontiguousarray(stop, dtype=np.int64)
            if (starts < 0).any() or (stops > tokens).any() or (starts > stops).any():
                raise ValueError(f"positions [{starts}, {stops}) outside the cache's {tokens}: each start >= 0, "
                                 f"each stop <= {tokens} and no start after its stop")
            self._positions = (start, stop, tokens), (starts, stops, self.lib.ekv_dense_parts(int((stops - starts).max(initial=0))))
        return self._positions[1]
