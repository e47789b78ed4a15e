"""A stand-in for pyxrt (XRT's Python binding) and a SmartSSD running ekv_score, for host-code tests without the card.

It behaves as the real binding does where the host code depends on it, read from Xilinx/XRT at commit 963c58ee22:
- src/python/pybind11/src/pyxrt.cpp, ``kernel.__call__``: one xrt::run; for argument index i it tries
  ``set_arg(i, arg.cast<xrt::bo>())`` and then ``set_arg<int>(i, arg.cast<int>())``, each in a try block that swallows
  every std::exception, then ``start()``.  So a Python float (pybind11's int caster refuses PyFloat) is dropped and the
  argument keeps its zero; a value of the wrong kind, or an index past the kernel's arguments, is dropped silently too;
  the call itself never fails.  A numpy float32 passes pybind11's converting cast (PyNumber_Long) and truncates.
- ``run.wait()`` returns the ert_cmd_state; src/runtime_src/core/include/xrt/xrt_kernel.h: "Completion does not
  guarantee success" (values from include/xrt/detail/ert.h).
- ``bo(device, size, flags, group)``; ``bo(parent, size, offset)``, a sub-buffer view at the parent's address + offset
  (core/common/api/xrt_bo.cpp buffer_sub, bounds checked); ``write(buffer, seek)``, ``read(size, skip)`` (an int8
  array), ``sync(direction[, size, offset])``, ``map()`` (a memoryview of size() bytes).
- ``kernel.group_id(i)``: the memory bank argument i is connected to; a BO from another bank is copied by XRT
  (xrt_kernel.cpp validate_bo_at_index), so the kernel would write a copy: the fake fails the test instead.
A normal BO has a host copy that only sync() moves; a p2p BO's map() is the device memory itself (a PCIe BAR window:
Vitis_Accel_Examples host_xrt/p2p_simple_xrt/src/host.cpp preads into the mapped p2p BO and never syncs it).

Faults, as the binding surfaces them (pybind11 turns any C++ std::exception into RuntimeError, with its what()):
- ``device.sync_error``: bo.sync() raises it; XRT's sync_bo throws xrt_core::system_error(err, "unable to sync BO")
  (core/common/ishim.h), a std::system_error whose what() is "unable to sync BO: <strerror(err)>".
- ``device.wait_error``: run.wait() raises it: a wait that throws instead of returning a state (run::wait2 throws
  xrt::run::command_error on abnormal termination, include/xrt/xrt_kernel.h; a failing driver call under the wait
  throws xrt_core::system_error).  An error *state* is ``fail_state``: wait() returns it, it does not throw.
- ``device.written``: the kernel writes only that many score entries and no top-k, yet the run completes.
Each, and ``fail_state``, hits only runs (and syncs after) from ``device.faulty_from`` on: kernel calls are counted in
``device.runs``.

The device runs the kernel of the interface contract, ``ekv_score(keys, positions, query, n_tokens, n_kv_heads,
head_dim, top_k, scores_out, topk_out)``, with the reference math (edgekv.runtime.scoring.score_keys), reading keys
in 64-byte beats from a 64-byte-aligned address and writing exactly top_k entries padded with (-1, -inf).  The kernel
leaves its static bounds to the host; past them the fake truncates, one of the wrong answers a card could give.
"""
from __future__ import annotations

import enum
import mmap
import operator

import numpy as np

from edgekv.runtime.scoring import SCORE_ENTRY, score_keys

ARGS = ("keys", "positions", "query", "n_tokens", "n_kv_heads", "head_dim", "top_k", "scores_out", "topk_out")
GLOBAL_ARGS = (0, 1, 2, 7, 8)
MAX_HEAD_DIM, MAX_KV_HEADS, MAX_BLOCK, MAX_TOPK = 128, 8, 1024, 256


class ert_cmd_state(enum.IntEnum):
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_RUNNING = 3
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_ABORT = 6
    ERT_CMD_STATE_SUBMITTED = 7
    ERT_CMD_STATE_TIMEOUT = 8


