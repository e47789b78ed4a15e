"""SmartSSD scorer backends behind edgekv.runtime.scoring.InStorageScorer.

- ``csim``: fpga/kernels/ekv_score.cpp compiled by g++ (built on first use into the edgekv cache,
  keyed by the source hash; ``make -C fpga csim`` builds the same library).  It reads the pool
  file itself, so only score blocks cross to Python.
- ``xrt``: the same kernel as an .xclbin on the card through pyxrt; the pool is read NAND -> FPGA
  DRAM with a P2P buffer (O_DIRECT pread of the aligned span into the mapped BO, the kernel handed
  a sub-buffer at the block's first key), never through host RAM.  pyxrt is not on PyPI: it comes
  with XRT (``source /opt/xilinx/xrt/setup.sh``).

Both leave every output entry ``UNWRITTEN`` until the kernel writes it, so a kernel that stops
early is caught by ``check_result`` (HillInfer then scores on the CPU, see runtime/hillinfer.py)
rather than read as scores.  The csim runs inside this process: a crash in it ends the process
(its KV folder is removed by the next engine opened on that path, runtime/disk_store.py).
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import numpy as np

from edgekv.runtime.checkpoints import cache_root
from edgekv.runtime.native_build import compile_library
from edgekv.runtime.scoring import SCORE_ENTRY, UNWRITTEN, InStorageScorer, KeyPool, ScoreResult

log = logging.getLogger(__name__)

FPGA_DIR = Path(__file__).resolve().parents[1] / "fpga"
SOURCES = (FPGA_DIR / "kernels" / "ekv_score.cpp", FPGA_DIR / "host" / "ekv_csim.cpp")
EMPTY = np.array((-1, -np.inf), dtype=SCORE_ENTRY)
MAX_HEAD_DIM, MAX_KV_HEADS, MAX_BLOCK, MAX_TOPK = 128, 8, 1024, 256  # the kernel's EKV_MAX_* loop bounds
PORT_BYTES = 64  # the keys port is 512 bits wide: the kernel reads whole 64-byte beats from a 64-byte-aligned start
DIRECT_ALIGN = 4096  # O_DIRECT offset, length and address unit: the largest logical block of an SSD (a multiple of 512)
# ekv_score(keys, positions, query, n_tokens, n_kv_heads, head_dim, top_k, scores_out, topk_out): buffer arguments
ARG_KEYS, ARG_POSITIONS, ARG_QUERY, ARG_SCORES, ARG_TOPK = 0, 1, 2, 7, 8


def check_bounds(n_kv_heads: int, head_dim: int, block_tokens: int, top_k: int) -> None:
    """The kernel's loops stop at static bounds, so a larger shape would be scored truncated without a word: refuse it."""
    if not (1 <= head_dim <= MAX_HEAD_DIM and 1 <= n_kv_heads <= MAX_KV_HEADS and 1 <= block_tokens <= MAX_BLOCK
            and 0 <= top_k <= MAX_TOPK):
        raise ValueError(f"the kernel supports head_dim <= {MAX_HEAD_DIM}, <= {MAX_KV_HEADS} KV heads, blocks of 1 to "
                         f"{MAX_BLOCK} tokens and top_k <= {MAX_TOPK}; got head_dim {head_dim}, {n_kv_heads} heads, "
                         f"block {block_tokens}, k {top_k}: use the numpy scorer for this model, or a smaller "
                         f"score_block_tokens / top-k")


