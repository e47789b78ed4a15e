"""The scoring kernel's HLS contract: interface, top-k padding, whole-word reads, the test bench,
the synthesis lint's rules (against small illegal snippets and the kernel before the UG1399 review),
and the Vitis build files."""
import ctypes
import platform
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgekv.platforms.hls_lint import lint, lint_file, synthesis_view
from edgekv.platforms.smartssd import FPGA_DIR, CsimScorer, build_csim
from edgekv.runtime.scoring import SCORE_ENTRY, KeyPool, NumpyScorer, write_pool

KERNEL = FPGA_DIR / "kernels" / "ekv_score.cpp"
PRE_REVIEW = Path(__file__).parent / "hls_fixtures" / "ekv_score_pre_review.cpp"
GXX = ["g++", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-Wall",
       "-Wno-unknown-pragmas", "-Wno-unused-label"]


def _csim_lib():
    lib = ctypes.CDLL(str(build_csim()))
    lib.ekv_csim_score_file.restype = ctypes.c_int
    lib.ekv_csim_score_file.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]
    return lib


def _pool(tmp_path, n, heads, dim, seed=0):
    rng = np.random.default_rng(seed)
    write_pool(tmp_path / "pool.bin", rng.standard_normal((n, heads, dim)).astype(np.float16))
    pool = KeyPool(tmp_path / "pool.bin", rng.permutation(10 * n)[:n].astype(np.int32), heads, dim)
    return pool, rng.standard_normal((heads, dim)).astype(np.float32)


# -- the kernel through the C simulation --------------------------------------------------------

