"""The ``ggml`` weight format: linear layers in GGUF block types, computed by ggml's CPU kernels (llama.cpp's tensor
library, built by ``make ggml`` from llama-cpp-python's source, or the one that package ships), so a layer reads
llama.cpp's bytes through llama.cpp's dot products.

Each weight is held in the smallest block type that gives it back (``BLOCK_TYPES``, ggml's own quantizer run on it
and checked): a GGUF's Q4_1 tensor is its Q4_1 blocks again, a Q8_0 embedding its Q8_0 blocks; a weight on no such
grid (fp32 checkpoints, Gemma 3's Q6_K tensors) is Q8_0, a scale per 32 inputs.  A token's activations are quantized
to the type's partner (Q8_1 or Q8_0) as llama.cpp quantizes them, and each output row is one ``vec_dot`` of the
library; runtime/native/ekv_ggml.c only splits the rows into units, shared with the decode step's helper thread, and
takes the RMS norm a layer's input may need first (``RmsNorm``: one loop where torch dispatches five or six calls).

On a 2-core Zen 3, one token on one thread, SmolLM2's four layer shapes took 33-123 us a call where torch's int4
kernel took 83-291 us (2.37-2.52x), and the Q8_0 head 2.5 ms where torch's int8 took 6.0 ms.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import platform
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from . import native_build
from .aside import AsideThread
from .cache import cache_root
from .kernels import load_library
from .norms import RmsNorm

LIBRARIES = ("libggml-base.so", "libggml-cpu.so")  # ggml-cpu links against ggml-base
GGML_LIB_ENV = "EDGEKV_GGML_LIB"  # a folder holding libggml-base.so and libggml-cpu.so (default: llama-cpp-python's)
# ggml.h's enum ggml_type values -> (its number, block bytes, block elements): checked against the type traits of the
# library loaded (its name, size and block), so a renumbered enum is refused rather than misread
GGML_TYPES = {"Q4_0": (2, 18, 32), "Q4_1": (3, 20, 32), "Q5_0": (6, 22, 32), "Q5_1": (7, 24, 32), "Q8_0": (8, 34, 32),
              "Q8_1": (9, 36, 32)}
GGML_BLOCK = 32  # the inputs a block of every type here covers
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")  # tried smallest first; a weight none gives back is Q8_0
FALLBACK_TYPE = "Q8_0"
# a type gives a weight back when its blocks' values are within this share of the weight's norm: 0 for a GGUF's own
# tensors but for their fp16 scales (SmolLM2's Q4_1: ~1e-4), 0.03-0.3 for a grid of another type
REPRODUCED_ERROR = 1e-3
# from this many tokens a call widens the weight to float32 and multiplies in one GEMM: a dot product per row and
# token made SmolLM2's prefill 1.7x slower than torch's int4 kernel
GEMM_TOKENS = 16
SHARED_WEIGHTS = 1 << 22  # a layer's weights from which its rows are shared with the helper thread (its wake-up costs
# more than half of a smaller one's dot products: SmolLM2's 576 x 3072 gate/up, 229.7 against 231.4 us alone)
INSTALL_HINT = "make ggml builds it (cmake and a C++ compiler), or pip install llama-cpp-python"


class GgmlTraits(ctypes.Structure):
    """ggml-cpu.h's struct ggml_type_traits_cpu."""

    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


class GgmlTypeTraits(ctypes.Structure):
    """ggml.h's struct ggml_type_traits (what ggml-base knows of a type)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)  # ggml_to_float_t


class Ggml(NamedTuple):
    """The loaded library: ggml-base (sizes, quantizer, dequantizer), ggml-cpu (the dot products) and edgekv's glue."""

    base: ctypes.CDLL
    cpu: ctypes.CDLL
    glue: ctypes.CDLL

    def traits(self, type_name: str) -> GgmlTraits:
        return self.cpu.ggml_get_type_traits_cpu(GGML_TYPES[type_name][0]).contents

    def to_float(self, type_name: str):
        return TO_FLOAT(self.base.ggml_get_type_traits(GGML_TYPES[type_name][0]).contents.to_float)

    def row_bytes(self, type_name: str, inputs: int) -> int:
        return self.base.ggml_row_size(GGML_TYPES[type_name][0], inputs)