def build_csim() -> Path:
    """Compile the kernel + C-sim host with g++ (same flags as fpga/Makefile); returns the .so path."""
    missing = [str(p) for p in SOURCES if not p.is_file()]
    if missing:
        raise OSError(f"kernel sources missing ({missing}); the csim backend needs the fpga/ folder of the repository")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    root = cache_root() / "fpga"
    target = root / f"libekv_score_csim-{digest}.so"
    if target.exists():
        return target
    if shutil.which("g++") is None:
        raise OSError("g++ is not installed, and the csim backend compiles fpga/host/ekv_csim.cpp with it on first use: "
                      "install it (apt install g++), or use the numpy scorer")
    f16c = ["-mf16c"] if platform.machine() in ("x86_64", "AMD64") else []  # else the integer fp16 routine
    flags = ["-O3", *f16c, "-fPIC", "-shared", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-label"]
    return compile_library(lambda out: ["g++", *flags, "-o", out, str(SOURCES[1])], target, "the csim scorer")


class CsimScorer(InStorageScorer):
    """The kernel compiled for the host CPU: its results are the card's, its speed and byte counts are not."""

    name, emulated, max_top_k = "csim", True, MAX_TOPK

    def __init__(self):
        path = build_csim()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:  # a damaged cached build: the source hash names it, so rebuilding gives the right one
            log.warning("the cached csim library %s does not load (%s); rebuilding it", path, exc)
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(build_csim()))
        lib.ekv_csim_score_file.restype = ctypes.c_int
        lib.ekv_csim_score_file.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
        self._lib = lib

    def score(self, pool: KeyPool, query, scale, block_tokens=1024, top_k=0):
        check_bounds(pool.n_kv_heads, pool.head_dim, block_tokens, top_k)
        n = pool.n_tokens
        n_blocks = -(-n // block_tokens)
        positions = np.ascontiguousarray(pool.positions, dtype=np.int32)
        q = np.ascontiguousarray(query, dtype=np.float32)
        scores = np.full(n, UNWRITTEN)
        block_topk = np.full((n_blocks, top_k), UNWRITTEN) if top_k else np.empty((0, 0), SCORE_ENTRY)
        read = ctypes.c_int64(0)
        rc = self._lib.ekv_csim_score_file(str(pool.path).encode(), pool.offset_bytes, n, pool.n_kv_heads, pool.head_dim,
                                           positions.ctypes.data, q.ctypes.data, scale, block_tokens, top_k,
                                           scores.ctypes.data, block_topk.ctypes.data if top_k else None,
                                           ctypes.byref(read))
        if rc != 0:
            raise OSError(-rc, f"csim scoring of {pool.path} failed: {os.strerror(-rc)}")
        crossed = scores.nbytes + block_topk.nbytes
        return ScoreResult(scores, block_topk, crossed, read.value)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def read_direct(fd: int, buf: memoryview, offset: int, length: int, path) -> tuple[int, int]:
    """Read file bytes [offset, offset + length) through O_DIRECT into ``buf``; returns (where they start in buf,
    bytes read from storage).

    O_DIRECT takes only aligned offsets, lengths and addresses, and a pool block rarely starts or ends on one, so
    the read covers the aligned span around the bytes: they start ``offset % DIRECT_ALIGN`` into buf (the kernel is
    handed a sub-buffer there).  A short read resumes from its last aligned byte."""
    span_start = offset - offset % DIRECT_ALIGN
    need = offset + length - span_start
    done = read = 0
    while done < need:
        got = os.preadv(fd, [buf[done : done + _round_up(need - done, DIRECT_ALIGN)]], span_start + done)
        read += got
        if done + got >= need:
            break
        resume = (done + got) - (done + got) % DIRECT_ALIGN
        if resume == done:
            raise OSError(errno.EIO, f"{path} ends at byte {span_start + done + got}, before the block's keys end at "
                                     f"byte {offset + length}: the pool file is shorter than its positions say")
        done = resume
    return offset - span_start, read


def default_xclbin() -> Path:
    """``EDGEKV_XCLBIN`` (fpga/Makefile's run, sw_emu and hw_emu targets set it), else the hardware build."""
    return Path(os.environ.get("EDGEKV_XCLBIN") or FPGA_DIR / "build" / "hw" / "ekv_score.xclbin")


class XrtScorer(InStorageScorer):
    """The kernel on the SmartSSD's FPGA (needs XRT, the card and fpga/build/hw/ekv_score.xclbin).

    Five buffers are allocated once, at the kernel's bounds, and reused by every call (under a lock: one call at a
    time owns them).  The keys buffer is a P2P buffer: the pool is read NAND -> FPGA DRAM through its mapping."""

    name, emulated, max_top_k = "xrt", False, MAX_TOPK

    def __init__(self, xclbin: str | Path | None = None, device_index: int = 0):
        xclbin = xclbin or default_xclbin()
        try:
            import pyxrt
        except ImportError as exc:
            raise OSError("pyxrt is not importable: install XRT and `source /opt/xilinx/xrt/setup.sh` "
                          "(pyxrt ships with XRT, not on PyPI)") from exc
        if not Path(xclbin).is_file():
            raise OSError(f"{xclbin} is missing; build it with make -C fpga TARGET=hw (needs Vitis)")
        self.pyxrt = pyxrt
        self.device = pyxrt.device(device_index)
        uuid = self.device.load_xclbin(str(xclbin))
        self.kernel = pyxrt.kernel(self.device, uuid, "ekv_score")
        bo, k, entry = pyxrt.bo, self.kernel, SCORE_ENTRY.itemsize
        keys_bytes = _round_up(MAX_BLOCK * MAX_KV_HEADS * MAX_HEAD_DIM * 2, DIRECT_ALIGN) + DIRECT_ALIGN  # + the lead
        self._keys = bo(self.device, keys_bytes, bo.flags.p2p, k.group_id(ARG_KEYS))  # NAND -> FPGA DRAM, no host copy
        self._keys_map = memoryview(self._keys.map())
        self._positions = bo(self.device, MAX_BLOCK * 4, bo.flags.normal, k.group_id(ARG_POSITIONS))
        self._query = bo(self.device, MAX_KV_HEADS * MAX_HEAD_DIM * 4, bo.flags.normal, k.group_id(ARG_QUERY))
        self._scores = bo(self.device, MAX_BLOCK * entry, bo.flags.normal, k.group_id(ARG_SCORES))
        self._topk = bo(self.device, MAX_TOPK * entry, bo.flags.normal, k.group_id(ARG_TOPK))
        self._lock = threading.Lock()

    def score(self, pool: KeyPool, query, scale, block_tokens=1024, top_k=0):
        check_bounds(pool.n_kv_heads, pool.head_dim, block_tokens, top_k)
        if pool.offset_bytes % PORT_BYTES or block_tokens * pool.key_bytes % PORT_BYTES:
            raise ValueError(f"every block's keys must start on a {PORT_BYTES}-byte boundary for the kernel's 512-bit "
                             f"port; pool offset {pool.offset_bytes} B and blocks of {block_tokens} x {pool.key_bytes} B "
                             f"do not: write the pool at a multiple of {PORT_BYTES} bytes and use an even block size")
        n = pool.n_tokens
        scores = np.empty(n, dtype=SCORE_ENTRY)
        block_topk = np.full((-(-n // block_tokens), top_k), EMPTY, SCORE_ENTRY) if top_k else np.empty((0, 0), SCORE_ENTRY)
        read = 0
        with self._lock:
            fd = os.open(pool.path, os.O_RDONLY | os.O_DIRECT)
            try:
                # the kernel takes no scale (pyxrt passes only buffers and ints, a Python float is dropped):
                # scale * (q . k) = (scale * q) . k
                self._to_device(self._query, np.ascontiguousarray(query, dtype=np.float32) * np.float32(scale))
                for b, start in enumerate(range(0, n, block_tokens)):
                    m = min(block_tokens, n - start)
                    read += self._score_block(fd, pool, start, m, top_k, scores[start : start + m],
                                              block_topk[b] if top_k else None)
            finally:
                os.close(fd)
        return ScoreResult(scores, block_topk, scores.nbytes + block_topk.nbytes, read)

    def _score_block(self, fd: int, pool: KeyPool, start: int, m: int, top_k: int, scores, topk_row) -> int:
        """One kernel call on pool tokens [start, start + m), results into ``scores`` and ``topk_row``; returns the
        bytes read from storage."""
        token_bytes = pool.key_bytes
        lead, read = read_direct(fd, self._keys_map, pool.offset_bytes + start * token_bytes, m * token_bytes, pool.path)
        keys = self.pyxrt.bo(self._keys, _round_up(m * token_bytes, PORT_BYTES), lead)  # a view from the first key
        self._to_device(self._positions, np.ascontiguousarray(pool.positions[start : start + m], dtype=np.int32))
        self._to_device(self._scores, np.full(m, UNWRITTEN))  # else a run that writes nothing returns the last one's
        if topk_row is not None:
            self._to_device(self._topk, np.full(top_k, UNWRITTEN))
        state = self.kernel(keys, self._positions, self._query, m, pool.n_kv_heads, pool.head_dim, top_k, self._scores,
                            self._topk).wait()
        if state != self.pyxrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED:  # wait() returns the state, completed or not
            raise OSError(errno.EIO, f"ekv_score on the card ended in {getattr(state, 'name', state)}, not "
                                     f"ERT_CMD_STATE_COMPLETED; see `xbutil examine` and dmesg")
        scores[:] = self._from_device(self._scores, m)
        if topk_row is not None:
            topk_row[:] = self._from_device(self._topk, top_k)  # the kernel pads past the block's tokens
        return read

    def _to_device(self, buffer, array: np.ndarray) -> None:
        buffer.write(array.tobytes(), 0)
        buffer.sync(self.pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, array.nbytes, 0)

    def _from_device(self, buffer, entries: int) -> np.ndarray:
        size = entries * SCORE_ENTRY.itemsize
        buffer.sync(self.pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, size, 0)
        return np.frombuffer(buffer.read(size, 0), SCORE_ENTRY)


def open_scorer(backend: str) -> InStorageScorer:
    from edgekv.runtime.scoring import NumpyScorer

    backends = {"csim": CsimScorer, "xrt": XrtScorer, "numpy": NumpyScorer}
    if backend not in backends:
        raise ValueError(f"unknown scorer backend {backend!r}; choose one of {sorted(backends)}")
    return backends[backend]()


def selftest(backend: str, cases: int, seed: int, work: Path) -> dict:
    """Random pools (ragged tails, head_dim 64/128, 1-8 KV heads, random k) against the numpy reference."""
    from edgekv.runtime.scoring import NumpyScorer, write_pool

    if cases < 1:
        raise ValueError(f"the selftest needs at least one case, got {cases}; pass --cases N with N >= 1")
    scorer, ref = open_scorer(backend), NumpyScorer()
    rng = np.random.default_rng(seed)
    max_err, agreement, to_host, host_would = 0.0, [], 0, 0
    for case in range(cases):
        n = int(rng.integers(1, 5000))
        heads, dim = int(rng.integers(1, 9)), int(rng.choice([64, 128]))
        block = int(rng.choice([128, 256, 1024]))
        k = int(rng.integers(1, min(256, max(1, n // 10)) + 1))  # a selective top-k, as HIE uses it
        keys = rng.standard_normal((n, heads, dim)).astype(np.float16)
        path = work / f"pool-{case}.bin"
        write_pool(path, keys)
        pool = KeyPool(path, rng.permutation(10 * n)[:n].astype(np.int32), heads, dim)
        q = rng.standard_normal((heads, dim)).astype(np.float32)
        got = scorer.score(pool, q, dim ** -0.5, block, k)
        want = ref.score(pool, q, dim ** -0.5, block, k)
        path.unlink()
        assert np.array_equal(got.scores["pos"], want.scores["pos"])
        max_err = max(max_err, float(np.abs(got.scores["score"] - want.scores["score"]).max()))
        agreement.append(len(set(got.topk(k).tolist()) & set(want.topk(k).tolist())) / k)
        # HIE: score blocks + the selected tokens' K and V; host-side: every key + the selected V
        to_host += got.scores.nbytes + k * 2 * pool.key_bytes
        host_would += want.bytes_to_host + k * pool.key_bytes
    return {"backend": backend, "scorer_backend": scorer.backend_label, "cases": cases, "seed": seed,
            "max_abs_err": max_err, "topk_agreement": float(np.mean(agreement)), "bytes_to_host": int(to_host),
            "bytes_host_scoring_would_read": int(host_would)}