@pytest.mark.parametrize("n, block", [(300, 128), (20, 1024)])  # a ragged 44-token tail; one block of 20
def test_every_block_writes_exactly_top_k_entries_padding_over_stale_ones(tmp_path, n, block):
    pool, q = _pool(tmp_path, n, 2, 64)
    top_k, n_blocks = 64, -(-n // block)
    scores = np.empty(n, SCORE_ENTRY)
    topk = np.full((n_blocks, top_k), np.array((777, 5.0), SCORE_ENTRY))  # a reused buffer's stale entries
    read = ctypes.c_int64(0)
    rc = _csim_lib().ekv_csim_score_file(str(pool.path).encode(), 0, n, 2, 64, pool.positions.ctypes.data,
                                         q.ctypes.data, 0.125, block, top_k, scores.ctypes.data, topk.ctypes.data,
                                         ctypes.byref(read))
    assert rc == 0
    want = NumpyScorer().score(pool, q, 0.125, block, top_k).block_topk
    tail = n - (n_blocks - 1) * block
    assert tail < top_k
    assert (topk[-1, tail:]["pos"] == -1).all() and np.isneginf(topk[-1, tail:]["score"]).all()
    np.testing.assert_array_equal(topk["pos"], want["pos"])


@pytest.mark.parametrize("heads, dim", [(1, 1), (3, 5), (1, 33), (3, 80), (7, 127), (8, 128)])
def test_rows_that_do_not_fill_whole_words_match_numpy(tmp_path, heads, dim):
    """Token rows of any length: a row may start mid-word, a word may hold several rows."""
    pool, q = _pool(tmp_path, 257, heads, dim, seed=heads * dim)
    got = CsimScorer().score(pool, q, dim ** -0.5, block_tokens=100, top_k=7)
    want = NumpyScorer().score(pool, q, dim ** -0.5, block_tokens=100, top_k=7)
    np.testing.assert_array_equal(got.scores["pos"], want.scores["pos"])
    np.testing.assert_allclose(got.scores["score"], want.scores["score"], atol=1e-4)
    np.testing.assert_array_equal(got.block_topk["pos"], want.block_topk["pos"])


def test_the_csim_dram_buffer_holds_the_last_whole_word(tmp_path):
    """The kernel reads 64-byte words; a 7-token block of 15-half rows (210 bytes) ends mid-word.
    Built with AddressSanitizer, the C-sim host must have rounded its buffer up (and zeroed it)."""
    main = tmp_path / "main.cpp"
    main.write_text(r"""
#include <stdint.h>
#include <stdio.h>
struct entry { int32_t pos; float score; };
extern "C" int ekv_csim_score_file(const char *, int64_t, int, int, int, const int32_t *, const float *, float, int,
                                   int, entry *, entry *, int64_t *);
int main(int argc, char **argv) {
    int32_t pos[20]; float q[15]; entry scores[20], top[3 * 4]; int64_t read = 0;
    for (int i = 0; i < 20; i++) pos[i] = i;
    for (int i = 0; i < 15; i++) q[i] = 0.25f * (i % 5) - 0.5f;
    int rc = ekv_csim_score_file(argv[1], 0, 20, 3, 5, pos, q, 2.0f, 7, 4, scores, top, &read);
    for (int i = 0; i < 20; i++) printf("%.9g\n", scores[i].score);
    return rc;
}
""")
    exe = tmp_path / "csim_asan"
    subprocess.run([*GXX, "-o", str(exe), str(main), str(FPGA_DIR / "host" / "ekv_csim.cpp")], check=True)
    pool, _ = _pool(tmp_path, 20, 3, 5)
    run = subprocess.run([str(exe), str(pool.path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    q = (0.25 * (np.arange(15) % 5) - 0.5).astype(np.float32).reshape(3, 5)
    want = NumpyScorer().score(pool, q, 2.0).scores["score"]
    np.testing.assert_allclose(np.array(run.stdout.split(), dtype=np.float32), want, atol=1e-5)


def test_the_hls_test_bench_passes_under_gxx_with_sanitizers(tmp_path):
    """fpga/host/ekv_tb.cpp (the Vitis C/RTL co-simulation bench) against the kernel, sanitizers on:
    its checks pass and the kernel's local arrays and streams are used in bounds."""
    exe = tmp_path / "ekv_tb"
    subprocess.run([*GXX, "-o", str(exe), str(FPGA_DIR / "host" / "ekv_tb.cpp"), str(KERNEL)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert run.stdout.count("ok:") == 5


def test_the_kernel_interface_order_is_the_xrt_hosts_contract():
    """XRT addresses arguments by index (group_id): keys 0, positions 1, query 2, scores_out 7, topk_out 8;
    no float argument (the host folds the scale into the query)."""
    src = synthesis_view(KERNEL.read_text())
    params = re.search(r"void ekv_score\(([^)]*)\)", src).group(1)
    names = [p.replace("*", " ").split()[-1] for p in params.split(",")]
    assert names == ["keys", "positions", "query", "n_tokens", "n_kv_heads", "head_dim", "top_k", "scores_out", "topk_out"]
    assert "float " not in params.replace("const float *query", "")
    assert re.search(r"ap_uint<512>\s+ekv_word", src) and "const ekv_word *keys" in params


# -- the synthesis lint ---------------------------------------------------------------------------

DATAFLOW_TOP = """
static void produce(const int *in, int n, hls::stream<int> &s) {
    for (int i = 0; i < n; i++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT max = 64
        s.write(in[i]);
    }
}
static void consume(hls::stream<int> &s, int n, int *out) {
    for (int i = 0; i < n; i++) {
#pragma HLS PIPELINE II = 1
#pragma HLS LOOP_TRIPCOUNT max = 64
        out[i] = s.read();
    }
}
static void again(const int *in, int n, int *out) {
    for (int i = 0; i < n; i++) {
#pragma HLS LOOP_TRIPCOUNT max = 64
        out[i] = in[i];
    }
}
extern "C" {
void top(const int *in, int n, int *out) {
#pragma HLS INTERFACE m_axi port = in
#pragma HLS INTERFACE m_axi port = out
#pragma HLS DATAFLOW
    hls::stream<int> s;
BODY
}
}
"""


def _dataflow(body):
    return lint(DATAFLOW_TOP.replace("BODY", body))


def test_lint_passes_a_canonical_dataflow_and_catches_each_violation():
    assert _dataflow("    produce(in, n, s);\n    consume(s, n, out);") == []  # a scalar may go to every process
    conditional = _dataflow("    produce(in, n, s);\n    if (n > 0) consume(s, n, out);")
    assert any("process call (consume) under a condition" in p for p in conditional)
    ternary = _dataflow("    produce(in, n, s);\n    n > 0 ? consume(s, n, out) : consume(s, 0, out);")
    assert any("under a condition" in p for p in ternary)
    read_back = _dataflow("    produce(in, n, s);\n    consume(s, n, out);\n    again(out, n, out);")
    assert any("argument 'out' is passed to 2 processes (consume, again)" in p for p in read_back)
    two_readers = _dataflow("    produce(in, n, s);\n    consume(s, n, out);\n    consume(s, n, out);")
    assert any("channel 's' is passed to 3 processes" in p for p in two_readers)
    for word in ("return", "break", "continue"):
        exits = _dataflow(f"    produce(in, n, s);\n    consume(s, n, out);\n    {word};")
        assert any(f"'{word}' in the dataflow region of top" in p for p in exits)


def test_lint_catches_early_exits_from_pipelined_loops_and_dataflow_processes():
    pipelined = ("void f(int *a, int n) {\n  for (int i = 0; i < 64; i++) {\n#pragma HLS PIPELINE II = 1\n"
                 "    if (i >= n) break;\n    a[i] = i;\n  }\n}\n")
    assert any("'break' out of a pipelined loop" in p for p in lint(pipelined))
    enclosing = ("void f(int *a, int n) {\n  for (int i = 0; i < 64; i++) {\n    if (i >= n) break;\n"
                 "    for (int j = 0; j < 8; j++) {\n#pragma HLS PIPELINE\n      a[i * 8 + j] = j;\n    }\n  }\n}\n")
    assert any("'break' out of a loop enclosing a pipelined loop" in p for p in lint(enclosing))
    in_process = DATAFLOW_TOP.replace("        out[i] = in[i];", "        if (in[i] < 0) break;\n        out[i] = in[i];")
    problems = lint(in_process.replace("BODY", "    again(in, n, out);"))
    assert any("'break' out of a loop of again, a dataflow process" in p for p in problems)
    plain = "void f(int *a, int n) {\n  for (int i = 0; i < 64; i++) {\n    if (i >= n) break;\n    a[i] = i;\n  }\n}\n"
    assert not any("break" in p for p in lint(plain))  # an ordinary loop outside pipelines and dataflow may exit


def test_lint_catches_a_floating_point_accumulation_carried_by_an_ii1_pipeline():
    def kernel(decl, update, ii=1):
        return (f"float f(const float *x) {{\n  {decl}\n  for (int i = 0; i < 64; i++) {{\n"
                f"#pragma HLS PIPELINE II = {ii}\n    {update}\n  }}\n  return 0;\n}}\n")

    carried = "loop-carried floating-point dependency: 'acc'"
    assert any(carried in p for p in lint(kernel("float acc = 0.0f;", "acc += x[i];")))
    assert any(carried in p for p in lint(kernel("double b, acc = 0;", "acc = x[i] * 2 + acc;")))
    assert not lint(kernel("float acc = 0.0f;", "acc += x[i];", ii=8))  # the II leaves room for the adder
    assert not lint(kernel("int acc = 0;", "acc += (int)x[i];"))  # an integer add closes in a cycle
    assert not lint(kernel("float part[8];", "part[i % 8] += x[i];"))  # interleaved partial sums


def test_lint_reads_the_source_as_vitis_does_and_keeps_the_old_rules():
    csim_only = ("#include <stdint.h>\n#if !defined(__SYNTHESIS__) && defined(__F16C__)\nint *p = new int;\n#endif\n"
                 "#ifndef __SYNTHESIS__\nvoid *q = malloc(4);\n#else\nint r = 0;\n#endif\n")
    assert lint(csim_only) == []
    assert lint("#ifdef __SYNTHESIS__\nint *p = new int;\n#endif\n") == ["dynamic allocation: new"]
    assert lint("#if defined(__has_include)\n#if __has_include(<ap_int.h>)\n#define V 1\n#endif\n#endif\n"
                "#ifndef V\nint *p = new int;\n#endif\n") == []
    view = synthesis_view("a\n#ifndef __SYNTHESIS__\nb\n#endif\nc\n")
    assert view.splitlines() == ["a", "", "", "", "c"]  # line numbers survive for the messages
    computed = ("void f(int *a, int n) {\n  for (int i = 0; i < n; i++) {\n#pragma HLS LOOP_TRIPCOUNT max = 8\n"
                "    a[i] = i;\n  }\n  for (int i = 0; i < N - 1; i++) a[i] = 0;\n}\n")
    assert lint(computed) == []  # a computed trip count with LOOP_TRIPCOUNT, a constant expression
    assert any("not static" in p for p in lint("void f(int *a, int n) {\n  for (int i = 0; i < n; i++) a[i] = 0;\n}\n"))


def test_lint_flags_every_error_class_of_the_kernel_before_the_review():
    problems = lint_file(PRE_REVIEW)
    for expected in ["process call (emit_topk) under a condition",
                     "argument 'scores_out' is passed to 2 processes (score_block, emit_topk)",
                     "'break' out of a pipelined loop",
                     "'break' out of a loop enclosing a pipelined loop",
                     "a dataflow process",
                     "which a pipelined loop inlines",
                     "loop-carried floating-point dependency: 'acc'"]:
        assert any(expected in p for p in problems), (expected, problems)
    assert lint_file(KERNEL) == []


# -- the Vitis build files ------------------------------------------------------------------------

def _make_n(*args):
    return subprocess.run(["make", "-s", "-n", "-B", "-C", str(FPGA_DIR), *args], capture_output=True, text=True,
                          check=True).stdout


def test_connectivity_config_maps_every_m_axi_port_of_one_compute_unit():
    ports = set(re.findall(r"#pragma HLS INTERFACE m_axi port = (\w+)", KERNEL.read_text()))
    cfg = (FPGA_DIR / "ekv_score.cfg").read_text()
    assert "[connectivity]" in cfg and re.search(r"^nk=ekv_score:1:ekv_score_1$", cfg, re.M)
    assert set(re.findall(r"^sp=ekv_score_1\.(\w+):\S+$", cfg, re.M)) == ports == {
        "keys", "positions", "query", "scores_out", "topk_out"}


def test_makefile_emulation_run_and_portable_csim_flags():
    run = _make_n("run", "TARGET=sw_emu")
    assert "emconfigutil --platform" in run and "XCL_EMULATION_MODE=sw_emu" in run
    assert "--config ekv_score.cfg" in run and "fpga selftest --backend xrt" in run
    assert re.search(r"v\+\+ -c .*-t sw_emu .*-g", run)
    assert "XCL_EMULATION_MODE" not in _make_n("run", "TARGET=hw")
    assert "XCL_EMULATION_MODE=hw_emu" in _make_n("hw_emu")
    csim = _make_n("csim")
    assert ("-mf16c" in csim) == (platform.machine() == "x86_64")
