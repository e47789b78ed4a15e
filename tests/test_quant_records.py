"""Quantized disk records (``kv_record_dtype``): what is read back is what quantizing in memory gives, through
every reader; the disk policies stay close to full within the codes' error; reads, reuse slots and the memory
plan shrink by the record size; the solver trades the measured loss of a record format against the I/O it saves."""
import numpy as np
import pytest
import torch

from edgekv.install import solver
from edgekv.runtime import BudgetError, ConfigError, Engine, RecordLayout, RuntimeConfig
from edgekv.runtime import quant
from edgekv.runtime.disk_store import DiskKVStore, aligned_zeros
from edgekv.runtime.model import ModelDims
from edgekv.runtime.ttft.prefill import TTFTOptions
from tests.conftest import files_under
from tests.test_disk_store import BACKENDS, reader_or_skip
from tests.test_exactness import EXACT, PROMPTS


def _reference_kv(k: torch.Tensor, v: torch.Tensor, fmt: quant.QuantFormat, G: int):
    """quantize -> dequantize in memory, group by group: [n, H, G, d] keys and values."""
    H, T, d = k.shape
    groups = [t.reshape(H, T // G, G, d).transpose(0, 1) for t in (k, v)]
    key_dim = -2 if G >= quant.KEY_CHANNEL_MIN_TOKENS else -1
    qk, qv = quant.quantize(groups[0], fmt, dim=key_dim), quant.quantize_values(groups[1], fmt)
    return (qk.dequantize(), quant.error_bound(qk)), (qv.dequantize(), quant.error_bound(qv)), groups


@pytest.mark.parametrize("G", [1, 8])
@pytest.mark.parametrize("record_dtype", ["int8", "int4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_records_read_back_through_every_reader_are_the_in_memory_dequantisation(kv_path, backend, record_dtype, G):
    reader = reader_or_skip(backend)
    layout = RecordLayout(G, n_kv_heads=2, head_dim=64, dtype=torch.float32, align_bytes=512, record_dtype=record_dtype)
    store = DiskKVStore(kv_path, n_layers=1, layout=layout, reader=reader)
    gen = torch.Generator().manual_seed(G)
    k = torch.randn(2, 6 * G, 64, generator=gen) * torch.linspace(0.1, 4, 64)  # channels of different ranges
    v = torch.randn(2, 6 * G, 64, generator=gen)
    try:
        store.open_sequence(0)
        store.write_groups(0, 0, 0, layout.pack(k, v))
        groups = np.array([4, 0, 5, 2])
        dest = aligned_zeros((len(groups), layout.stride_bytes), layout.align_bytes)
        store.read(store.batch(0, np.zeros(len(groups), np.int64), groups,
                               dest.ctypes.data + np.arange(len(groups)) * layout.stride_bytes))
        got = layout.decode(dest, torch.float32)  # [n, 2, H, G, d]
    finally:
        store.close()
        reader.close()
    (k_ref, k_bound), (v_ref, v_bound), (k_true, v_true) = _reference_kv(k, v, quant.quant_format(record_dtype), G)
    assert torch.equal(got[:, 0], k_ref[groups]) and torch.equal(got[:, 1], v_ref[groups])
    assert ((got[:, 0] - k_true[groups]).abs() <= k_bound[groups]).all()
    assert ((got[:, 1] - v_true[groups]).abs() <= v_bound[groups]).all()
    assert layout.record_bytes < RecordLayout(G, 2, 64, torch.float32, 512).record_bytes


def _run(model_dir, kv_path, policy, config, forced=None):
    with Engine.from_pretrained(model_dir, kv_path=kv_path, config=config,
                                policy=policy, device="cpu") as engine:
        results = engine.generate(PROMPTS, max_new_tokens=14, stop_token_ids=[], output_logits=True,
                                  teacher_forcing=forced)
    assert files_under(kv_path) == []
    return results


@pytest.fixture(scope="module")
def full_reference(model_dirs, tmp_path_factory):
    """full's logits with its own greedy tokens forced: every policy then predicts after the same inputs."""
    kv = tmp_path_factory.mktemp("kv-full")
    free = _run(model_dirs["llama"], kv, "full", EXACT)
    forced = [r.token_ids[:-1] for r in free]
    return forced, _run(model_dirs["llama"], kv, "full", EXACT, forced)


@pytest.mark.parametrize("policy", ["kvswap", "flexgen", "token"])
def test_disk_policies_with_quantized_records_stay_within_the_codes_error(model_dirs, kv_path, full_reference, policy):
    """Every value is within half a step of its code (range / (2 * levels)); the logits move by no more than a few
    such relative steps of their own scale, so int4's bound is 255/15 = 17 times int8's, and int8 keeps every token."""
    forced, reference = full_reference
    scale = max(float(r.logits.abs().max()) for r in reference)
    for record_dtype, min_agreement in (("int8", 1.0), ("int4", 0.9)):
        results = _run(model_dirs["llama"], kv_path, policy, {**EXACT, "kv_record_dtype": record_dtype}, forced)
        bound = 2 * scale / quant.quant_format(record_dtype).levels
        error = max(float((got.logits - ref.logits).abs().max()) for got, ref in zip(results, reference))
        agree = np.mean([a == b for got, ref in zip(results, reference) for a, b in zip(got.token_ids, ref.token_ids)])
        assert 0 < error <= bound, (record_dtype, error, bound)
        assert agree >= min_agreement, (record_dtype, agree)
        assert results[0].stats["config"]["kv_record_dtype"] == record_dtype


def test_bytes_read_per_step_shrink_by_the_record_size(model_dirs, kv_path):
    """flexgen reads every group every step, so its bytes differ only by the stride of a record."""
    config = {**EXACT, "G": 16, "M": 16, "C": 16, "io_align_bytes": 512}
    read = {}
    for record_dtype in ("auto", "fp16", "int8", "int4"):
        results = _run(model_dirs["llama"], kv_path, "flexgen", {**config, "kv_record_dtype": record_dtype})
        read[record_dtype] = sum(r.stats["kv_bytes_read"] for r in results)
    stride = {dt: RecordLayout(16, 2, 16, torch.float32, 512, dt).stride_bytes for dt in read}
    assert stride["int4"] < stride["int8"] < stride["fp16"] < stride["auto"]
    for record_dtype in read:
        assert read[record_dtype] * stride["auto"] == read["auto"] * stride[record_dtype]


def test_the_memory_plan_counts_the_quantized_stride_and_the_same_budget_holds_more_slots(model_dirs, kv_path):
    config = {**EXACT, "G": 16, "M": 16, "C": 16, "io_align_bytes": 512, "max_context": 1024}  # 64 groups: C up to 64
    plans = {}
    for record_dtype in ("auto", "int8"):
        with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, policy="kvswap",
                                    config={**config, "kv_record_dtype": record_dtype}, device="cpu") as engine:
            plans[record_dtype] = engine.memory_plan
            stride = RecordLayout(16, 2, 16, torch.float32, 512, record_dtype).stride_bytes
            assert plans[record_dtype].per_sequence_bytes["slots"] == 2 * 16 * stride  # C slots per layer, 2 layers
    assert plans["int8"].total_bytes < plans["auto"].total_bytes
    # the budget auto's 16 slots fill holds int8 records of 16 * stride ratio slots, which auto cannot have
    strides = {dt: RecordLayout(16, 2, 16, torch.float32, 512, dt).stride_bytes for dt in plans}
    more = {**config, "C": 16 * strides["auto"] // strides["int8"], "max_kv_mem_mib": plans["auto"].total_bytes / 2**20}
    assert more["C"] > 16
    with pytest.raises(BudgetError, match="max_kv_mem_mib"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, policy="kvswap", config=more, device="cpu")
    Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, policy="kvswap",
                           config={**more, "kv_record_dtype": "int8"}, device="cpu").close()


def test_a_bad_record_dtype_is_refused_by_name(model_dirs, kv_path):
    with pytest.raises(ConfigError, match="'kv_record_dtype' must be one of"):
        RuntimeConfig.load({"kv_record_dtype": "int3"})
    with pytest.raises(ConfigError, match="'kv_record_dtype' must be one of"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**EXACT, "kv_record_dtype": "q8"},
                               device="cpu")
    odd = ModelDims(n_layers=1, hidden=8, n_heads=1, n_kv_heads=1, head_dim=7, vocab=16)
    from edgekv.runtime.engine import _plan

    with pytest.raises(ConfigError, match="'kv_record_dtype' 'int4'.*even head_dim"):
        _plan("kvswap", RuntimeConfig.load({**EXACT, "kv_record_dtype": "int4"}), odd, torch.float32, 4)


def test_a_quantized_disk_policy_copies_a_stored_prefix_and_only_exact_records_attach(tmp_path, monkeypatch):
    """The context store keeps model precision; a disk policy whose records are int8 cannot read its blobs in place,
    so the prefix is copied (quantized) into its own files, and decodes as a run without the store does."""
    attached = []
    attach = DiskKVStore.attach_prefix
    monkeypatch.setattr(DiskKVStore, "attach_prefix",
                        lambda self, seq, blobs: attached.append(self.layout.record_dtype) or attach(self, seq, blobs))
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    for record_dtype in ("auto", "int8"):
        kv = tmp_path / f"kv-{record_dtype}"
        kv.mkdir()
        config = {"kv_record_dtype": record_dtype, "max_context": 1024}
        with Engine.from_pretrained("fixture", policy="kvswap", kv_path=kv,
                                    config=config, device="cpu") as plain:
            expected = plain.generate([ids], max_new_tokens=4)[0].token_ids
        with Engine.from_pretrained("fixture", policy="kvswap", kv_path=kv,
                                    config=config, device="cpu") as engine:
            store = engine.open_context_store(tmp_path / "store", chunk_tokens=128)
            engine.ttft = TTFTOptions("load_only")  # the prefix's KV from the store as it is (no compute planning)
            engine.save_context(ids[:256])
            out = engine.generate([ids], max_new_tokens=4)[0]
        assert store.layout.record_dtype == "auto"
        assert engine.prefill_stats[0]["stored_tokens"] == 256
        assert out.token_ids == expected
    assert attached == ["auto"]


SOLVER_DIMS = ModelDims(n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, vocab=256)  # the fixture's shape
RECORD_LOSSES = {G: {"fp16": 1.0, "int8": 1.002, "int4": 1.03} for G in (1, 2, 4, 8, 16)}  # a measured record table


def _solve_records(io_ms_per_byte, losses=RECORD_LOSSES, record_ppl_max=1.01, context=32768, batch=4):
    """The greedy solver on bf16 KV with an I/O time of bytes times a rate plus a cost per read."""
    limits = solver.Limits(io_align_bytes=512, record_losses=losses, record_ppl_max=record_ppl_max)

    def t_io(b, picked, G, hit, record_dtype="auto"):
        stride = RecordLayout(G, 2, 64, torch.bfloat16, 512, record_dtype).stride_bytes
        return SOLVER_DIMS.n_layers * b * picked * (1 - hit) * (stride * io_ms_per_byte + 1e-3)

    full = SOLVER_DIMS.n_layers * context * 2 * 2 * 64 * 2
    return solver.solve(batch, context, full / 13, SOLVER_DIMS, torch.bfloat16, limits, t_io,
                        lambda b, S, rank, picked, G, reuse=True: 2.0 * b,
                        lambda G, C, picked: min(0.9, 0.5 * C / picked))


def _stride(sol):
    return RecordLayout(sol.G, 2, 64, torch.bfloat16, 512, sol.kv_record_dtype).stride_bytes


def test_the_solver_keeps_exact_records_on_a_fast_disk_and_picks_smaller_ones_on_a_slow_one():
    fast = _solve_records(1e-6)
    assert fast.hidden and fast.kv_record_dtype == "auto"
    slow = _solve_records(2e-5)
    assert slow.hidden and slow.kv_record_dtype == "int8"
    assert _stride(slow) < RecordLayout(slow.G, 2, 64, torch.bfloat16, 512).stride_bytes
    assert _solve_records(2e-5, losses={}).kv_record_dtype == "auto"  # no record table: exact records only
    slowest = _solve_records(1e-4)  # nothing hides it: the least exposed I/O among formats within the loss bound
    assert slowest.kv_record_dtype == "int8" and not slowest.hidden
    looser = _solve_records(1e-4, record_ppl_max=1.05)
    assert looser.kv_record_dtype == "int4" and looser.t_io_ms < slowest.t_io_ms


def test_with_a_quality_target_a_record_format_counts_its_loss_against_the_points():
    from edgekv.install.quality import QualityPoint

    points = [QualityPoint(8192, 8, 1600, 4.0, 0, 0, 1.01, 0.99)]
    full = SOLVER_DIMS.n_layers * 8192 * 2 * 2 * 64 * 2

    def solve(target, io_ms):
        limits = solver.Limits(io_align_bytes=512, quality_target=target, record_losses=RECORD_LOSSES)
        return solver.solve_for_quality(
            2, 8192, full / 4, SOLVER_DIMS, torch.bfloat16, limits, points,
            lambda b, picked, G, hit, record="auto":
                io_ms * RecordLayout(G, 2, 64, torch.bfloat16, 512, record).stride_bytes,
            lambda b, S, rank, picked, G, reuse=True: 1.0, lambda G, C, picked: 0.0)

    assert solve(1.05, 1e-6).kv_record_dtype == "auto"  # hidden either way: the lower loss
    slow = solve(1.05, 1e-3)
    assert slow.kv_record_dtype == "int4" and slow.ppl_ratio == pytest.approx(1.01 * 1.03)
    assert solve(1.02, 1e-3).kv_record_dtype == "int8"  # int4's loss would break the target


def test_eval_rows_repeat_per_record_dtype_with_the_same_configuration():
    from edgekv.cli import _record_dtypes
    from edgekv.evals.harness import Variant, budget_config

    assert _record_dtypes("int8,int4") == ["auto", "int8", "int4"]
    with pytest.raises(ValueError, match="--record-dtype int3: \\['int3'\\] unknown"):
        _record_dtypes("int3")
    exact, int8 = Variant("kvswap", 1 / 13), Variant("kvswap", 1 / 13, record_dtype="int8")
    assert (exact.label, int8.label) == ("kvswap@1/13", "kvswap@1/13,int8")
    assert Variant("flexgen", record_dtype="int4").label == "flexgen,int4"
    configs = [budget_config(v, 4096, SOLVER_DIMS, torch.float32, 2) for v in (exact, int8)]
    assert configs[1]["kv_record_dtype"] == "int8" and configs[0]["kv_record_dtype"] == "auto"
    assert {k: v for k, v in configs[1].items() if k != "kv_record_dtype"} == \
        {k: v for k, v in configs[0].items() if k != "kv_record_dtype"}


def test_bench_runs_each_disk_row_per_record_dtype_and_reads_less(tmp_path):
    import json

    from edgekv.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "fixture", "--batches", "1", "--contexts", "512", "--budgets", "1/4",
                 "--steps", "2", "--warmup", "1", "--disk-seconds", "0.5", "--kv-path", str(tmp_path),
                 "--policies", "full,flexgen", "--record-dtype", "int8", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    runs = {r["policy"]: r for r in data["runs"]}
    assert list(runs) == ["full", "flexgen", "flexgen,int8"] and data["meta"]["record_dtypes"] == ["auto", "int8"]
    assert (runs["flexgen"]["kv_record_dtype"], runs["flexgen,int8"]["kv_record_dtype"]) == ("auto", "int8")
    stride = {dt: RecordLayout(runs["flexgen"]["G"], 2, 64, torch.float32, 4096, dt).stride_bytes for dt in ("auto", "int8")}
    assert stride["int8"] < stride["auto"]
    assert runs["flexgen,int8"]["read_bytes_per_token"] / runs["flexgen"]["read_bytes_per_token"] == \
        pytest.approx(stride["int8"] / stride["auto"])


def test_the_record_table_measures_each_format_alone_and_feeds_the_solvers_choices(tmp_path):
    """flexgen over every group with the format's records: the perplexity ratio to full is the format's loss;
    the solver reads it per G (the nearest measured one) and gates it by record_ppl_max."""
    import yaml

    from edgekv.install import quality
    from edgekv.install.profile import PROFILES_DIR, ProfileError, load_profile

    calls = []

    def scorer(policy, config):
        calls.append((policy, config))
        per_g = {1: {"fp16": 0.9999, "int8": 1.004, "int4": 1.05}, 16: {"fp16": 1.0, "int8": 1.02, "int4": 1.3}}
        return {"ppl_ratio": per_g[config["G"]][config["kv_record_dtype"]]}

    table = quality.record_table(scorer, 1024, [1, 16])
    assert {p for p, _ in calls} == {"flexgen"} and all(c["max_context"] >= 1024 and not c["reuse"] for _, c in calls)
    assert set(table) == {1, 16} and table[16]["int4"] > table[1]["int4"] > table[1]["int8"]
    limits = solver.Limits(record_losses=table, record_ppl_max=1.01)
    assert solver.record_choices(limits, 1) == [("auto", 1.0), ("fp16", 1.0), ("int8", 1.004)]  # below 1 is noise
    assert [dt for dt, _ in solver.record_choices(limits, 8)] == ["auto", "fp16"]  # nearest measured G: 16
    assert [dt for dt, _ in solver.record_choices(limits, 8, gated=False)] == ["auto", "fp16", "int8", "int4"]
    data = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    data["solver"].update(record_dtypes=["int8", "int4"], record_ppl_max=1.02)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    prof = load_profile(tmp_path / "p.yaml")
    assert (prof.record_dtypes, prof.record_ppl_max) == (("int8", "int4"), 1.02)
    data["solver"]["record_dtypes"] = ["int3"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="'solver.record_dtypes'"):
        load_profile(tmp_path / "p.yaml")


@pytest.mark.parametrize("record_bytes, page_bytes, block_bytes, align", [
    (1584, 4096, 512, 2048),  # SmolLM2's int4 record of 4 tokens: half a page
    (2352, 4096, 512, 4096),  # its int8 record: a 2,560-byte stride would straddle pages
    (300, 4096, 512, 512),  # never below the disk's block
    (12288, 4096, 512, 4096),  # a record of pages pads to whole pages
    (1584, 4096, 4096, 4096),  # a disk of 4 KiB blocks: pages only
    (1584, 4096, 8192, 4096),  # a block larger than the page: the page
])
def test_a_record_shorter_than_a_page_pads_to_the_power_of_two_that_holds_it(record_bytes, page_bytes, block_bytes,
                                                                               align):
    from edgekv.runtime.disk_store import record_align_bytes

    assert record_align_bytes(record_bytes, page_bytes, block_bytes) == align
    layout = RecordLayout.padded(4, 3, 64, torch.bfloat16, "int4", 4096, 512)
    assert (layout.record_bytes, layout.align_bytes, layout.stride_bytes) == (1584, 2048, 2048)
    assert RecordLayout.padded(4, 3, 64, torch.bfloat16, "int4", 4096).stride_bytes == 4096  # no block: whole pages


def test_records_padded_from_the_disks_block_let_the_int4_twin_hold_a_reuse_buffer():
    """SmolLM2 at 8K within 1/13 of its float32 KV (the local profile's budget): the point that meets the target (int8
    K_lr at sigma 2) fits no reuse buffer, nor does its int4 twin with records padded to 4 KiB; padded from the
    disk's 512-byte block, the twin's int4 records (1,584 bytes) take 2 KiB slots and a reuse buffer fits, so the
    solver takes it: fewer reads exposed.  The deploy writes the solution's alignment (``io_align_bytes``)."""
    from edgekv.install.quality import QualityPoint

    dims = ModelDims(n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, vocab=49152)
    budget = dims.n_layers * 8192 * 2 * 3 * 64 * 4 / 13
    point = QualityPoint(8192, 4, 820, 2.0, 0, 0, 0.945, 0.925, "int8", "corrected", 0.85)
    twin = QualityPoint(8192, 4, 820, 2.0, 0, 0, 0.95, 0.92, "int4", "corrected", 0.85)
    losses = {4: {"int8": 1.0, "int4": 1.005}}

    def solve(block_bytes, points=(point, twin)):
        limits = solver.Limits(quality_target=1.05, quality_top1_min=0.9, record_losses=losses, block_bytes=block_bytes)
        return solver.solve_for_quality(4, 8192, budget, dims, torch.bfloat16, limits, list(points),
                                        lambda b, picked, G, hit, record="auto": 100.0 * b * (1 - hit),
                                        lambda b, S, rank, picked, G, reuse=True: 20.0, lambda G, C, picked: 0.75)

    paged = solve(None)
    assert not paged.reuse and paged.io_align_bytes == 4096
    padded = solve(512)
    assert (padded.reuse, padded.klr_dtype, padded.kv_record_dtype, padded.io_align_bytes) == (True, "int4", "int4", 2048)
    assert padded.C >= padded.M and padded.bytes_per_sequence <= budget and padded.quality_met
    assert padded.ppl_ratio == pytest.approx(0.95 * 1.005)
    assert not solve(512, points=(point,)).reuse  # without the twin the int8 rows leave no room


def test_the_config_ab_bench_alternates_whole_configurations_each_on_its_own_engine(capsys):
    """``python -m bench.config_ab`` on the fixture: the exact-record configuration beside one with a reuse buffer,
    int4 K_lr and int4 records, each its own engine on the same prompts; the second reads less and holds less."""
    import re

    from bench.config_ab import main

    main(["--model", "fixture", "--context", "200", "--batch", "2", "--kvswap", "G=4,M=6,C=6,sigma=2",
          "--extra", '{"reuse": false}', "--variants",
          '[{}, {"C": 8, "reuse": true, "klr_dtype": "int4", "kv_record_dtype": "int4", "io_align_bytes": 512}]',
          "--rounds", "2", "--steps", "2"])
    rows = re.findall(r"^variant (\d) .*: median ([\d.]+) ms a step \(([\d., ]+)\); ([\d.]+) x variant 0's tok/s; "
                      r"(\d+) requests, ([\d.]+) MiB read a step; resident KV ([\d.]+) MiB", capsys.readouterr().out, re.M)
    assert [row[0] for row in rows] == ["0", "1"] and float(rows[0][3]) == 1.0
    assert all(float(row[1]) > 0 and len(row[2].split(", ")) == 2 for row in rows)
    assert int(rows[1][4]) < int(rows[0][4]) and float(rows[1][6]) < float(rows[0][6])


def test_a_config_ab_variant_may_run_its_model_in_another_dtype(capsys, monkeypatch):
    """A variant's ``dtype`` is its model's, not a configuration field: each engine is loaded in its own."""
    import bench.config_ab as config_ab
    from edgekv.runtime import Engine

    loaded = []
    real = Engine.from_pretrained.__func__
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(
        lambda cls, *a, **kw: loaded.append((kw["dtype"], "dtype" in kw["config"])) or real(cls, *a, **kw)))
    config_ab.main(["--model", "fixture", "--context", "120", "--batch", "1", "--kvswap", "G=4,M=6,C=6,sigma=2",
                    "--dtype", "float32", "--variants", '[{}, {"dtype": "bfloat16"}]', "--rounds", "1", "--steps", "1"])
    assert loaded == [("float32", False), ("bfloat16", False)]
    assert 'variant 1 {"dtype": "bfloat16"}' in capsys.readouterr().out