def ggml_cache_folder(root: Path | None = None) -> Path:
    """Where ``make ggml`` (install/ggml_build.py) builds the libraries for this machine, in the cache at ``root``
    (default: this process's)."""
    return (root or cache_root()) / "ggml" / platform.machine()


def ggml_folder() -> Path | None:
    """Where libggml-base.so and libggml-cpu.so are: ``EDGEKV_GGML_LIB``, else the cache's build (``make ggml``), else
    llama-cpp-python's ``lib`` folder (found, not imported), else None."""
    if os.environ.get(GGML_LIB_ENV):
        return Path(os.environ[GGML_LIB_ENV])
    if all((ggml_cache_folder() / name).is_file() for name in LIBRARIES):
        return ggml_cache_folder()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return folder if (folder / "libggml-cpu.so").exists() else None


@functools.cache
def ggml() -> Ggml | str:
    """The library, or why it cannot serve (a sentence naming the fix)."""
    folder = ggml_folder()
    if folder is None:
        return f"ggml's CPU library is not installed: {INSTALL_HINT}"
    try:
        base = ctypes.CDLL(str(folder / LIBRARIES[0]), mode=ctypes.RTLD_GLOBAL)  # libggml-cpu links against it
        cpu = ctypes.CDLL(str(folder / LIBRARIES[1]))
    except OSError as exc:
        return f"ggml's CPU library under {folder} does not load ({exc}): {INSTALL_HINT}"
    p, i64, i32, size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_size_t
    for name, argtypes, restype in (("ggml_row_size", [i32, i64], size),
                                    ("ggml_quantize_chunk", [i32, p, p, i64, i64, i64, p], size)):
        getattr(base, name).argtypes, getattr(base, name).restype = argtypes, restype
    base.ggml_get_type_traits.argtypes, base.ggml_get_type_traits.restype = [i32], ctypes.POINTER(GgmlTypeTraits)
    cpu.ggml_get_type_traits_cpu.argtypes, cpu.ggml_get_type_traits_cpu.restype = [i32], ctypes.POINTER(GgmlTraits)
    cpu.ggml_cpu_init.argtypes, cpu.ggml_cpu_init.restype = [], None
    for name, (number, block_bytes, elements) in GGML_TYPES.items():
        traits = base.ggml_get_type_traits(number).contents
        if (traits.type_name, traits.type_size, traits.blck_size) != (name.lower().encode(), block_bytes, elements):
            return (f"ggml under {folder} numbers its block types otherwise ({name} is not type {number} of "
                    f"{block_bytes} bytes a {elements} elements): an unsupported ggml version; {INSTALL_HINT}")
    try:
        glue = load_library("ggml")
    except OSError as exc:
        cause = native_build.cause(exc)
        return f"edgekv's glue to ggml (runtime/native/ekv_ggml.c) did not build ({cause})"
    cpu.ggml_cpu_init()  # the fp16 tables the dot products read
    return Ggml(base, cpu, glue)


def ggml_unavailable() -> str | None:
    """Why the ``ggml`` format cannot run here, or None."""
    lib = ggml()
    return lib if isinstance(lib, str) else None


def quantized(lib: Ggml, type_name: str, weight: torch.Tensor) -> np.ndarray:
    """``weight`` [out, in] (float32) in ``type_name``'s blocks, by ggml's quantizer: [out, row bytes] uint8."""
    rows, inputs = weight.shape
    out = np.empty((rows, lib.row_bytes(type_name, inputs)), dtype=np.uint8)
    lib.base.ggml_quantize_chunk(GGML_TYPES[type_name][0], weight.data_ptr(), out.ctypes.data, 0, rows, inputs, None)
    return out


