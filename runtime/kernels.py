"""The backend a policy's hot operations run on, resolved once when the policy is built.

- ``native``: a CPU's C kernels (runtime/native/, built by runtime/native_build.py): the K_lr scorer, the decode
  attentions over an in-memory cache and over a disk policy's records, arkv's quantized attention, the decode step's
  helper thread, the reuse buffer's slot assignment, the disk store's request planning and the two in one call a
  layer (runtime/fetch_plan.py), all loaded and declared
  here together.
- ``torch``: the reference, torch and numpy, that the native and CUDA kernels are tested against; a CPU takes it when
  a library does not build (logged once, with what failed) or when it is asked for by name.
- ``cuda``: torch's kernels on the GPU; its host side (slots, request planning) runs the native host libraries.

Each operation's owner takes its implementation from the backend when it is built, deciding there what the shapes it
is built for allow: a call runs that implementation without asking whether a kernel serves it.  An engine resolves its
backend once (``Engine(backend="torch")`` asks for the reference) and each policy it builds gets it (``PolicyEnv``).
``load_library`` also declares the libraries no backend holds: the records' CRC-32C (runtime/checksum.py chooses it
once a process, on every device) and the glue of the ``ggml`` weight format (the model's, runtime/ggml_weights.py).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from . import native_build

log = logging.getLogger(__name__)

BACKENDS = ("native", "torch", "cuda")
# the libraries each backend loads (a GPU's host side plans reads and slots on the CPU)
CPU_KERNELS = ("score", "dense", "attend", "qattn", "aside", "slots", "requests", "fetch")
HOST_KERNELS = ("slots", "requests", "fetch")


@dataclass(frozen=True)
class Backend:
    """Where a policy's operations run: ``name`` (one of BACKENDS) on ``device``, with the native ``libraries`` it
    loaded (name -> declared library), and ``reason``: why the device's own backend does not serve (a library that did
    not build, or the reference asked for), None where it does."""

    name: str
    device: torch.device
    libraries: Mapping[str, ctypes.CDLL] = field(default_factory=dict)
    reason: str | None = None

    def lib(self, name: str) -> ctypes.CDLL | None:
        """The loaded library ``name`` (a CPU_KERNELS name), or None where this backend computes without it."""
        return self.libraries.get(name)


def resolve_backend(device: str | torch.device, name: str | None = None) -> Backend:
    """``load_backend``'s backend, resolved once a process per (device, name): a library that does not build is
    compiled and logged once."""
    return _resolved(torch.device(device), name)


def load_backend(device: str | torch.device, name: str | None = None) -> Backend:
    """The backend for ``device``: by default ``cuda`` on a GPU, ``native`` on a CPU where its libraries build (else
    ``torch``, the build's failure logged); ``name`` forces one (``torch``: the reference; ``native`` asked for and
    not built is an OSError)."""
    device = torch.device(device)
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend {name!r}: one of {', '.join(BACKENDS)}")
    on_gpu = device.type == "cuda"
    if name in ("native", "cuda") and (name == "cuda") != on_gpu:
        raise ValueError(f"backend {name!r} runs on {'a GPU' if name == 'cuda' else 'the CPU'}, not on {device}")
    if name == "torch":
        return Backend("torch", device, reason="the torch reference was asked for")
    chosen = name or ("cuda" if on_gpu else "native")
    try:
        libraries = {lib: load_library(lib) for lib in (CPU_KERNELS if chosen == "native" else HOST_KERNELS)}
    except OSError as exc:
        if name == "native":
            raise
        cause = native_build.cause(exc)
        log.warning("%s: %s", cause, "every operation runs the torch reference" if chosen == "native" else
                    "slots and reads planned by numpy")
        return Backend("torch" if chosen == "native" else chosen, device, reason=cause)
    return Backend(chosen, device, MappingProxyType(libraries))


_resolved = functools.cache(load_backend)


def load_library(name: str, path: Path | None = None) -> ctypes.CDLL:
    """Library ``name`` (runtime/native_build.py's, built where the cache lacks it; or the one at ``path``, a variant
    built otherwise) with its functions declared and its constants read; OSError where it cannot be built or loaded."""
    lib = ctypes.CDLL(str(path or native_build.build(name)))
    _DECLARE[name](lib)
    return lib


def unit_function(lib: ctypes.CDLL, name: str) -> int:
    """The address of a kernel's unit function ``name`` (void fn(void *ctx, int64_t unit, int worker))."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


P, I64, I32, F32 = native_build.P, native_build.I64, native_build.I32, ctypes.c_float


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, type | None]]) -> None:
    for function, (argtypes, restype) in signatures.items():
        getattr(lib, function).argtypes, getattr(lib, function).restype = argtypes, restype


def _unit_kernel(prefix: str, signatures: dict, maxima: tuple[str, ...] = ()):
    """A library whose calls are jobs of units: ``signatures`` declared, ``<prefix>_job_bytes()`` as ``lib.job_bytes``,
    ``<prefix>_unit`` as ``lib.unit``, and each of ``maxima`` (``m``: ``<prefix>_max_<m>()``) as ``lib.max_<m>``."""
    def declare(lib: ctypes.CDLL) -> None:
        _declare(lib, {**signatures, **{f"{prefix}_{what}": ([], I32)
                                        for what in ("job_bytes", *(f"max_{m}" for m in maxima))}})
        for m in maxima:
            setattr(lib, f"max_{m}", getattr(lib, f"{prefix}_max_{m}")())
        lib.job_bytes, lib.unit = getattr(lib, f"{prefix}_job_bytes")(), unit_function(lib, f"{prefix}_unit")
    return declare