class xclBOSyncDirection(enum.IntEnum):
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1


class device:
    """The card: records root BO allocations; ``fail_state`` makes every run end in that state; the faults above."""

    def __init__(self, index: int = 0):
        self.allocations: list[tuple[int, int, int]] = []  # (size, flags, group)
        self.fail_state: ert_cmd_state | None = None
        self.sync_error: Exception | None = None
        self.wait_error: Exception | None = None
        self.written: int | None = None
        self.faulty_from = 0
        self.runs = 0

    def faulty(self) -> bool:
        return self.runs >= self.faulty_from

    def load_xclbin(self, path: str) -> str:
        return "uuid-" + path


class bo:
    class flags(enum.IntEnum):
        normal = 0
        cacheable = 1
        device_only = 2
        host_only = 3
        p2p = 4
        svm = 5

    def __init__(self, owner, size: int, flags_or_offset, group: int | None = None):
        if isinstance(owner, bo):  # sub-buffer view
            offset = int(flags_or_offset)
            if offset > owner._size or size > owner._size - offset:
                raise RuntimeError("sub buffer size and offset")
            self.root, self.offset, self.flags_, self.group = owner.root, owner.offset + offset, owner.flags_, owner.group
            self.device = owner.device
        else:
            owner.allocations.append((size, int(flags_or_offset), group))
            self.device = owner
            self.root, self.offset, self.flags_, self.group = self, 0, bo.flags(flags_or_offset), group
            self._device_mem = mmap.mmap(-1, max(size, 1))  # page-aligned, as device memory behind a BAR is
            self._host = bytearray(size)
        self._size = size

    def size(self) -> int:
        return self._size

    def address(self) -> int:
        return 0x4000_0000 + (self.root.group or 0) * 0x1000_0000 + self.offset

    def device_bytes(self) -> memoryview:
        return memoryview(self.root._device_mem)[self.offset : self.offset + self._size]

    def _host_bytes(self) -> memoryview:
        if self.flags_ == bo.flags.p2p:
            return self.device_bytes()
        return memoryview(self.root._host)[self.offset : self.offset + self._size]

    def map(self) -> memoryview:
        return self._host_bytes()

    def write(self, buffer, seek: int) -> None:
        data = memoryview(buffer).cast("B")
        if seek + len(data) > self._size:
            raise RuntimeError("write past the end of the buffer object")
        self._host_bytes()[seek : seek + len(data)] = data

    def read(self, size: int, skip: int) -> np.ndarray:
        if skip + size > self._size:
            raise RuntimeError("read past the end of the buffer object")
        return np.frombuffer(self._host_bytes()[skip : skip + size], dtype=np.int8).copy()

    def sync(self, direction, size: int | None = None, offset: int = 0) -> None:
        size = self._size if size is None else size
        if offset + size > self._size:
            raise RuntimeError("sync past the end of the buffer object")
        if self.device.sync_error is not None and self.device.faulty():
            raise self.device.sync_error
        if self.flags_ == bo.flags.p2p:
            return
        host, dev = self._host_bytes(), self.device_bytes()
        if direction == xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE:
            dev[offset : offset + size] = host[offset : offset + size]
        else:
            host[offset : offset + size] = dev[offset : offset + size]


for _flag in bo.flags:  # py::enum_ ... .export_values()
    setattr(bo, _flag.name, _flag)


def _cast_bo(item) -> bo:
    if not isinstance(item, bo):
        raise TypeError("not a buffer object")
    return item


def _cast_int(item) -> int:
    """pybind11's type_caster<int> with conversion: never from a Python float; __index__, else __int__ (truncates)."""
    if isinstance(item, (bo, float)):
        raise TypeError("not an int")
    value = operator.index(item) if hasattr(type(item), "__index__") else int(item)
    if not -(2**31) <= value < 2**31:
        raise OverflowError("int out of range")
    return value


