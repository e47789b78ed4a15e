"""The SmartSSD host code: XrtScorer against a fake pyxrt that behaves as XRT's binding does (tests/fake_pyxrt.py),
the kernel bounds both backends check, and the selftest command."""
import errno
import os
import re
import sys

import numpy as np
import pytest

import tests.fake_pyxrt as fake
from edgekv.platforms.smartssd import FPGA_DIR, CsimScorer, XrtScorer
from edgekv.runtime.scoring import KeyPool, NumpyScorer

STRICT_ALIGN = 4096  # a 4Kn drive: O_DIRECT offsets, lengths and addresses in 4 KiB units


@pytest.fixture
def xrt(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyxrt", fake)
    xclbin = tmp_path / "ekv_score.xclbin"
    xclbin.write_bytes(b"xclbin")
    return XrtScorer(xclbin)


def _pool(path, n, heads, dim, seed=0, header=0):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, heads, dim)).astype(np.float16)
    path.write_bytes(rng.integers(0, 255, header, dtype=np.uint8).tobytes())
    with open(path, "ab") as f:
        f.write(keys.tobytes())
    positions = rng.permutation(10 * n)[:n].astype(np.int32)
    return KeyPool(path, positions, heads, dim, offset_bytes=header), rng.standard_normal((heads, dim)).astype(np.float32)


def _same(got, want):
    np.testing.assert_array_equal(got.scores["pos"], want.scores["pos"])
    np.testing.assert_allclose(got.scores["score"], want.scores["score"], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got.block_topk["pos"], want.block_topk["pos"])


def test_the_fake_drops_a_python_float_as_pyxrt_does():
    dev = fake.device()
    k = fake.kernel(dev, "u", "ekv_score")
    buffers = [fake.bo(dev, 4096, fake.bo.normal, k.group_id(i)) for i in fake.GLOBAL_ARGS]
    run = k(*buffers[:3], 4, 1, 8, 0.5, buffers[3], buffers[4])  # a float where top_k goes: skipped, stays 0
    assert run.wait() == fake.ert_cmd_state.ERT_CMD_STATE_COMPLETED
    assert k(*buffers[:3], 4, 1, 8, 2, 9.0, buffers[4]).wait() == fake.ert_cmd_state.ERT_CMD_STATE_ERROR  # scores_out unset


def test_xrt_folds_the_scale_into_the_query(xrt, tmp_path):
    pool, q = _pool(tmp_path / "pool.f16", 300, 2, 64)
    for scale in (0.125, 2.0):
        _same(xrt.score(pool, q, scale, block_tokens=128, top_k=5), NumpyScorer().score(pool, q, scale, 128, 5))


def test_xrt_allocates_five_buffers_once_sized_for_the_port_and_o_direct(xrt, tmp_path):
    for i, (n, heads, dim, block, k) in enumerate([(300, 2, 64, 128, 5), (40, 8, 128, 1024, 0), (1500, 1, 64, 256, 17)]):
        pool, q = _pool(tmp_path / f"pool{i}.f16", n, heads, dim, seed=i)
        _same(xrt.score(pool, q, 0.5, block, k), NumpyScorer().score(pool, q, 0.5, block, k))
    assert len(xrt.device.allocations) == 5
    (keys_size, _, _), = [a for a in xrt.device.allocations if a[1] == fake.bo.p2p]
    assert keys_size % 64 == 0 and keys_size % STRICT_ALIGN == 0


