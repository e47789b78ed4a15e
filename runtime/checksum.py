"""Checksums of KV records: a flipped bit or a torn write on disk is caught before attention sees it.

Every record's checksum is CRC-32C of its (layer, group) as 8 bytes, then its payload (``record_bytes``, the
padding left out): a record read from another layer's or group's offset fails as surely as a damaged one,
and CRC-32C catches every single-bit error and every burst up to 32 bits.  A batch is checked in one call
to a small C library (runtime/native/ekv_crc32c.c: the CPU's crc32c instruction, no GIL), so it runs
beside the model's compute; without a C compiler the ``crc32c`` package computes the same values (the choice made
once a process, whatever a policy's backend: checksums are the host's on every device).
Live KV files keep their checksums in memory (the side table of ``DiskKVStore``, 4 bytes per group and
layer); a context-store blob carries them in a trailer after its records (``Trailer``): format version,
model fingerprint, layers, groups, record length, first group, the checksums, and the trailer's own CRC.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Callable

import crc32c as crc32c_package
import numpy as np

from . import native_build
from .kernels import load_library
from .native_build import address

log = logging.getLogger(__name__)

VERSION = 1
CHECKSUM_BYTES = 4  # one uint32 per (layer, group)
MAGIC = b"EKVSUMS\0"
_HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("n_layers", "<u4"), ("n_groups", "<u4"),
                    ("record_bytes", "<u4"), ("first_group", "<u8"), ("fingerprint", "S32")])


def sums_at(addresses, record_bytes: int, layers, groups) -> np.ndarray:
    """uint32 [n] checksums of the records at host ``addresses`` (where a read put them); a record's seed is
    layer << 40 | group.  By the C library, or where it does not build the crc32c package (``record_sums_by``,
    chosen once a process: the same values, on every device and for the context store's blobs too)."""
    return record_sums_by()(np.ascontiguousarray(addresses, dtype=np.int64), record_bytes, layers, groups)


@functools.cache
def record_sums_by() -> Callable[[np.ndarray, int, object, object], np.ndarray]:
    """``sums_at``'s implementation: the C library's (runtime/native/ekv_crc32c.c), or ``package_sums`` (logged
    once) where it cannot be built."""
    try:
        lib = load_library("crc32c")
    except OSError as exc:
        log.warning("the CRC-32C library unavailable, checking KV records with the crc32c package (slower): %s",
                    native_build.cause(exc))
        return package_sums

    def native_sums(addresses: np.ndarray, record_bytes: int, layers, groups) -> np.ndarray:
        out, seeds = np.empty(len(addresses), dtype=np.uint32), _seeds(addresses, layers, groups)
        lib.ekv_record_sums(len(addresses), address(addresses), record_bytes, address(seeds), address(out))
        return out

    return native_sums


def package_sums(addresses: np.ndarray, record_bytes: int, layers, groups) -> np.ndarray:
    """``sums_at`` by the crc32c package (int64 addresses): the reference the C library is tested against."""
    out = np.empty(len(addresses), dtype=np.uint32)
    for i, (a, seed) in enumerate(zip(addresses.tolist(), _seeds(addresses, layers, groups).tolist())):
        head = crc32c_package.crc32c(int(seed).to_bytes(8, "little"))
        out[i] = crc32c_package.crc32c((ctypes.c_char * record_bytes).from_address(a), head)
    return out


def _seeds(addresses: np.ndarray, layers, groups) -> np.ndarray:
    """uint64 [n]: each record's layer << 40 | group."""
    layers = np.broadcast_to(np.asarray(layers, dtype=np.uint64), addresses.shape)
    return np.ascontiguousarray((layers << np.uint64(40)) | np.asarray(groups, dtype=np.uint64))


def record_sums(records: np.ndarray, record_bytes: int, layers, groups) -> np.ndarray:
    """uint32 [n] checksums of records [n, stride] holding ``groups`` of ``layers`` (one layer, or each record's)."""
    records = np.ascontiguousarray(records)
    return sums_at(address(records) + np.arange(len(records), dtype=np.int64) * records.shape[1], record_bytes,
                   layers, groups)


def crc32c(data: bytes) -> int:
    return crc32c_package.crc32c(data)


class TrailerError(ValueError):
    """A blob's trailer is damaged or belongs to another model or layout."""


@dataclass(frozen=True)
class Trailer:
    """What a stored blob says about its records; ``sums`` [n_layers, n_groups]."""

    fingerprint: str  # the model fingerprint id (sha256 hex)
    record_bytes: int
    first_group: int
    sums: np.ndarray

    @staticmethod
    def nbytes(n_layers: int, n_groups: int, align_bytes: int) -> int:
        raw = _HEADER.itemsize + n_layers * n_groups * CHECKSUM_BYTES + CHECKSUM_BYTES
        return -(-raw // align_bytes) * align_bytes

    def pack(self, align_bytes: int) -> bytes:
        n_layers, n_groups = self.sums.shape
        header = np.zeros(1, dtype=_HEADER)
        header[0] = (MAGIC, VERSION, n_layers, n_groups, self.record_bytes, self.first_group, bytes.fromhex(self.fingerprint))
        body = header.tobytes() + self.sums.astype("<u4").tobytes()
        body += np.uint32(crc32c(body)).astype("<u4").tobytes()
        return body.ljust(self.nbytes(n_layers, n_groups, align_bytes), b"\0")

    @classmethod
    def parse(cls, data, n_layers: int, n_groups: int) -> "Trailer":
        """The trailer of a blob of ``n_layers`` x ``n_groups`` records in ``data``, its own checksum verified,
        saying which model, record length and first group it holds; TrailerError when it is damaged."""
        data = bytes(data)
        end = _HEADER.itemsize + n_layers * n_groups * CHECKSUM_BYTES
        if len(data) < end + CHECKSUM_BYTES:
            raise TrailerError(f"the trailer is {len(data)} bytes, {n_layers} layers x {n_groups} groups need "
                               f"{end + CHECKSUM_BYTES}")
        header = np.frombuffer(data, dtype=_HEADER, count=1)[0]
        if header["magic"] != MAGIC.rstrip(b"\0") or header["version"] != VERSION:
            raise TrailerError(f"no checksum trailer of version {VERSION} (found magic {header['magic']!r}, "
                               f"version {int(header['version'])})")
        if int(header["n_layers"]) != n_layers or int(header["n_groups"]) != n_groups:
            raise TrailerError(f"trailer holds {int(header['n_layers'])} layers x {int(header['n_groups'])} groups, "
                               f"the chunk has {n_layers} x {n_groups}")
        own = int(np.frombuffer(data[end : end + CHECKSUM_BYTES], dtype="<u4")[0])
        if own != crc32c(data[:end]):
            raise TrailerError("the trailer's own checksum does not match (damaged)")
        sums = np.frombuffer(data[_HEADER.itemsize : end], dtype="<u4").reshape(n_layers, n_groups).astype(np.uint32)
        return cls(header["fingerprint"].ljust(32, b"\0").hex(), int(header["record_bytes"]),
                   int(header["first_group"]), sums)

    @classmethod
    def unpack(cls, data, n_layers: int, n_groups: int, record_bytes: int, first_group: int, fingerprint: str) -> "Trailer":
        """The trailer in ``data``, checked against what the reader expects; TrailerError says what differs."""
        trailer = cls.parse(data, n_layers, n_groups)
        found = {"record_bytes": (trailer.record_bytes, record_bytes), "first_group": (trailer.first_group, first_group),
                 "fingerprint": (trailer.fingerprint, fingerprint)}
        wrong = [f"{k} {a} (expected {b})" for k, (a, b) in found.items() if a != b]
        if wrong:
            raise TrailerError("trailer names another record: " + ", ".join(wrong))
        return trailer
