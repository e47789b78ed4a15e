"""Every native library the runtime loads, compiled and loaded in one place (``edgekv build-native``, or on first
use): the KV reader's io_uring and pthread backends, the records' CRC-32C, arkv's quantized attention kernel, the
low-rank predictor's group scorer, the disk policies' decode attention over their slots' records, full's over its
in-memory cache, the decode step's helper thread, the reuse buffer's slot assignment, the disk store's request
planning, the glue to ggml's dot products.

A library is one or more C units, each compiled on its own and linked into one shared object, built into the cache
under a name that carries the hash of its sources and headers (and the machine, for code built with -march=native), so
an edited source is rebuilt and a stale library is never loaded; a failed or interrupted build never leaves a file
that would be.  Callers declare the function signatures of what ``build`` gives.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_root

SOURCES = Path(__file__).with_name("native")
_BUILDING = threading.Lock()  # a library's first users may be several threads at once (the I/O threads' checksums)
_FAILED: dict[Path, "BuildError"] = {}  # library -> its failed build here: each engine would run the compiler again


def cause(exc: OSError) -> str:
    """A library's failure in a line: a build's cause (what failed and the compiler's first error), else the error."""
    return exc.cause if isinstance(exc, BuildError) else str(exc)


class BuildError(OSError):
    """A native library that did not compile: the command and the compiler's output in full, and ``cause`` (what
    failed and the compiler's first error) for a one-line warning."""

    def __init__(self, what: str, command: list[str], stderr: str):
        super().__init__(f"building {what} failed ({' '.join(command)}):\n{stderr}")
        self.what, self.command, self.stderr = what, command, stderr

    @property
    def cause(self) -> str:
        errors = [line.strip() for line in self.stderr.splitlines() if "error" in line]
        return f"building {self.what} failed" + (f": {errors[0]}" if errors else "")


@dataclass(frozen=True)
class NativeLibrary:
    stem: str  # the cached file's name before its hash: libekv_<stem>-<digest>.so
    source: str  # its first unit, a file in runtime/native/
    flags: tuple[str, ...]
    libs: tuple[str, ...]
    what: str  # named when the build fails
    per_machine: bool = False  # -march=native code: the machine is part of its name
    machine_flags: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (platform.machine(), flags) added there
    headers: tuple[str, ...] = ()  # files in runtime/native/ its units include: part of its hash
    units: tuple[str, ...] = ()  # its other units, compiled apart and linked with the first

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source, *self.units)

    def sources_bytes(self) -> bytes:
        return b"".join((SOURCES / name).read_bytes() for name in (*self.sources, *self.headers))

    def flags_here(self) -> tuple[str, ...]:
        return self.flags + dict(self.machine_flags).get(platform.machine(), ())


LIBRARIES = {
    "io_uring": NativeLibrary("reader-io_uring", "ekv_reader.c", ("-O2", "-DEKV_URING"), ("-luring",),
                              "the io_uring reader"),
    "pthread": NativeLibrary("reader-pthread", "ekv_reader.c", ("-O2",), ("-lpthread",), "the pthread reader"),
    "qattn": NativeLibrary("qattn", "ekv_qattn.c", ("-O3", "-march=native", "-fopenmp", "-fassociative-math",
                                                    "-fno-signed-zeros", "-fno-trapping-math"), ("-lm",),
                           "the quantized attention kernel", per_machine=True, headers=("ekv_float.h",)),
    # never -ffast-math in a library: its startup code would flush subnormals to zero in the whole process
    "score": NativeLibrary("score", "ekv_score.c", ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
                                                    "-fno-trapping-math", "-fno-math-errno"), ("-lm",),
                           "the K_lr group scorer", per_machine=True, headers=("ekv_float.h",)),
    "attend": NativeLibrary("attend", "ekv_attend.c", ("-O3", "-march=native", "-fassociative-math",
                                                      "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno"),
                            ("-lm",), "the records' decode attention", per_machine=True, headers=("ekv_float.h",)),
    "dense": NativeLibrary("dense", "ekv_dense.c", ("-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros",
                                                    "-fno-trapping-math", "-fno-math-errno"), ("-lm",),
                           "the in-memory cache's decode attention", per_machine=True, headers=("ekv_float.h",)),
    # no contraction into FMAs (aarch64's default): its RoPE rounds each product as torch's separate calls do
    "ggml": NativeLibrary("ggml", "ekv_ggml.c", ("-O2", "-ffp-contract=off"), ("-lm",),
                          "the glue to ggml's dot products (weights 'ggml')"),
    "aside": NativeLibrary("aside", "ekv_aside.c", ("-O2", "-pthread"), ("-lpthread",),
                           "the decode step's helper thread"),
    "slots": NativeLibrary("slots", "ekv_slots.c", ("-O2",), (), "the reuse buffer's slot assignment",
                           headers=("ekv_slots.h",)),
    "requests": NativeLibrary("requests", "ekv_requests.c", ("-O2",), (), "the disk store's request planning",
                              headers=("ekv_requests.h",)),
    "fetch": NativeLibrary("fetch", "ekv_fetch.c", ("-O2",), (), "a layer's picks to their reads in one call",
                           headers=("ekv_fetch.h", "ekv_slots.h", "ekv_requests.h"),
                           units=("ekv_slots.c", "ekv_requests.c")),
    # aarch64: the ARMv8 CRC32C instruction (every ARMv8.1+ core, Orin's A78AE included), not the table
    "crc32c": NativeLibrary("crc32c", "ekv_crc32c.c", ("-O2",), (), "the CRC-32C library",
                            machine_flags=(("aarch64", ("-march=armv8-a+crc",)),)),
}