def _strict_preadv(monkeypatch, short_once=True):
    """os.preadv as O_DIRECT on a 4Kn drive: EINVAL unless offset, length and address are 4 KiB aligned; one short read."""
    real, seen = os.preadv, {"short": 0, "calls": 0}

    def preadv(fd, buffers, offset):
        (buf,) = buffers
        view = np.frombuffer(buf, dtype=np.uint8)
        if offset % STRICT_ALIGN or len(view) % STRICT_ALIGN or view.ctypes.data % STRICT_ALIGN:
            raise OSError(errno.EINVAL, "Invalid argument")
        seen["calls"] += 1
        if short_once and not seen["short"] and len(view) > STRICT_ALIGN:
            seen["short"] += 1
            return real(fd, [buf[:STRICT_ALIGN]], offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return seen


def test_xrt_reads_ragged_blocks_at_unaligned_offsets_with_o_direct(xrt, tmp_path, monkeypatch):
    # 240-byte keys from a 192-byte header: no block starts or ends on a 4 KiB boundary; the 45-token tail
    # (10,800 bytes) ends inside a 64-byte beat
    pool, q = _pool(tmp_path / "pool.f16", 301, 3, 40, header=192)
    try:
        os.close(os.open(pool.path, os.O_RDONLY | os.O_DIRECT))
    except OSError:  # a filesystem without O_DIRECT: the strict preadv alone enforces the alignment
        monkeypatch.setattr(os, "O_DIRECT", 0)
    seen = _strict_preadv(monkeypatch)
    got = xrt.score(pool, q, 0.25, block_tokens=64, top_k=7)
    _same(got, NumpyScorer().score(pool, q, 0.25, 64, 7))
    assert seen["short"] == 1 and seen["calls"] >= 6
    assert got.bytes_from_storage >= 301 * pool.key_bytes


def test_xrt_refuses_a_pool_file_that_ends_before_its_keys(xrt, tmp_path, monkeypatch):
    pool, q = _pool(tmp_path / "pool.f16", 100, 2, 64)
    short = KeyPool(pool.path, np.arange(120, dtype=np.int32), 2, 64)
    _strict_preadv(monkeypatch, short_once=False)
    with pytest.raises(OSError, match="ends"):
        xrt.score(short, q, 1.0, block_tokens=64, top_k=3)


def test_xrt_raises_when_the_run_ends_in_an_error_state(xrt, tmp_path):
    pool, q = _pool(tmp_path / "pool.f16", 100, 2, 64)
    xrt.device.fail_state = fake.ert_cmd_state.ERT_CMD_STATE_ERROR
    with pytest.raises(OSError, match="ERT_CMD_STATE_ERROR"):
        xrt.score(pool, q, 1.0, block_tokens=64, top_k=3)


@pytest.mark.parametrize("heads, dim, block, k", [(1, 256, 64, 4), (16, 64, 64, 4), (2, 64, 2048, 4), (2, 64, 512, 300)])
def test_xrt_and_csim_refuse_shapes_the_kernel_would_truncate(xrt, tmp_path, heads, dim, block, k):
    pool, q = _pool(tmp_path / "pool.f16", 600, heads, dim)
    message = r"the kernel supports head_dim <= 128, <= 8 KV heads, blocks of 1 to 1024 tokens and top_k <= 256"
    for scorer in (xrt, CsimScorer()):
        with pytest.raises(ValueError, match=message):
            scorer.score(pool, q, 1.0, block, k)


def test_the_kernel_bounds_in_python_are_the_kernels_own():
    from edgekv.platforms import smartssd

    source = (FPGA_DIR / "kernels" / "ekv_score.cpp").read_text()
    defines = {m[1]: int(m[2]) for m in re.finditer(r"#define EKV_MAX_(\w+) (\d+)", source)}
    assert defines == {"HEAD_DIM": smartssd.MAX_HEAD_DIM, "KV_HEADS": smartssd.MAX_KV_HEADS, "BLOCK": smartssd.MAX_BLOCK,
                       "TOPK": smartssd.MAX_TOPK}
    assert (fake.MAX_HEAD_DIM, fake.MAX_KV_HEADS, fake.MAX_BLOCK, fake.MAX_TOPK) == tuple(
        defines[k] for k in ("HEAD_DIM", "KV_HEADS", "BLOCK", "TOPK"))



@pytest.mark.parametrize("cases", ["0", "-3"])
def test_fpga_selftest_refuses_no_cases(tmp_path, capsys, cases):
    from edgekv.cli import main

    out = tmp_path / "st.json"
    assert main(["fpga", "selftest", "--backend", "csim", "--cases", cases, "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert "at least one case" in captured.err and "NaN" not in captured.out and not out.exists()


def test_xrt_loads_the_binary_named_by_edgekv_xclbin(tmp_path, monkeypatch):
    """fpga/Makefile's run, sw_emu and hw_emu targets name their build through EDGEKV_XCLBIN."""
    monkeypatch.setitem(sys.modules, "pyxrt", fake)
    emulated = tmp_path / "sw_emu" / "ekv_score.xclbin"
    emulated.parent.mkdir()
    emulated.write_bytes(b"xclbin")
    monkeypatch.setenv("EDGEKV_XCLBIN", str(emulated))
    XrtScorer()
    monkeypatch.setenv("EDGEKV_XCLBIN", str(tmp_path / "missing.xclbin"))
    with pytest.raises(OSError, match="missing.xclbin is missing"):
        XrtScorer()
