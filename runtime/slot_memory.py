"""Where the reuse slots' records live and how read bytes reach them: the code that moves bytes, apart from the
slot table's bookkeeping (which slot holds what, what must be read: runtime/slots.py).

``HostSlots`` (CPU): the slots are aligned host memory; the reader's O_DIRECT reads land in them and attention
gathers from them.  ``DeviceSlots`` (CUDA): the slots live in device memory, so a hit never crosses the bus; the
reader fills pinned, aligned staging rows (double-buffered by layer parity), and only the misses are copied to
their device slots on a copy stream.  Compute waits for a layer's copy on an event, never on the host, and the
copy for a buffer waits for the attention that last read it.  ``MappedSlots`` (CUDA, ``slot_memory: mapped``): the
slots are pinned host memory the GPU reads in place, so nothing is copied: on a unified-memory device (a Jetson) CPU
and GPU share one DRAM and a device copy would only duplicate the bytes.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .disk_store import RecordLayout, aligned_zeros
from .native_build import address
from .slots import Misses

SLOT_MEMORIES = ("device", "mapped")  # where a GPU's slots live (config field slot_memory)
LAYERS_IN_FLIGHT = 2  # layers whose reads may run at once (the engine prefetches one layer ahead): staging sets


class HostSlots:
    """The reuse slots in host memory: reads land where attention reads."""

    bytes_copied = 0  # host -> device (the batch's): nothing crosses a bus here

    def __init__(self, n_buffers: int, batch: int, capacity: int, layout: RecordLayout, device: torch.device):
        self.layout, self.device = layout, device
        self._bytes = aligned_zeros((n_buffers, batch * capacity, layout.stride_bytes), layout.align_bytes)
        self._records = torch.from_numpy(self._bytes)[..., : layout.record_bytes]

    @property
    def nbytes(self) -> int:
        return self._bytes.nbytes

    def read_addresses(self, layer: int, buffer: int, misses: Misses) -> np.ndarray:
        """Where the reader puts each missed record (in order)."""
        return self.slot_base(buffer) + misses.slot * self.layout.stride_bytes

    def slot_base(self, buffer: int) -> int:
        """The address of ``buffer``'s slot 0: a record's lands at slot x the layout's stride past it."""
        return address(self._bytes[buffer])

    def before_read(self, layer: int, buffer: int) -> None:
        """On an I/O thread, before the layer's reads into ``buffer``: the memory they land in is free (on the CPU
        it always is: a gather has copied its records out before it returns)."""

    def after_read(self, layer: int, buffer: int, misses: Misses) -> None:
        """The reads of ``misses`` landed (called on an I/O thread): nothing to move, they are in their slots."""

    def gather(self, layer: int, buffer: int, slots: torch.Tensor) -> torch.Tensor:
        """Records [*slots.shape, record_bytes] of flat ``slots``, on the compute device."""
        rows = self._records[buffer].index_select(0, slots.flatten())
        return rows.unflatten(0, slots.shape).to(self.device)

    def buffer_records(self, buffer: int) -> np.ndarray:
        """Every slot of ``buffer``, uint8 [slots, stride] (no copy): what attention reads in place."""
        return self._bytes[buffer]

    def records(self, buffer: int, slots: np.ndarray) -> np.ndarray:
        """Whole records [n, stride] (host numpy) of flat ``slots``: what re-clustering writes elsewhere."""
        return self._bytes[buffer][slots]


class DeviceSlots:
    """The reuse slots in device memory, filled from pinned staging rows by a copy stream."""

    def __init__(self, n_buffers: int, batch: int, capacity: int, layout: RecordLayout, device: torch.device,
                 max_misses: int):
        self.layout, self.device = layout, device
        stride = layout.stride_bytes
        self._slots = torch.zeros(n_buffers, batch * capacity, stride, dtype=torch.uint8, device=device)
        # pinned staging, one set per layer parity: layer l+1 reads while layer l's read or copy may still run
        self._staging = [pinned_aligned((max(1, max_misses), stride), layout.align_bytes)
                         for _ in range(LAYERS_IN_FLIGHT)]
        self._copy_stream = torch.cuda.Stream(device=device)
        self._copied = {}  # buffer -> event: its last copy is done
        self._staged = [torch.cuda.Event() for _ in range(LAYERS_IN_FLIGHT)]  # staging set -> its last copy has read it
        self._read_done = {}  # buffer -> event: the attention that last read it is done
        self._lock = threading.Lock()
        self.bytes_copied = 0  # host -> device, records only (hits never cross)

    @property
    def nbytes(self) -> int:
        return self._slots.numel()

    def read_addresses(self, layer: int, buffer: int, misses: Misses) -> np.ndarray:
        """Contiguous staging rows of this layer's parity for the misses."""
        if len(misses.slot) > self._staging[0].shape[0]:
            raise ValueError(f"{len(misses.slot)} misses in one layer but staging holds {self._staging[0].shape[0]}")
        rows = np.arange(len(misses.slot)) * self.layout.stride_bytes
        return self._staging[layer % LAYERS_IN_FLIGHT].data_ptr() + rows

    def before_read(self, layer: int, buffer: int) -> None:
        """On an I/O thread: the staging set of this parity is free once the copy two layers back has read it (that
        layer's reads were waited for before this one was picked, so its copy is already queued)."""
        self._staged[layer % LAYERS_IN_FLIGHT].synchronize()

    @torch.inference_mode()  # the slots are inference tensors (made under the engine's inference mode), and
    # inference mode is per thread: without it here an I/O thread may not write them
    def after_read(self, layer: int, buffer: int, misses: Misses) -> None:
        """On an I/O thread, once the reads landed: the misses' rows go to their device slots on the copy stream,
        after the attention that last read this buffer; an event says when they are there."""
        n = len(misses.slot)
        with self._lock:
            done = self._read_done.get(buffer)
        with torch.cuda.stream(self._copy_stream):
            if done is not None:
                self._copy_stream.wait_event(done)
            if n:
                rows = self._staging[layer % LAYERS_IN_FLIGHT][:n].to(self.device, non_blocking=True)
                index = torch.from_numpy(misses.slot).pin_memory().to(self.device, non_blocking=True)
                self._slots[buffer].index_copy_(0, index, rows)
            self._staged[layer % LAYERS_IN_FLIGHT].record(self._copy_stream)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        with self._lock:  # two I/O threads copy at once
            self._copied[buffer] = copied
            self.bytes_copied += n * self.layout.stride_bytes

    def gather(self, layer: int, buffer: int, slots: torch.Tensor) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        with self._lock:
            copied = self._copied.get(buffer)
        if copied is not None:
            compute.wait_event(copied)
        rows = self._slots[buffer].index_select(0, _on_device(slots, self.device))[:, : self.layout.record_bytes]
        _mark_read(self._read_done, self._lock, buffer, compute)
        return rows.unflatten(0, slots.shape)

    def records(self, buffer: int, slots: np.ndarray) -> np.ndarray:
        return self._slots[buffer][torch.from_numpy(slots).to(self.device)].cpu().numpy()


