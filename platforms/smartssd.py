"""SmartSSD scorer backends behind edgekv.runtime.scoring.InStorageScorer.

- ``csim``: fpga/kernels/ekv_score.cpp compiled by g++ (built on first use into the edgekv cache,
  keyed by the source hash; ``make -C fpga csim`` builds the same library).  It reads the pool
  file itself, so only score blocks cross to Python.
- ``xrt``: the same kernel as an .xclbin on the card through pyxrt; the pool is read NAND -> FPGA
  DRAM with a P2P buffer (O_DIRECT pread into the mapped BO), never through host RAM.  pyxrt is
  not on PyPI: it comes with XRT (``source /opt/xilinx/xrt/setup.sh``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
from pathlib import Path

import numpy as np

from edgekv.runtime.reader import compile_library
from edgekv.runtime.scoring import SCORE_ENTRY, InStorageScorer, KeyPool, ScoreResult

FPGA_DIR = Path(__file__).resolve().parents[1] / "fpga"
SOURCES = (FPGA_DIR / "kernels" / "ekv_score.cpp", FPGA_DIR / "host" / "ekv_csim.cpp")
EMPTY = np.array((-1, -np.inf), dtype=SCORE_ENTRY)


def build_csim() -> Path:
    """Compile the kernel + C-sim host with g++ (same flags as fpga/Makefile); returns the .so path."""
    missing = [str(p) for p in SOURCES if not p.is_file()]
    if missing:
        raise OSError(f"kernel sources missing ({missing}); the csim backend needs the fpga/ folder of the repository")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    root = Path(os.environ.get("EDGEKV_CACHE") or Path.home() / ".cache" / "edgekv") / "fpga"
    target = root / f"libekv_score_csim-{digest}.so"
    if target.exists():
        return target
    f16c = ["-mf16c"] if platform.machine() in ("x86_64", "AMD64") else []  # else the integer fp16 routine
    flags = ["-O3", *f16c, "-fPIC", "-shared", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-label"]
    return compile_library(lambda out: ["g++", *flags, "-o", out, str(SOURCES[1])], target, "the csim scorer")


class CsimScorer(InStorageScorer):
    name = "csim"

    def __init__(self):
        lib = ctypes.CDLL(str(build_csim()))
        lib.ekv_csim_score_file.restype = ctypes.c_int
        lib.ekv_csim_score_file.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
        self._lib = lib

    def score(self, pool: KeyPool, query, scale, block_tokens=1024, top_k=0):
        n = pool.n_tokens
        n_blocks = -(-n // block_tokens)
        positions = np.ascontiguousarray(pool.positions, dtype=np.int32)
        q = np.ascontiguousarray(query, dtype=np.float32)
        scores = np.empty(n, dtype=SCORE_ENTRY)
        block_topk = np.full((n_blocks, top_k), EMPTY, dtype=SCORE_ENTRY) if top_k else np.empty((0, 0), SCORE_ENTRY)
        read = ctypes.c_int64(0)
        rc = self._lib.ekv_csim_score_file(str(pool.path).encode(), pool.offset_bytes, n, pool.n_kv_heads, pool.head_dim,
                                           positions.ctypes.data, q.ctypes.data, scale, block_tokens, top_k,
                                           scores.ctypes.data, block_topk.ctypes.data if top_k else None,
                                           ctypes.byref(read))
        if rc == -22:
            raise ValueError(f"the kernel supports head_dim <= 128, <= 8 KV heads, blocks <= 1024 and top_k <= 256; "
                             f"got head_dim {pool.head_dim}, {pool.n_kv_heads} heads, block {block_tokens}, k {top_k}")
        if rc != 0:
            raise OSError(-rc, f"csim scoring of {pool.path} failed: {os.strerror(-rc)}")
        crossed = scores.nbytes + block_topk.nbytes
        return ScoreResult(scores, block_topk, crossed, read.value)


class XrtScorer(InStorageScorer):
    """The kernel on the SmartSSD's FPGA (needs XRT, the card and fpga/build/hw/ekv_score.xclbin)."""

    name = "xrt"

    def __init__(self, xclbin: str | Path = FPGA_DIR / "build" / "hw" / "ekv_score.xclbin", device_index: int = 0):
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

    def score(self, pool: KeyPool, query, scale, block_tokens=1024, top_k=0):
        x, k = self.pyxrt, self.kernel
        n, token_bytes = pool.n_tokens, pool.key_bytes
        keys_bo = x.bo(self.device, block_tokens * token_bytes, x.bo.p2p, k.group_id(0))  # NAND -> FPGA DRAM, no host copy
        pos_bo = x.bo(self.device, block_tokens * 4, x.bo.normal, k.group_id(1))
        q_bo = x.bo(self.device, query.size * 4, x.bo.normal, k.group_id(2))
        out_bo = x.bo(self.device, block_tokens * SCORE_ENTRY.itemsize, x.bo.normal, k.group_id(8))
        top_bo = x.bo(self.device, max(1, top_k) * SCORE_ENTRY.itemsize, x.bo.normal, k.group_id(9))
        q_bo.write(np.ascontiguousarray(query, dtype=np.float32).tobytes(), 0)
        q_bo.sync(x.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        keys_map = np.frombuffer(keys_bo.map(), dtype=np.uint8)
        scores, tops, read = [], [], 0
        fd = os.open(pool.path, os.O_RDONLY | os.O_DIRECT)
        try:
            for start in range(0, n, block_tokens):
                m = min(block_tokens, n - start)
                read += os.preadv(fd, [memoryview(keys_map)[: m * token_bytes]], pool.offset_bytes + start * token_bytes)
                pos_bo.write(np.ascontiguousarray(pool.positions[start : start + m], dtype=np.int32).tobytes(), 0)
                pos_bo.sync(x.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
                k(keys_bo, pos_bo, q_bo, m, pool.n_kv_heads, pool.head_dim, scale, top_k, out_bo, top_bo).wait()
                out_bo.sync(x.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
                scores.append(np.frombuffer(out_bo.read(m * SCORE_ENTRY.itemsize, 0), dtype=SCORE_ENTRY))
                if top_k:
                    top_bo.sync(x.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE)
                    tops.append(np.frombuffer(top_bo.read(top_k * SCORE_ENTRY.itemsize, 0), dtype=SCORE_ENTRY))
        finally:
            os.close(fd)
        all_scores = np.concatenate(scores)
        block_topk = np.stack(tops) if tops else np.empty((0, 0), SCORE_ENTRY)
        return ScoreResult(all_scores, block_topk, all_scores.nbytes + block_topk.nbytes, read)


def open_scorer(backend: str) -> InStorageScorer:
    from edgekv.runtime.scoring import NumpyScorer

    backends = {"csim": CsimScorer, "xrt": XrtScorer, "numpy": NumpyScorer}
    if backend not in backends:
        raise ValueError(f"unknown scorer backend {backend!r}; choose one of {sorted(backends)}")
    return backends[backend]()


def selftest(backend: str, cases: int, seed: int, work: Path) -> dict:
    """Random pools (ragged tails, head_dim 64/128, 1-8 KV heads, random k) against the numpy reference."""
    from edgekv.runtime.scoring import NumpyScorer, write_pool

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
    return {"backend": backend, "cases": cases, "seed": seed, "max_abs_err": max_err,
            "topk_agreement": float(np.mean(agreement)), "bytes_to_host": int(to_host),
            "bytes_host_scoring_would_read": int(host_would)}
