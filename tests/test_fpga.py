"""The in-storage scoring kernel (g++ C-simulation) against numpy, its synthesis lint, and HillInfer's selector."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edgekv.platforms.hls_lint import lint, lint_file
from edgekv.platforms.smartssd import FPGA_DIR, CsimScorer, selftest
from edgekv.runtime import Engine
from edgekv.runtime.config import HillInferConfig
from edgekv.runtime.hillinfer import HierarchicalSelector
from edgekv.runtime.model import ModelDims
from edgekv.runtime.scoring import KeyPool, NumpyScorer, write_pool
from tests.conftest import files_under
from tests.test_exactness import EXACT, PROMPTS, run


def test_csim_kernel_matches_numpy_on_random_shapes_with_ragged_tails(tmp_path):
    result = selftest("csim", cases=25, seed=3, work=tmp_path)
    assert result["max_abs_err"] < 1e-3  # fp16 keys, fp32 accumulation in a different order
    assert result["topk_agreement"] == 1.0
    assert result["bytes_to_host"] <= result["bytes_host_scoring_would_read"] / 10


def test_csim_score_blocks_and_block_topk(tmp_path):
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((300, 2, 64)).astype(np.float16)
    write_pool(tmp_path / "pool.bin", keys)
    pool = KeyPool(tmp_path / "pool.bin", np.arange(1000, 1300, dtype=np.int32), 2, 64)
    q = rng.standard_normal((2, 64)).astype(np.float32)
    got = CsimScorer().score(pool, q, 0.125, block_tokens=128, top_k=5)
    want = NumpyScorer().score(pool, q, 0.125, block_tokens=128, top_k=5)
    assert got.block_topk.shape == (3, 5)  # 128 + 128 + 44 (a ragged tail)
    np.testing.assert_array_equal(got.block_topk["pos"], want.block_topk["pos"])
    np.testing.assert_allclose(got.scores["score"], want.scores["score"], atol=1e-4)
    assert got.bytes_from_storage == 300 * 2 * 64 * 2 and got.bytes_to_host == got.scores.nbytes + got.block_topk.nbytes
    with pytest.raises(ValueError, match="head_dim <= 128"):
        CsimScorer().score(KeyPool(pool.path, pool.positions, 1, 256), np.zeros((1, 256), np.float32), 1.0)


def test_kernel_passes_the_synthesis_lint_and_the_lint_catches_violations():
    assert lint_file(FPGA_DIR / "kernels" / "ekv_score.cpp") == []
    bad = ('extern "C" {\nvoid k(int *a, float *b, int n) {\n#pragma HLS INTERFACE m_axi port = a\n'
           '  int *x = (int *)malloc(4);\n  for (int i = 0; i < n; i++) a[i] = r(i);\n}\n}\nint r(int i) { return r(i - 1); }\n')
    problems = lint(bad)
    assert any("dynamic allocation" in p for p in problems)
    assert any("recursion: r" in p for p in problems)
    assert any("loop bound is not static" in p for p in problems)
    assert any("'b' of k has no interface pragma" in p for p in problems)


def test_fpga_selftest_command_writes_its_json(tmp_path):
    from edgekv.cli import main

    out = tmp_path / "st.json"
    assert main(["fpga", "selftest", "--backend", "csim", "--cases", "4", "--seed", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"max_abs_err", "topk_agreement", "cases", "backend", "bytes_to_host", "bytes_host_scoring_would_read"} <= set(data)


@pytest.mark.parametrize("scorer", [NumpyScorer, CsimScorer])
def test_hillinfer_with_alpha_one_equals_full(model_dirs, kv_path, scorer):
    reference = run(model_dirs["llama"], kv_path, "full")
    config = {**EXACT, "importance_rate": 1.0, "beta": 0.1, "score_block_tokens": 16}  # most keys in the SSD pool
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, policy="hillinfer",
                                scorer=scorer(), device="cpu") as engine:
        results = engine.generate(PROMPTS, max_new_tokens=14, stop_token_ids=[], output_logits=True)
    assert files_under(kv_path) == []
    for ref, got in zip(reference, results):
        assert got.token_ids == ref.token_ids
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)


def test_hierarchical_pools_keep_recent_tokens_and_swap_hot_ones_in_equal_numbers(tmp_path):
    dims = ModelDims(n_layers=1, hidden=4, n_heads=1, n_kv_heads=1, head_dim=4, vocab=10)
    sel = HierarchicalSelector(NumpyScorer(), tmp_path, dims, 1, 200,
                               HillInferConfig(importance_rate=0.1, beta=0.25, score_block_tokens=64), scaling=1.0)
    keys = torch.zeros(1, 200, 4)
    keys[0, 17] = 5.0  # an old token the query likes
    keys[0, :, 0] += torch.linspace(-1, 0, 200)  # otherwise ranked by recency
    sel.append(0, 0, 0, keys)
    assert sel.cpu_capacity == 40 and sel.in_cpu[0, 0].sum() == 40 and sel.in_cpu[0, 0, 180:].all()
    groups, valid = sel.select(0, torch.ones(1, 1, 1, 4), torch.tensor([200]))
    picked = groups[0][valid[0]].tolist()
    assert len(picked) == 20 and 17 in picked  # found in storage by the in-storage scorer
    assert sel.in_cpu[0, 0, 17]  # promoted into the CPU pool ...
    assert sel.in_cpu[0, 0].sum() == 40  # ... with one token demoted for it
    assert sel.in_cpu[0, 0, 180:].all()  # the recent alpha*N stay
    assert sel.bytes_to_host > 0


def test_the_synthesis_fp16_conversion_is_bit_exact(tmp_path):
    """The integer half->float routine (what v++ synthesises; used by g++ builds without F16C) on all 65,536 codes."""
    import ctypes

    from edgekv.platforms.smartssd import SOURCES
    from edgekv.runtime.native_build import compile_library

    lib_path = compile_library(lambda out: ["g++", "-O2", "-fPIC", "-shared", "-Wno-unknown-pragmas", "-Wno-unused-label",
                                            "-o", out, str(SOURCES[1])], tmp_path / "nof16c.so", "the integer-fp16 csim")
    lib = ctypes.CDLL(str(lib_path))
    lib.ekv_csim_half_to_float.restype = ctypes.c_float
    lib.ekv_csim_half_to_float.argtypes = [ctypes.c_uint16]
    codes = np.arange(65536, dtype=np.uint16)
    want = codes.view(np.float16).astype(np.float32)
    got = np.array([lib.ekv_csim_half_to_float(int(c)) for c in codes], dtype=np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # signed zeros and subnormals too