def dequantized(lib: Ggml, type_name: str, blocks: np.ndarray, inputs: int) -> torch.Tensor:
    """Blocks [out, row bytes] back to float32 [out, in], by the library's own ``to_float``."""
    out = torch.empty(blocks.shape[0], inputs)
    lib.to_float(type_name)(blocks.ctypes.data, out.data_ptr(), out.numel())
    return out


def blocks_for(lib: Ggml, weight: torch.Tensor) -> tuple[str, np.ndarray]:
    """(type, blocks): the first of ``BLOCK_TYPES`` whose blocks give ``weight`` back within REPRODUCED_ERROR of its
    norm (a GGUF's own grid), else Q8_0."""
    w = weight.detach().float().contiguous()
    norm = float(w.norm())
    for type_name in BLOCK_TYPES:
        blocks = quantized(lib, type_name, w)
        if float((dequantized(lib, type_name, blocks, w.shape[1]) - w).norm()) <= REPRODUCED_ERROR * norm:
            return type_name, blocks
    return FALLBACK_TYPE, quantized(lib, FALLBACK_TYPE, w)


class GgmlMatmul:
    """x [T, in] (float32) times a weight's blocks -> [T, out] float32, through ggml's dot products; with a helper
    thread lent (``aside``), a layer shares its rows with it where the helper spins, else from SHARED_WEIGHTS
    weights.  Everything but the input and the output is set up once: at a decode step's sizes a call's Python and
    ctypes work is as long as a small layer's dot products on this machine."""

    aside: AsideThread | None = None

    def __init__(self, lib: Ggml, type_name: str, blocks: np.ndarray, inputs: int):
        self.lib, self.type_name, self.blocks, self.inputs = lib, type_name, blocks, inputs
        traits = lib.traits(type_name)
        partner = next(name for name, spec in GGML_TYPES.items() if spec[0] == traits.vec_dot_type)
        self.xq_bytes = lib.row_bytes(partner, inputs)
        self._codes_at = GGML_TYPES[partner][1] - GGML_BLOCK  # the partner's block: its scale(s), then 32 int8 codes
        self.rows, row_bytes = blocks.shape
        self._job = np.empty(lib.glue.job_bytes, dtype=np.uint8)
        self._job_at = self._job.ctypes.data
        if lib.glue.ekv_ggml_layer(self._job_at, lib.traits(partner).from_float, traits.vec_dot, blocks.ctypes.data,
                                   row_bytes, self.rows, inputs, self.xq_bytes) < 0:
            raise ValueError(f"ggml's glue refused a {type_name} layer of {self.rows} rows of {inputs} inputs")
        self._call, self._unit = lib.glue.ekv_ggml_call, lib.glue.unit
        self._shares = self.rows * inputs >= SHARED_WEIGHTS
        self._xq, self._xq_at, self._xq_tokens = None, 0, 0

    def row_run(self, start: int, stop: int) -> "GgmlMatmul":
        """A kernel for output rows ``start:stop`` alone, over this one's blocks (a view, no copy)."""
        return GgmlMatmul(self.lib, self.type_name, self.blocks[start:stop], self.inputs)

    def shares_now(self) -> bool:
        """Whether a call shares its rows with the lent helper thread: where the helper spins, else from
        SHARED_WEIGHTS weights."""
        return self.aside is not None and (self._shares or self.aside.spins)

    def _room(self, tokens: int) -> None:
        """Room for ``tokens`` tokens' quantized activations, grown to the largest decode call (under GEMM_TOKENS)."""
        if tokens > self._xq_tokens:
            self._xq = torch.empty(tokens * self.xq_bytes, dtype=torch.uint8)
            self._xq_at, self._xq_tokens = self._xq.data_ptr(), tokens

    def _activations(self, x: torch.Tensor, tokens: int, norm: RmsNorm | None) -> torch.Tensor:
        """x [T, in] as the dot products see it: quantized to the partner type by ggml, then widened again (its
        blocks' scale times their codes), so a prefill chunk's GEMM rounds the activations as a decode step does and
        a teacher-forced perplexity measures the decode's format."""
        xq = torch.empty(tokens * self.xq_bytes, dtype=torch.uint8)  # a chunk's own: kept, every layer's would stay
        self._call(self._job_at, x.data_ptr(), tokens, xq.data_ptr(), 0, 0, *_norm_args(norm))  # no unit runs
        blocks = xq.view(tokens, -1, GGML_BLOCK + self._codes_at)
        scale = blocks[..., :2].view(torch.float16).float()
        return (scale * blocks[..., self._codes_at:].view(torch.int8).float()).view(tokens, self.inputs)

    def __call__(self, x: torch.Tensor, norm: RmsNorm | None = None) -> torch.Tensor:
        """x's rows times the weight; with ``norm``, x's rows RMS-normed first (in the glue)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        tokens = x.shape[0]
        if tokens >= GEMM_TOKENS:  # a prefill chunk: the weight widened once, then one float32 GEMM
            widened = dequantized(self.lib, self.type_name, self.blocks, self.inputs)
            return self._activations(x, tokens, norm) @ widened.t()
        self._room(tokens)
        out = torch.empty(tokens, self.rows)
        shared = self.shares_now()
        units = self._call(self._job_at, x.data_ptr(), tokens, self._xq_at, out.data_ptr(), not shared,
                           *_norm_args(norm))
        if shared:
            self.aside.share(self._unit, self._job, units)
        return out


class TokenScratch:
    """A fused call's scratch, grown to the largest decode call: each token's quantized activations (``xq_bytes``)
    and ``floats`` float32 of intermediate outputs."""

    def __init__(self, xq_bytes: int, floats: int):
        self.xq_bytes, self.floats, self.tokens, self.at = xq_bytes, floats, 0, (0, 0)

    def room(self, tokens: int) -> tuple[int, int]:
        """(the activations' address, the floats' address) for ``tokens`` tokens."""
        if tokens > self.tokens:
            self._xq = np.empty(tokens * self.xq_bytes, dtype=np.uint8)
            self._floats = np.empty(tokens * self.floats, dtype=np.float32)
            self.at, self.tokens = (self._xq.ctypes.data, self._floats.ctypes.data), tokens
        return self.at


def _share_target(kernels: tuple[GgmlMatmul, ...]) -> tuple[int, int | None, int | None]:
    """(bit i set where ``kernels[i]`` shares its rows now, ekv_aside_share's address, the helper's handle) for a
    fused call: nothing shared where no helper is lent or it is closed."""
    aside = kernels[0].aside
    target = aside.native_share() if aside is not None else None
    shares = 0 if target is None else sum(1 << i for i, kernel in enumerate(kernels) if kernel.shares_now())
    return (shares, *target) if shares else (0, None, None)


class GgmlBlockEnd:
    """A Llama-style block's end in one native call (ekv_ggml.c ekv_ggml_block_end): x plus the output projection of
    the attention, then plus the SiLU-gated MLP of its RMS norm, over the block's ggml layers (the output projection,
    gate and up packed as one layer, down).  A decode step's glue between them was ten torch calls a layer; each layer
    still shares its rows with a lent helper thread as its own call would."""

    def __init__(self, o: GgmlMatmul, gate_up: GgmlMatmul, down: GgmlMatmul, norm: RmsNorm,
                 biases: tuple[torch.Tensor | None, ...] = (None, None, None)):
        """``biases``: each layer's bias (float32) or None."""
        self.kernels, self.norm = (o, gate_up, down), norm
        # the output projection's or down's outputs, gate/up's, SiLU x up
        self._scratch = TokenScratch(max(kernel.xq_bytes for kernel in self.kernels), o.rows + 3 * down.inputs)
        self._biases = [None if b is None else b.detach().float().contiguous() for b in biases]
        self._jobs = (ctypes.c_void_p * 3)(*(kernel._job_at for kernel in self.kernels))
        self._bias_at = (ctypes.c_void_p * 3)(*(None if b is None else b.data_ptr() for b in self._biases))
        self._call = o.lib.glue.ekv_ggml_block_end

    def __call__(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor | None:
        """The block's output for x [B, 1, hidden] and the attention's output [B, H, 1, d], both float32 and
        contiguous, B under GEMM_TOKENS (a decode step); None for anything else (the caller's torch path serves)."""
        b, _, t, _ = attn_out.shape
        if (t != 1 or b >= GEMM_TOKENS or x.dtype != torch.float32 or attn_out.dtype != torch.float32
                or not x.is_contiguous() or not attn_out.is_contiguous()):
            return None
        out = torch.empty(x.shape)
        shares, share, handle = _share_target(self.kernels)
        self._call(self._jobs, self._bias_at, x.data_ptr(), attn_out.data_ptr(), b, self.norm.scale.data_ptr(),
                   self.norm.eps, *self._scratch.room(b), out.data_ptr(), share, handle, shares)
        return out


class GgmlHeads:
    """A layer's call with its input norm, cut into heads and rotated, in one native call (ekv_ggml.c
    ekv_ggml_heads): a packed q/k/v layer into q and k rotated and v (``k_heads`` > 0), or q's rows alone into q (the
    next layer's query).  The torch path's numbers to the bit; a decode step's views, split and rotation were 7 to 13
    torch calls a layer."""

    def __init__(self, kernel: GgmlMatmul, bias: torch.Tensor | None, norm: RmsNorm, head_dim: int, q_heads: int,
                 k_heads: int = 0):
        self.kernel, self.norm, self.head_dim, self.q_heads, self.k_heads = kernel, norm, head_dim, q_heads, k_heads
        self.v_heads = kernel.rows // head_dim - q_heads - k_heads
        self._bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_at = None if bias is None else self._bias.data_ptr()
        self._call = kernel.lib.glue.ekv_ggml_heads
        self._scratch = TokenScratch(kernel.xq_bytes, kernel.rows)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """(q [B, H, 1, d], k [B, H_kv, 1, d], v [B, H_kv, 1, d]; k and v None for q's rows alone) for x [B, 1, in]
        and RoPE's cos and signed sin [B, 1, 1, d] (runtime/model.py rope_pair), all float32 and contiguous, B under
        GEMM_TOKENS (a decode step); None for anything else (the caller's torch path serves)."""
        b, t = x.shape[:2]
        if (t != 1 or b >= GEMM_TOKENS or x.dtype != torch.float32 or cos.dtype != torch.float32
                or signed_sin.dtype != torch.float32 or cos.numel() != b * self.head_dim != signed_sin.numel()
                or not (x.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous())):
            return None
        d = self.head_dim
        q = torch.empty(b, self.q_heads, 1, d)
        k = torch.empty(b, self.k_heads, 1, d) if self.k_heads else None
        v = torch.empty(b, self.v_heads, 1, d) if self.v_heads else None
        _, share, handle = _share_target((self.kernel,))
        self._call(self.kernel._job_at, self._bias_at, x.data_ptr(), b, self.norm.scale.data_ptr(), self.norm.eps,
                   *self._scratch.room(b), cos.data_ptr(), signed_sin.data_ptr(), d, self.q_heads, self.k_heads,
                   q.data_ptr(), None if k is None else k.data_ptr(), None if v is None else v.data_ptr(), share,
                   handle)
        return q, k, v


def _norm_args(norm: RmsNorm | None) -> tuple[int | None, float]:
    """``ekv_ggml_call``'s last two arguments: the norm's scale and eps, or none."""
    return (None, 0.0) if norm is None else (norm.scale.data_ptr(), norm.eps)
