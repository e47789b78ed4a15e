"""The native K_lr group scorer (runtime/native/ekv_score.c) against the torch reference it stands in for (a selector
built on the torch backend over the same keys): the same group scores within float32 rounding and the same picks, for
every row format, both score reduces, odd ranks, several sequences of different lengths, and group sizes from 1 to
16."""
import dataclasses
import platform

import numpy as np
import pytest
import torch

from tests.test_predictor import stored_rows
from edgekv.runtime import aside as aside_module
from edgekv.runtime import selector as selector_module
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.config import PredictorConfig
from edgekv.runtime.kernels import load_backend, load_library, resolve_backend
from edgekv.runtime.model import ModelDims
from edgekv.runtime.selector import KLR_BLOCK_TOKENS, LowRankSelector

NATIVE, TORCH = resolve_backend("cpu"), resolve_backend("cpu", "torch")
pytestmark = pytest.mark.skipif(NATIVE.name != "native", reason="no C compiler for the native kernels")


def filled_selectors(klr_dtype, score_reduce, rank, G, batch, lengths, head_dim=16, n_kv_heads=2, n_heads=6,
                     picked_groups=5, backends=(NATIVE, TORCH)):
    """A selector on each of ``backends`` whose K_lr holds the same ``lengths[b]`` random keys for each sequence (one
    layer), the adapter fitted on them."""
    dims = ModelDims(n_layers=1, hidden=n_heads * head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     vocab=10)
    keys = [torch.randn(n_kv_heads, n, head_dim) for n in lengths]
    adapter = LowRankAdapter.fit([k.transpose(0, 1).reshape(k.shape[1], -1) for k in keys], n_kv_heads, head_dim,
                                 rank=rank)
    selectors = []
    for backend in backends:
        selectors.append(LowRankSelector(adapter, rank, dims, batch, max(lengths) + G, G, picked_groups,
                                         PredictorConfig(klr_dtype=klr_dtype, score_reduce=score_reduce),
                                         torch.device("cpu"), head_dim ** -0.5, backend))
        for seq, k in enumerate(keys):
            selectors[-1].append(0, seq, 0, k)
    return selectors


def filled_selector(*args, backend=NATIVE, **options):
    """``filled_selectors``' one selector on ``backend``."""
    return filled_selectors(*args, backends=(backend,), **options)[0]


def both_paths(selectors, q, counts, monkeypatch):
    """(group scores, groups, valid) through the native scorer, then through the torch reference (``selectors``: a
    native and a torch selector over the same keys), from the same low-rank queries (a CPU's native selector projects
    them natively whichever path scores; test_native_low_rank_queries_equal_torchs_projection checks that)."""
    native, reference = selectors
    assert native._scorer is not None and reference._scorer is None  # the native path serves the first only
    queries = native._low_rank_queries(0, q)
    monkeypatch.setattr(reference, "_low_rank_queries", lambda layer, q: queries)
    out = []
    for selector in selectors:
        groups, valid = selector.select(0, q, counts)
        out.append((selector._group_scores[:, : int(counts.max())].clone(), groups, valid))
    return out