def cache_dir() -> Path:
    return cache_root() / "native"


def library_path(name: str) -> Path:
    """Where ``name`` is (or will be) cached."""
    lib = LIBRARIES[name]
    digest = hashlib.sha256(lib.sources_bytes() + " ".join(lib.flags_here()).encode()).hexdigest()[:12]
    machine = f"-{platform.machine()}" if lib.per_machine else ""
    return cache_dir() / f"libekv_{lib.stem}{machine}-{digest}.so"


def build(name: str) -> Path:
    """The library's path, compiled first when the cache lacks it (OSError naming it when that fails)."""
    target = library_path(name)
    if target.exists():
        return target
    lib = LIBRARIES[name]
    with _BUILDING:  # one build; the threads that waited find its library
        if target.exists():
            return target
        if target in _FAILED:
            failed = _FAILED[target]
            raise BuildError(failed.what, failed.command, failed.stderr)
        try:
            return compile_units(lib, target)
        except BuildError as exc:
            _FAILED[target] = exc
            raise


def compile_units(lib: NativeLibrary, target: Path, flags: tuple[str, ...] | None = None) -> Path:
    """``lib``'s units compiled one by one with ``flags`` (default: its own here) and linked into ``target``."""
    flags = lib.flags_here() if flags is None else tuple(flags)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as objects:
        units = [str(Path(objects) / f"{Path(source).stem}.o") for source in lib.sources]
        for source, unit in zip(lib.sources, units):
            _run(["cc", *flags, "-fPIC", "-Wall", "-c", str(SOURCES / source), "-o", unit], lib.what)
        return compile_library(lambda out: ["cc", *flags, "-shared", *units, "-o", out, *lib.libs], target, lib.what)


def load(name: str) -> ctypes.CDLL:
    """Library ``name``, its functions undeclared (runtime/kernels.py load_library declares a kernel's)."""
    return ctypes.CDLL(str(build(name)))


P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int  # the C types the libraries' signatures name


def address(array) -> int:
    """A numpy array's data address, as ``array.ctypes.data`` gives it in about three times the time (numpy builds a
    helper object a call, 1.7 against 0.5 us here): a disk policy's decode step hands the native calls some 1,600
    arrays.  An array ctypes cannot view (read-only, empty, not C-contiguous) takes numpy's way."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError, BufferError):
        return array.ctypes.data


def compile_library(command, target: Path, what: str) -> Path:
    """Run ``command(output_path)`` into a temporary file and move it to ``target``: a failed or
    interrupted build never leaves a library that would be loaded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # no two builders share a file
    try:
        _run(command(str(tmp)), what)
    except BuildError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(target)
    return target


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(what, command, result.stderr.strip())


def build_all() -> dict[str, str]:
    """Build every native library this machine can; returns name -> library path or why it is unavailable."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = str(build(name))
        except OSError as exc:
            out[name] = f"unavailable: {exc}"
    return out