class run:
    def __init__(self, state: ert_cmd_state, error: Exception | None = None):
        self._state, self._error = state, error

    def wait(self, timeout_ms: int = 0) -> ert_cmd_state:
        if self._error is not None:
            raise self._error
        return self._state

    def state(self) -> ert_cmd_state:
        return self._state


class kernel:
    def __init__(self, dev: device, uuid: str, name: str):
        if name != "ekv_score":
            raise RuntimeError(f"no kernel {name} in the xclbin")
        self.device = dev

    def group_id(self, argno: int) -> int:
        if argno not in GLOBAL_ARGS:
            raise IndexError("group_id of a scalar argument")  # xrt_kernel.cpp: std::out_of_range
        return 10 + argno  # each port on its own bank, so a wrong group id shows

    def __call__(self, *args) -> run:
        values: list = [None if i in GLOBAL_ARGS else 0 for i in range(len(ARGS))]
        for i, item in enumerate(args):
            for cast in (_cast_bo, _cast_int):
                try:
                    value = cast(item)
                    if i >= len(ARGS) or isinstance(value, bo) != (i in GLOBAL_ARGS):
                        raise TypeError(f"argument {i} takes another kind")
                    values[i] = value
                except Exception:  # pyxrt.cpp: catch (const std::exception&) { }
                    pass
        dev = self.device
        faulty = dev.faulty()
        dev.runs += 1
        if faulty and dev.wait_error is not None:
            return run(ert_cmd_state.ERT_CMD_STATE_ERROR, dev.wait_error)
        if faulty and dev.fail_state is not None:
            return run(dev.fail_state)
        return run(self._execute(values, dev.written if faulty else None))

    def _execute(self, values: list, written: int | None = None) -> ert_cmd_state:
        if any(values[i] is None for i in GLOBAL_ARGS):
            return ert_cmd_state.ERT_CMD_STATE_ERROR  # an unset buffer is address 0
        for i in GLOBAL_ARGS:
            assert values[i].group == self.group_id(i), f"host bug: {ARGS[i]} is in bank {values[i].group}, " \
                f"the kernel's port in {self.group_id(i)}; XRT would hand the kernel a copy"
        keys_bo, pos_bo, q_bo, n, heads, dim, top_k, out_bo, top_bo = values
        key_bytes = n * heads * dim * 2
        assert keys_bo.address() % 64 == 0, "host bug: the keys do not start on a 64-byte beat of the 512-bit port"
        assert keys_bo.size() >= -(-key_bytes // 64) * 64, "host bug: the keys buffer ends inside the last 64-byte beat"
        assert pos_bo.size() >= 4 * n and q_bo.size() >= 4 * heads * dim and out_bo.size() >= SCORE_ENTRY.itemsize * n
        keys = np.frombuffer(keys_bo.device_bytes()[:key_bytes], np.float16).reshape(n, heads, dim)
        query = np.frombuffer(q_bo.device_bytes()[: 4 * heads * dim], np.float32).reshape(heads, dim)
        positions = np.frombuffer(pos_bo.device_bytes()[: 4 * n], np.int32)
        n, k = min(n, MAX_BLOCK), min(top_k, MAX_TOPK)  # past the static bounds: a wrong answer, here a truncated one
        keys, query = keys[:n, :MAX_KV_HEADS, :MAX_HEAD_DIM], query[:MAX_KV_HEADS, :MAX_HEAD_DIM]
        scores, block_topk = score_keys(keys, positions[:n], query, 1.0, max(n, 1), k)
        if written is not None:  # a kernel that stops early and still signals done
            out_bo.device_bytes()[: written * SCORE_ENTRY.itemsize] = scores[:written].tobytes()
            return ert_cmd_state.ERT_CMD_STATE_COMPLETED
        out_bo.device_bytes()[: scores.nbytes] = scores.tobytes()
        if k > 0:
            assert top_bo.size() >= block_topk.nbytes
            top_bo.device_bytes()[: block_topk.nbytes] = block_topk.tobytes()
        return ert_cmd_state.ERT_CMD_STATE_COMPLETED