class MappedSlots(HostSlots):
    """The reuse slots in pinned host memory the GPU reads in place (zero-copy): reads land where attention reads,
    as on the CPU, and a gather reads them over the bus (from the shared DRAM on a Jetson).  The host waited for a
    layer's reads before its attention gathers them; an I/O thread waits for the gather that last read a buffer
    before its reads overwrite it."""

    def __init__(self, n_buffers: int, batch: int, capacity: int, layout: RecordLayout, device: torch.device):
        self.layout, self.device = layout, device
        host = pinned_aligned((n_buffers * batch * capacity, layout.stride_bytes), layout.align_bytes)
        self._bytes = host.numpy().reshape(n_buffers, batch * capacity, layout.stride_bytes)
        self._records = device_alias(host, device).view(self._bytes.shape)[..., : layout.record_bytes]
        self._read_done: dict[int, torch.cuda.Event] = {}  # buffer -> the gather that last read it is done
        self._lock = threading.Lock()

    def before_read(self, layer: int, buffer: int) -> None:
        with self._lock:
            done = self._read_done.get(buffer)
        if done is not None:
            done.synchronize()

    def gather(self, layer: int, buffer: int, slots: torch.Tensor) -> torch.Tensor:
        rows = self._records[buffer].index_select(0, _on_device(slots, self.device))
        _mark_read(self._read_done, self._lock, buffer, torch.cuda.current_stream(self.device))
        return rows.unflatten(0, slots.shape)


def _on_device(slots: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Flat slot indices on the device, copied from pinned memory without a host sync."""
    return slots.flatten().pin_memory().to(device, non_blocking=True)


def _mark_read(read_done: dict, lock: threading.Lock, buffer: int, stream) -> None:
    """Record when ``stream``'s gather from ``buffer`` is done: the next write into that buffer waits for it."""
    done = torch.cuda.Event()
    done.record(stream)
    with lock:
        read_done[buffer] = done


class _DeviceView:
    """``__cuda_array_interface__`` (version 3) of a pinned host buffer, holding it alive."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "|u1", "strides": None,
                                         "data": (host.data_ptr(), False), "version": 3}


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned uint8 host memory, no copy.  Under unified virtual addressing (every 64-bit CUDA
    platform) a pointer from cudaHostAlloc, torch's pinned allocator, is valid on the device as it is (CUDA C++
    Programming Guide, "Unified Virtual Address Space"); torch wraps it with ``from_blob`` and finds its device with
    cudaPointerGetAttributes (torch/csrc/utils/tensor_numpy.cpp, tensor_from_cuda_array_interface)."""
    if not host.is_pinned():
        raise ValueError("device_alias needs pinned host memory (a pageable pointer is not valid on the device)")
    return torch.as_tensor(_DeviceView(host), device=device)


def pinned_aligned(shape: tuple[int, int], align: int) -> torch.Tensor:
    """Pinned uint8 host memory of ``shape`` starting on an ``align`` boundary (O_DIRECT reads land in it): the
    pinned allocator's blocks are not page-aligned, so the rows start inside a block ``align`` bytes larger."""
    nbytes = shape[0] * shape[1]
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=True)
    start = (-raw.data_ptr()) % align
    return raw[start : start + nbytes].view(shape)


def slot_memory(n_buffers: int, batch: int, capacity: int, layout: RecordLayout, device: torch.device,
                max_misses: int, placement: str = "device"):
    """On a GPU, device slots fed by copies (``placement`` device) or pinned host slots it reads in place
    (mapped); host slots on the CPU, where the two are one."""
    if device.type != "cuda":
        return HostSlots(n_buffers, batch, capacity, layout, device)
    if placement == "mapped":
        return MappedSlots(n_buffers, batch, capacity, layout, device)
    return DeviceSlots(n_buffers, batch, capacity, layout, device, max_misses)