@pytest.mark.parametrize("klr_dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
@pytest.mark.parametrize("rank,G", [(8, 4), (7, 1), (33, 16)])
def test_native_scores_and_picks_equal_the_torch_paths(klr_dtype, score_reduce, rank, G, monkeypatch):
    torch.manual_seed(rank * G)
    lengths = [8 * G + 3, 5 * G]  # one sequence longer than the other, neither a whole number of groups
    selectors = filled_selectors(klr_dtype, score_reduce, rank, G, 2, lengths)
    q = torch.randn(2, 6, 1, 16)
    counts = np.array([n // G for n in lengths])
    (native, n_groups, n_valid), (torch_scores, t_groups, t_valid) = both_paths(selectors, q, counts, monkeypatch)
    inside = torch.from_numpy(np.arange(native.shape[1]) < counts[:, None])
    torch.testing.assert_close(native[inside], torch_scores[inside], rtol=2e-5, atol=1e-6)
    assert torch.equal(n_valid, t_valid) and torch.equal(n_groups[n_valid], t_groups[t_valid])


def test_batch_of_one_at_a_long_context_with_deployed_shapes(monkeypatch):
    """SmolLM2's deployed scorer: 9 heads over 3 KV heads of 64, rank 96 in int8, softmax votes, G=4, 2,048 groups."""
    torch.manual_seed(7)
    selectors = filled_selectors("int8", "softmax", 96, 4, 1, [8192], head_dim=64, n_kv_heads=3, n_heads=9,
                                 picked_groups=205)
    counts = np.array([2048])
    (native, n_groups, _), (torch_scores, t_groups, _) = both_paths(selectors, torch.randn(1, 9, 1, 64), counts,
                                                                     monkeypatch)
    torch.testing.assert_close(native, torch_scores, rtol=2e-5, atol=1e-7)
    assert sorted(n_groups[0].tolist()) == sorted(t_groups[0].tolist())


@pytest.mark.parametrize("klr_dtype", ["int8", "int4"])
@pytest.mark.parametrize("rank", [8, 7, 33, 96, 6])
def test_integer_rows_give_the_torch_paths_scores_to_the_bit(klr_dtype, rank, monkeypatch):
    """Integer rows meet their queries rounded to int8: the dot products are integers, exact in any order, so "sum"
    (the logits' group maxima, no softmax) gives the torch path's scores bit for bit, with the int8 dot-product
    instructions or without, for ranks that fill their last four-position lane or not (7, 33, 6) and long enough for
    several blocks of 64 tokens and a short last one."""
    torch.manual_seed(rank)
    lengths = [700, 333]
    selectors = filled_selectors(klr_dtype, "sum", rank, 1, 2, lengths)
    q = torch.randn(2, 6, 1, 16)
    counts = np.array(lengths)
    (native, n_groups, n_valid), (torch_scores, t_groups, t_valid) = both_paths(selectors, q, counts, monkeypatch)
    inside = torch.from_numpy(np.arange(native.shape[1]) < counts[:, None])
    assert torch.equal(native[inside], torch_scores[inside])
    assert torch.equal(n_valid, t_valid) and torch.equal(n_groups, t_groups)


@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,rank", [(6, 2, 16, 7), (4, 4, 64, 33), (9, 3, 64, 96),
                                                               (8, 1, 256, 256)])
def test_native_low_rank_queries_equal_torchs_projection(score_reduce, n_heads, n_kv_heads, head_dim, rank):
    """The queries' projection (ekv_score.c ekv_low_rank_queries) that a CPU's both scoring paths take: torch's
    broadcast matmul (a GPU's) within float32 rounding, for GQA, MHA and MQA, odd ranks up to the native maximum,
    a batch of two, and bfloat16 or non-contiguous queries (widened first: torch's "sum" of bfloat16 heads rounds)."""
    torch.manual_seed(rank + n_heads)
    selector = filled_selector("int8", score_reduce, rank, 4, 2, [40, 37], head_dim=head_dim, n_kv_heads=n_kv_heads,
                               n_heads=n_heads)
    for q in (torch.randn(2, n_heads, 1, head_dim), torch.randn(2, n_heads, head_dim, 1).transpose(2, 3),
              torch.randn(2, n_heads, 1, head_dim).bfloat16()):
        native = selector._low_rank_queries(0, q)
        expected = selector._torch_queries(0, q.float())  # the reference; widened before "sum" adds the heads
        assert native.shape == expected.shape == (2, 1 if score_reduce == "sum" else n_heads, rank)
        torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


def test_integer_queries_round_half_to_even_within_127_and_a_zero_query_scores_zero(monkeypatch):
    """The query's rounding the native scorer and torch share: its largest magnitude becomes 127, halves round to even
    (2.5 -> 2, 3.5 -> 4, -0.5 -> 0) in both (the native codes read back through identity rows), and a query of zeros
    keeps a positive scale and scores 0 everywhere, never NaN."""
    from edgekv.runtime.selector import integer_queries

    lhs = torch.tensor([[127.0, 2.5, 3.5, -0.5, -127.0]])
    codes, scale = integer_queries(lhs)
    assert codes.dtype == torch.int8 and codes.tolist() == [[127, 2, 4, 0, -127]] and scale.tolist() == [1.0]
    lib, rows = NATIVE.lib("score"), torch.zeros(1, 8, KLR_BLOCK_TOKENS, dtype=torch.int8)  # one block, rank-major
    rows[0, :, :8] = torch.eye(8, dtype=torch.int8)  # token t's row: 1 at rank position t
    ones, out = torch.ones(1, 8, dtype=torch.bfloat16), torch.empty(1, 8)
    q = torch.tensor([127.0, 2.5, 3.5, -0.5, -127.0, 1.5, -2.5, 0.25])
    scratch = torch.empty(lib.ekv_score_scratch_floats(1, 1, 8, 1))
    assert lib.ekv_group_scores(rows.data_ptr(), rows[0].numel(), rows.numel(), ones.data_ptr(), 8, q.data_ptr(), 1,
                                1, 8, 8, 1, 2, 0, None,
                                scratch.data_ptr(), scratch.numel(), out.data_ptr(), 8) == 0
    assert out.tolist() == [[127, 2, 4, 0, -127, 2, -2, 0]]  # the native scorer's codes, read through the identity
    codes, scale = integer_queries(torch.zeros(1, 3))
    assert codes.tolist() == [[0, 0, 0]] and scale.item() > 0
    selectors = filled_selectors("int4", "sum", 8, 4, 1, [40])
    zero = torch.zeros(1, 6, 1, 16)
    native, torch_scores = (scores[:, :10] for scores, _, _ in both_paths(selectors, zero, np.array([10]),
                                                                           monkeypatch))
    assert torch.equal(native, torch.zeros(1, 10)) and torch.equal(torch_scores, native)


def test_integer_scores_track_those_of_the_unrounded_query():
    """The query's rounding moves a score by a fraction of a percent of the largest: the picks of a long context stay
    those of the float query's dot products with the same codes."""
    torch.manual_seed(4)
    selector = filled_selector("int4", "softmax", 96, 4, 1, [4096], head_dim=64, n_kv_heads=3, n_heads=9,
                               picked_groups=200)
    q = torch.randn(1, 9, 1, 64)
    rounded = selector.token_scores(0, q, 4096)
    lhs = selector._low_rank_queries(0, q)
    rows = stored_rows(selector, 0, 0, 4096)[None]
    logits = (lhs @ selector._as_float(rows)) * selector.k_scale[0, :, None, :4096].float()
    unrounded = logits.softmax(-1).sum(1)
    assert (rounded - unrounded).abs().max() <= 0.01 * unrounded.abs().max()
    top = [set(scores.view(1024, 4).amax(-1).topk(200).indices.tolist()) for scores in (rounded[0], unrounded[0])]
    assert len(top[0] & top[1]) >= 0.97 * 200


def test_rows_the_scorer_cannot_read_take_the_torch_path():
    """float16 rows are not among the native formats: the torch path scores them (and the selection still works)."""
    selector = filled_selector("float16", "softmax", 8, 4, 1, [40])
    assert selector._scorer is None  # chosen when the selector was built
    groups, valid = selector.select(0, torch.randn(1, 6, 1, 16), np.array([10]))
    assert valid.all() and len(set(groups[0].tolist())) == 5
    assert selector.stats()["scorer_fallback"] == "torch.float16 K_lr rows: scored through torch"


def test_a_selection_that_scores_natively_reports_no_fallback_and_a_missing_compiler_is_reported(failing_build,
                                                                                                   caplog):
    """The result's stats say when a CPU select scored through torch, so a slow run is not a mystery: a scorer that
    does not build leaves the whole CPU backend torch's (the build's error logged), and the selector says so."""
    selector = filled_selector("int8", "softmax", 8, 4, 1, [40])
    selector.select(0, torch.randn(1, 6, 1, 16), np.array([10]))
    assert selector.stats() == {"scorer_fallback": None}
    failing_build("score", "the K_lr group scorer", "ekv_score.c:1: error: no compiler here")
    with caplog.at_level("WARNING", logger="edgekv.runtime.kernels"):
        backend = load_backend("cpu")
    assert backend.name == "torch" and backend.libraries == {} and "error: no compiler here" in backend.reason
    assert [r.getMessage() for r in caplog.records] == [f"{backend.reason}: every operation runs the torch reference"]
    with pytest.raises(OSError, match="no compiler here"):  # asked for by name, the native backend is an error
        load_backend("cpu", "native")
    selector = filled_selector("int8", "softmax", 8, 4, 1, [40], backend=backend)
    groups, valid = selector.select(0, torch.randn(1, 6, 1, 16), np.array([10]))
    assert valid.all() and selector.stats()["scorer_fallback"] == (
        f"the torch backend (building the K_lr group scorer failed: ekv_score.c:1: error: no compiler here): scored "
        "through torch")


def test_a_rank_past_the_native_limit_takes_the_torch_path():
    """The scorer widens a block of rows on its stack for up to 256 rank positions; a larger rank (sigma 1 or 2 of an
    8-KV-head model) is scored by torch, with the same picks as the rule asks."""
    torch.manual_seed(11)
    selector = filled_selector("int8", "softmax", 300, 4, 1, [400], head_dim=64, n_kv_heads=8, n_heads=8)
    q = torch.randn(1, 8, 1, 64)
    assert selector._scorer is None
    assert selector.stats()["scorer_fallback"] == "rank 300 > 256: scored through torch"
    groups, valid = selector.select(0, q, np.array([100]))
    expected = selector.token_scores(0, q, 400).view(1, 100, 4).amax(-1).topk(5).indices
    assert valid.all() and sorted(groups[0].tolist()) == sorted(expected[0].tolist())


def test_loading_the_native_libraries_keeps_subnormal_floats():
    """A library linked with -ffast-math sets the CPU to flush subnormals to zero for the whole process when it loads
    (the first version of the scorer did): torch's and numpy's arithmetic would change under every caller."""
    from edgekv.runtime import native_build
    for name, path in native_build.build_all().items():
        if not path.startswith("unavailable"):
            native_build.load(name)
    tiny = np.float32(1e-45)  # the smallest float32 subnormal
    assert tiny * np.float32(1.0) > 0 and torch.tensor(1e-45) * 1.0 > 0


@pytest.mark.parametrize("klr_dtype, spin_us", [("bfloat16", 0), ("int8", 0), ("int4", 0), ("int4", 300)])
def test_picks_scored_on_the_helper_thread_equal_those_scored_on_the_callers(klr_dtype, spin_us, monkeypatch):
    """With a helper thread lent (runtime/aside.py), ``launch`` posts the native scorer's job to it and takes the
    top-M when the picks are asked for, and ``select`` shares the sequences with it: the same groups as ``select``
    with no helper, for several launches in flight one after another, waited for out of order, and a batch of
    sequences of different lengths; a helper that spins between jobs (``spin_us``) does the same."""
    monkeypatch.setattr(aside_module, "cores", lambda: 2)
    torch.manual_seed(5)
    lengths = [37 * 4 + 1, 20 * 4, 9 * 4]
    selector = filled_selector(klr_dtype, "softmax", 12, 4, 3, lengths, picked_groups=7)
    counts = torch.tensor([n // 4 for n in lengths])
    queries = [torch.randn(3, 6, 1, 16) for _ in range(3)]
    expected = [selector.select(0, q, counts, first=1) for q in queries]
    selector.aside = aside_module.AsideThread.open(spin_us=spin_us)
    assert selector.aside.spins == bool(spin_us)
    launched = [selector.launch(0, q, counts, first=1) for q in queries]
    assert all(isinstance(p, selector_module.ScoredAside) for p in launched)
    shared = [selector.select(0, q, counts, first=1) for q in queries]
    for picking, (groups_0, valid_0), (groups_1, valid_1) in reversed(list(zip(launched, expected, shared))):
        groups, valid = picking.result()
        assert picking.ready()
        for g, v in ((groups, valid), (groups_1, valid_1)):
            assert torch.equal(v, valid_0) and torch.equal(g[v], groups_0[valid_0])
    selector.aside.close()


@pytest.mark.parametrize("klr_dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
def test_a_launch_posted_in_one_native_call_picks_what_its_calls_one_by_one_pick(klr_dtype, score_reduce, monkeypatch):
    """``launch`` with a helper projects the queries, makes the scores' and the top-M's jobs and posts them in one
    native call (ekv_score.c ekv_score_launch): the picks, bit for bit, of the same jobs made and posted call by call,
    for a batch of different lengths, an odd rank, a first group past the sinks and a bfloat16 query not contiguous."""
    monkeypatch.setattr(aside_module, "cores", lambda: 2)
    torch.manual_seed(17)
    lengths = [4 * 300 + 2, 4 * 41, 4 * 9]
    selector = filled_selector(klr_dtype, score_reduce, 13, 4, 3, lengths, picked_groups=11)
    counts = torch.tensor([n // 4 for n in lengths])
    queries = [torch.randn(3, 6, 1, 16), torch.randn(3, 1, 6, 16, dtype=torch.bfloat16).transpose(1, 2)]
    selector.aside = aside_module.AsideThread.open()
    one_call = selector._launch_posted
    served = []
    monkeypatch.setattr(selector, "_launch_posted", lambda *a: served.append(one_call(*a)) or served[-1])
    launched = [selector.launch(0, q, counts, first=1).host().copy() for q in queries]
    assert len(served) == 2 and all(isinstance(p, selector_module.ScoredAside) for p in served)
    monkeypatch.setattr(selector, "_launch_posted", lambda *a: None)
    by_calls = [selector.launch(0, q, counts, first=1) for q in queries]
    assert all(isinstance(p, selector_module.ScoredAside) for p in by_calls)
    for picks, picking in zip(launched, by_calls):
        assert (picks[:, 0] >= 1).all() and np.array_equal(picks, picking.host())
    selector.aside.close()


def test_with_one_core_there_is_no_helper_and_a_closed_ones_jobs_run_on_the_caller(monkeypatch):
    """A helper would only take turns with the compute on one core: none opens.  After ``close`` (its jobs finished)
    a job posted or shared runs on the caller's thread, with the same picks."""
    monkeypatch.setattr(aside_module, "cores", lambda: 1)
    assert aside_module.AsideThread.open() is None
    monkeypatch.setattr(aside_module, "cores", lambda: 2)
    selector = filled_selector("int8", "softmax", 8, 4, 1, [40])
    q = torch.randn(1, 6, 1, 16)
    expected_groups, _ = selector.select(0, q, torch.tensor([10]))
    selector.aside = aside_module.AsideThread.open()
    in_flight = selector.launch(0, q, torch.tensor([10]))
    selector.aside.close()
    assert in_flight.ready() and torch.equal(in_flight.result()[0], expected_groups)
    after = selector.launch(0, q, torch.tensor([10]))
    assert after.ready() and torch.equal(after.result()[0], expected_groups)
    assert torch.equal(selector.select(0, q, torch.tensor([10]))[0], expected_groups)


@pytest.mark.parametrize("klr_dtype", ["float32", "bfloat16", "int8", "int4"])
def test_a_flushed_groups_keys_appended_for_every_layer_at_once_store_what_each_layer_would(klr_dtype):
    """``append_layers`` (a decode step's flush: one batched projection for every layer) stores the same K_lr rows and
    scales, bit for bit, as appending each layer's keys on its own, for an odd rank and several layers (the batched
    matmul runs each layer's product as the single one does: so on x86 with torch's CPU BLAS; a BLAS that blocked
    them differently would move the float rows by rounding and flip an integer code at a boundary)."""
    torch.manual_seed(3)
    n_layers, n_kv_heads, head_dim, rank = 3, 2, 16, 7
    dims = ModelDims(n_layers=n_layers, hidden=6 * head_dim, n_heads=6, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     vocab=10)
    adapter = LowRankAdapter([torch.randn(n_kv_heads * head_dim, rank) for _ in range(n_layers)], n_kv_heads, head_dim)
    selectors = [LowRankSelector(adapter, rank, dims, 2, 64, 4, 5, PredictorConfig(klr_dtype=klr_dtype),
                                 torch.device("cpu")) for _ in range(2)]
    keys = torch.randn(n_layers, n_kv_heads, 4, head_dim)
    selectors[0].append_layers(1, 8, keys)
    for layer in range(n_layers):
        selectors[1].append(layer, 1, 8, keys[layer])
    assert selectors[0].k_lr.abs().sum() > 0
    assert torch.equal(selectors[0].k_lr, selectors[1].k_lr) and torch.equal(selectors[0].k_scale, selectors[1].k_scale)


def test_a_step_posts_or_shares_the_next_layers_scores_by_which_its_trial_steps_ran_shorter():
    """``PostOrShare``: the first steps of every cycle try posting, then sharing; the rest of the cycle keeps the one
    whose median step was shorter; a fixed choice is never timed."""
    choice, trial = aside_module.PostOrShare(), aside_module.PostOrShare.TRIAL_STEPS
    for cycle, (posted_s, shared_s) in enumerate([(0.05, 0.04), (0.03, 0.04)]):
        seen = []
        for _ in range(aside_module.PostOrShare.CYCLE_STEPS):
            seen.append(choice.posting)
            choice.took(posted_s if seen[-1] else shared_s)
        assert seen[: 2 * trial] == [True] * trial + [False] * trial
        assert set(seen[2 * trial :]) == {cycle == 1}  # shared ran shorter in the first cycle, posted in the second
    fixed = aside_module.PostOrShare(fixed=False)
    for _ in range(3 * trial):
        fixed.took(1.0)
        assert fixed.posting is False


@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
@pytest.mark.parametrize("G", [4, 3])
def test_sequences_longer_than_a_part_score_the_same_bits_on_either_thread(score_reduce, G, monkeypatch):
    """A sequence scores in parts of 1,024 tokens or more, whole groups and whole stored blocks of 64 (G=3: 1,152;
    runtime/native/ekv_score.c), each keeping its own softmax maximum and sum: the group scores are the same bits with
    no helper, shared with it and posted to it, and within float32 rounding of the torch path's (several parts and a
    short last one, two parts, one)."""
    monkeypatch.setattr(aside_module, "cores", lambda: 2)
    torch.manual_seed(13)
    lengths = [G * 700 + 3, G * 300 + 100, G * 40]
    selectors = filled_selectors("int4", score_reduce, 24, G, 3, lengths, picked_groups=9)
    q, counts = torch.randn(3, 6, 1, 16), np.array([n // G for n in lengths])
    (alone, groups, valid), (torch_scores, _, _) = both_paths(selectors, q, counts, monkeypatch)
    selector = selectors[0]
    inside = torch.from_numpy(np.arange(alone.shape[1]) < counts[:, None])
    torch.testing.assert_close(alone[inside], torch_scores[inside], rtol=2e-5, atol=1e-6)
    selector.aside = aside_module.AsideThread.open()
    selector._native_group_scores(0, q, counts, selector._group_scores)
    assert torch.equal(selector._group_scores[:, : int(counts.max())][inside], alone[inside])
    posted = selector.launch(0, q, counts)
    assert isinstance(posted, selector_module.ScoredAside)
    assert all(torch.equal(a, b) for a, b in zip(posted.result(), (groups, valid)))
    selector.aside.close()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 targets")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
@pytest.mark.parametrize("klr_dtype", ["int8", "int4"])
def test_the_scorer_built_for_narrower_vectors_scores_the_same(tmp_path, march, klr_dtype):
    """Built for SSE (plain integer loops) and AVX2 (int4 codes a byte at a time, vpmaddubsw), as a machine without
    AVX-512 VNNI builds it: the same integer dot products, so the same logits; the softmax's exponentials within
    float32 rounding (a target with FMA fuses them); the same picks.  Batch of two, lengths not whole blocks, rank 90
    (a quad padded, more quads than an int16 sum of AVX2 holds)."""
    from edgekv.runtime import native_build

    lib = native_build.LIBRARIES["score"]
    flags = [f if f != "-march=native" else f"-march={march}" for f in lib.flags]
    path = native_build.compile_units(lib, tmp_path / f"score-{march}.so", flags)
    narrower = dataclasses.replace(NATIVE, libraries={**NATIVE.libraries, "score": load_library("score", path)})
    torch.manual_seed(11)
    lengths = [333 * 4, 71 * 4 + 2]
    selectors = filled_selectors(klr_dtype, "softmax", 90, 4, 2, lengths, head_dim=64, n_kv_heads=3, n_heads=9,
                                 picked_groups=20, backends=(NATIVE, narrower))
    counts = torch.tensor([n // 4 for n in lengths])
    q = torch.randn(2, 9, 1, 64)
    results = []
    for selector in selectors:  # the native backend's scorer, then the narrower build's
        groups, valid = selector.select(0, q, counts)
        results.append((selector._group_scores[:, : int(counts.max())].clone(), groups, valid))
    (expected, expected_groups, expected_valid), (got, groups, valid) = results
    inside = torch.arange(got.shape[1]) < counts[:, None]
    torch.testing.assert_close(got[inside], expected[inside], rtol=1e-5, atol=1e-7)
    assert torch.equal(valid, expected_valid) and torch.equal(groups[valid], expected_groups[expected_valid])


def test_the_native_top_m_equals_torchs_topk_and_breaks_ties_to_the_lower_group():
    """The top-M in one native call (ekv_score.c ekv_top) against torch's topk (the torch backend's) over the same
    scores: rows of several counts (none, a few, all), groups before ``first`` and from a row's count on never picked,
    -inf never a pick, fewer candidates than M padded as none; equal scores go to the lower group."""
    selector, reference = filled_selectors("int8", "softmax", 8, 4, 3, [40, 40, 40], picked_groups=7)
    width = selector.max_groups
    generator = torch.Generator().manual_seed(5)
    for trial in range(60):
        scores = torch.randn(3, width, generator=generator)
        scores[scores < -1.2] = float("-inf")
        counts = np.array([width, 3, 0]) if trial == 0 else torch.randint(0, width + 1, (3,), generator=generator).numpy()
        first = trial % 3
        native_groups, native_valid = selector._top(scores.clone(), counts, first)
        torch_groups, torch_valid = reference._top(scores.clone(), counts, first)
        assert native_valid.shape == torch_valid.shape == (3, 7)
        assert torch.equal(native_valid, torch_valid) and torch.equal(native_groups[native_valid],
                                                                      torch_groups[torch_valid])
    groups, valid = selector._top(torch.zeros(1, width), np.array([9]), 2)  # every score the same
    assert groups[0][valid[0]].tolist() == [2, 3, 4, 5, 6, 7, 8]


def test_the_native_top_m_takes_the_best_then_the_lowest_groups_at_the_mth_score():
    """Scores of few values (many ties at the M-th best, where the quickselect's threshold falls), NaN and -inf
    among them, rows rising with the group (the order that made a heap of M sift at every candidate): the picks
    are the valid groups by score, then group, best first."""
    selector = filled_selector("int8", "softmax", 8, 4, 3, [40, 40, 40], picked_groups=7)
    width = selector.max_groups
    generator = torch.Generator().manual_seed(6)
    for trial in range(40):
        scores = torch.randint(0, 4, (3, width), generator=generator).float()
        scores[1] += torch.arange(width) / 4  # rising
        scores[torch.rand(3, width, generator=generator) < 0.1] = float("nan")
        scores[torch.rand(3, width, generator=generator) < 0.1] = float("-inf")
        counts = torch.randint(0, width + 1, (3,), generator=generator).numpy()
        first = trial % 4
        groups, valid = selector._top(scores.clone(), counts, first)
        for row in range(3):
            candidates = [g for g in range(first, min(int(counts[row]), width)) if scores[row, g] > float("-inf")]
            want = sorted(candidates, key=lambda g: (-scores[row, g].item(), g))[:7]
            assert groups[row][valid[row]].tolist() == want


@pytest.mark.parametrize("klr_dtype", ["float32", "int4"])
@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
def test_a_rows_scores_and_picks_are_the_same_bits_whatever_the_rows_beside_it(klr_dtype, score_reduce, monkeypatch):
    """Batch invariance: row 0's group scores and picks, on each path (native, posted to the helper, torch), are the
    bits it gets as the batch's longest row, whether the rows beside it are longer (a softmax over the batch's longest
    row's tokens let their lengths, and a freed row's stale K_lr past its own tokens, change row 0's votes) or not."""
    monkeypatch.setattr(aside_module, "cores", lambda: 2)
    torch.manual_seed(5)
    G = 4
    lengths = [G * 37 + 2, G * 300, G * 90 + 1]
    native, reference = filled_selectors(klr_dtype, score_reduce, 8, G, 3, lengths, picked_groups=9)
    q = torch.randn(3, 6, 1, 16)
    beside = np.array([n // G for n in lengths])
    alone = np.array([beside[0], 0, 0])  # the others present but empty: the batch's longest is row 0
    for selector in (native, reference):
        scores = []
        for counts in (alone, beside):
            groups, valid = selector.select(0, q, counts)
            scores.append((selector._group_scores[0, : beside[0]].clone(), groups[0][valid[0]].clone()))
        assert torch.equal(scores[0][0], scores[1][0]) and torch.equal(scores[0][1], scores[1][1])
    native.aside = aside_module.AsideThread.open()
    try:
        posted = [native.launch(0, q, counts).result() for counts in (alone, beside)]
    finally:
        native.aside.close()
    (groups_alone, valid_alone), (groups_beside, valid_beside) = posted
    assert torch.equal(groups_alone[0][valid_alone[0]], groups_beside[0][valid_beside[0]])