def _score(lib: ctypes.CDLL) -> None:
    scores = [P, I64, I64, P, I64, P, I32, I32, I32, I32, I32, I32, I32, P, P, I64, P, I64]
    top = [P, I64, I32, P, I32, I32, I32, P]
    _declare(lib, {
        "ekv_group_scores": (scores, I32), "ekv_score_job": ([P, *scores], I64), "ekv_score_max_rank": ([], I32),
        "ekv_score_max_queries": ([], I32), "ekv_score_job_bytes": ([], I32),
        "ekv_score_scratch_floats": ([I32, I32, I32, I32], I64), "ekv_top": (top, I32),
        "ekv_top_job": ([P, *top], I64), "ekv_top_job_bytes": ([], I32),
        "ekv_low_rank_queries": ([P, I32, I32, I32, I32, P, I64, I32, F32, I32, P], I32),
        "ekv_launch_bytes": ([], I32), "ekv_score_block_tokens": ([], I32),
        "ekv_score_launch": ([P, P, P, P, I32, I32, I32, I32, P, I64, I32, F32, P, P, I64, I64, P, I64, I32, I32, I32,
                              I32, P, I64, P, I64, P, I32, I32, I32, P], I64)})
    lib.job_bytes, lib.top_job_bytes, lib.launch_bytes = (lib.ekv_score_job_bytes(), lib.ekv_top_job_bytes(),
                                                          lib.ekv_launch_bytes())
    lib.top_unit = unit_function(lib, "ekv_top_unit")  # a posted select's last phase: the top-M, one unit a sequence
    lib.phases = {False: (unit_function(lib, "ekv_score_unit"),),  # "sum": the logits' group maxima
                  True: (unit_function(lib, "ekv_score_unit"), unit_function(lib, "ekv_score_vote_unit"))}  # softmax
    # the rank it widens on its stack and the queries a softmax select scores at most; the tokens of a stored block
    lib.max_rank, lib.max_queries = lib.ekv_score_max_rank(), lib.ekv_score_max_queries()
    lib.block_tokens = lib.ekv_score_block_tokens()


def _qattn(lib: ctypes.CDLL) -> None:
    common = [P, I32, I32, I32, I32, P, I64, I32, I32, P]
    _declare(lib, {"ekv_qscores": ([*common, F32, P, I32], None), "ekv_qvalues": ([*common, P, I32], I32)})


def _crc32c(lib: ctypes.CDLL) -> None:
    _declare(lib, {"ekv_crc32c": ([ctypes.c_uint32, P, ctypes.c_size_t], ctypes.c_uint32),
                   "ekv_record_sums": ([I64, P, I64, P, P], None), "ekv_crc32c_impl": ([], ctypes.c_char_p)})


_ATTEND = [P, I32, I32, I32, I32, F32, P, I64, I64, P, P, I32, I32, I32, P, I32, P, I32, P, I64, I32, P, I64, P]
_DECLARE = {
    "score": _score,
    "dense": _unit_kernel("ekv_dense", {
        "ekv_dense_job": ([P, P, I32, I32, I32, I32, F32, P, P, I64, I64, I32, P, P, P, I64], I64),
        "ekv_dense_run": ([P, P], None), "ekv_dense_merge": ([P, P], None), "ekv_dense_parts": ([I64], I32)},
        maxima=("head_dim", "group_queries")),
    "attend": _unit_kernel("ekv_attend", {
        "ekv_attend": (_ATTEND, I32), "ekv_attend_job": ([P, *_ATTEND], I64),
        "ekv_attend_scratch_bytes": ([I32, I32, I64, I32], I64), "ekv_put_rows": ([P, I64, P, I64, P, P, I64], None)},
        maxima=("head_dim", "group_queries")),
    "qattn": _qattn,
    "aside": lambda lib: _declare(lib, {
        "ekv_aside_open": ([], P), "ekv_aside_post": ([P, P, P, I64], I64), "ekv_aside_done": ([P, I64], I32),
        "ekv_aside_wait": ([P, I64], None), "ekv_aside_share": ([P, P, P, I64], None), "ekv_aside_close": ([P], None),
        "ekv_aside_spin": ([P, I64], None), "ekv_aside_post_chain": ([P, P, P, P, I32], I64)}),
    "slots": lambda lib: _declare(lib, {"ekv_slots_assign": (
        [I32, I32, I32, P, P, P, I32, I64, P, P, P, P, P, P, I32, P, P, P, P, P, P, P, P, P], I64)}),
    "requests": lambda lib: _declare(lib, {
        "ekv_requests_scratch_bytes": ([I64], I64),
        "ekv_requests_plan": ([I64, P, P, P, I64, P, I64, I64, I32, I64, I64, I64, I32, P, P, I32, I64, P, P, P, P, P,
                               P, P, P, P, P, P, I64, P], I64)}),
    "fetch": lambda lib: _declare(lib, {
        "ekv_fetch_job_bytes": ([], I64), "ekv_fetch_job_fields": ([], I32), "ekv_fetch_job_offsets": ([P], None),
        "ekv_fetch_run": ([P, P, P, P, I64, I64, P], I64), "ekv_requests_scratch_bytes": ([I64], I64)}),
    "crc32c": _crc32c,
    "ggml": _unit_kernel("ekv_ggml", {
        "ekv_ggml_layer": ([P, P, P, P, I64, I64, I32, I64], I32),
        "ekv_ggml_call": ([P, P, I64, P, P, I32, P, F32], I64),
        "ekv_ggml_block_end": ([P, P, P, P, I64, P, F32, P, P, P, P, P, I32], None),
        "ekv_ggml_heads": ([P, P, P, I64, P, F32, P, P, P, P, I32, I32, I32, P, P, P, P, P], None)}),
}
