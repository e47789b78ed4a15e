"""The install step: profiles, platform detection, the solver, the I/O model, solutions at runtime, deploy."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from edgekv.install import solver, tables
from edgekv.install.disk import DiskPoint, DiskProfile
from edgekv.install.iomodel import io_model
from edgekv.install.profile import PROFILES_DIR, ProfileError, load_profile
from tests.conftest import tiny_deploy_profile
from edgekv.platforms.detect import detect_platform
from edgekv.runtime import ConfigError, Engine, RecordLayout, RuntimeConfig
from edgekv.runtime.memory import plan_memory
from edgekv.runtime.model import ModelDims
from edgekv.runtime.slots import replay_hit_rate
from edgekv.runtime.solutions import SolutionTable, load_deployed

DIMS = ModelDims(n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, vocab=256)
LIMITS = solver.Limits(io_align_bytes=512)


def _full_bytes(context):
    return DIMS.n_layers * context * 2 * DIMS.n_kv_heads * DIMS.head_dim * 4


# ---- profiles ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["local", "orin", "rtx", "smartssd"])
def test_shipped_profiles_load(name):
    prof = load_profile(name)
    assert prof.platform == name and prof.sigma_max == 32 and prof.g_max == 16 and prof.mg_const == 400
    assert prof.batch_budget_mib == prof.max_kv_mem_mib / prof.max_batch
    assert prof.weights == (("ggml", "int4") if name == "local" else ()) and prof.weights_ppl_max == 1.01


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["solver"].update(sigma_mx=8), "unknown field 'solver.sigma_mx'"),
    (lambda d: d["memory"].update(max_batch="four"), "field 'memory.max_batch' must be int"),
    (lambda d: d.pop("model"), "missing required field 'model'"),
    (lambda d: d["compute"].update(device="npu"), "field 'compute.device' is 'npu'; allowed values"),
    (lambda d: d["solver"].update(alpha=1.5), "field 'solver.alpha' must be in"),
    (lambda d: d.pop("memory"), "missing section 'memory'"),
    (lambda d: d["compute"].update(weights=["int4", "native"]), r"field 'compute.weights' lists .* \['int8', 'int4', 'ggml'\]"),
    (lambda d: d["compute"].update(weights_ppl_max=0.9), "field 'compute.weights_ppl_max' is a perplexity ratio"),
    (lambda d: d["compute"].update(dtype_ppl_max=0.99), "field 'compute.dtype_ppl_max' is a perplexity ratio to float32"),
    (lambda d: d["compute"].update(dtype="int8"), "field 'compute.dtype' is 'int8'; allowed values"),
])
def test_bad_profile_names_file_and_field(tmp_path, edit, message):
    data = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    edit(data)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=message) as err:
        load_profile(path)
    assert str(path) in str(err.value)


def _profile_with(tmp_path, platform: str, **memory) -> Path:
    data = yaml.safe_load((PROFILES_DIR / f"{platform}.yaml").read_text())
    data["memory"] = {k: v for k, v in {**data["memory"], **memory}.items() if v is not None}
    path = tmp_path / f"{platform}-{len(memory)}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_platform_says_where_a_gpus_slots_live_and_the_profile_may_say_otherwise(tmp_path):
    """Unified memory (a Jetson): the GPU reads pinned host slots in place; a discrete card gets device slots fed by
    copies; a profile's memory.slot_memory overrides either way."""
    from edgekv.platforms.devices import platform_for

    assert platform_for(load_profile("orin")).slot_memory == "mapped"
    assert platform_for(load_profile(_profile_with(tmp_path, "orin", slot_memory=None))).slot_memory == "mapped"
    assert platform_for(load_profile("rtx")).slot_memory == "device"
    assert platform_for(load_profile(_profile_with(tmp_path, "rtx", slot_memory="mapped"))).slot_memory == "mapped"
    with pytest.raises(ProfileError, match=r"field 'memory.slot_memory' is 'zero-copy'; allowed values: \['device', "
                                           r"'mapped'\]"):
        load_profile(_profile_with(tmp_path, "rtx", slot_memory="zero-copy"))


def test_mapped_slots_on_the_cpu_are_its_host_slots_and_give_the_same_tokens(tmp_path):
    from edgekv.runtime.slot_memory import HostSlots

    prompts = [[(i * 7) % 250 + 4 for i in range(150)]]
    config = {"G": 4, "M": 12, "C": 24, "max_context": 256, "max_batch": 1}
    tokens = []
    for placement in ("device", "mapped"):
        (tmp_path / placement).mkdir()
        with Engine.from_pretrained("fixture", kv_path=tmp_path / placement, policy="kvswap", device="cpu",
                                    config={**config, "slot_memory": placement}) as engine:
            tokens.append(engine.generate(prompts, max_new_tokens=6, stop_token_ids=[])[0].token_ids)
            with engine.open_batch(1, 256) as batch:
                assert isinstance(batch.policy.slot_memory, HostSlots)
    assert tokens[0] == tokens[1]


def test_unknown_platform_lists_the_known_ones():
    with pytest.raises(ProfileError, match=r"no profile for platform 'jetson'.*'local'"):
        load_profile("jetson")


# ---- detection --------------------------------------------------------------------------------

@pytest.mark.parametrize("files, expected", [
    ({"etc/nv_tegra_release": "# R36 (release), REVISION: 4.3"}, "orin"),
    ({"proc/device-tree/model": "NVIDIA Jetson AGX Orin Developer Kit\0"}, "orin"),
    ({"proc/driver/nvidia/gpus/0000:01:00.0/information": "Model: NVIDIA GeForce RTX 4090"}, "rtx"),
    ({"sys/bus/pci/drivers/xocl/0000:3b:00.1/uevent": "DRIVER=xocl"}, "smartssd"),
    ({"proc/cpuinfo": "model name: x"}, "local"),
])
def test_detect_platform_from_a_fake_tree(tmp_path, files, expected):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert detect_platform(tmp_path) == expected


# ---- memory fit and solver --------------------------------------------------------------------

def _plan_bytes(fit, context):
    cfg = RuntimeConfig.from_flat({"G": fit.G, "M": fit.M, "C": fit.C, "sigma": fit.sigma, "max_batch": 1,
                                   "max_context": context, "reuse": fit.reuse, "io_align_bytes": 512})
    stride = RecordLayout(fit.G, 2, 64, torch.float32, 512).stride_bytes
    return plan_memory("kvswap", cfg, DIMS, 4, fit.rank, stride).total_bytes


def test_fit_keeps_mg_const_when_the_budget_allows_and_takes_the_smallest_sigma():
    budget = _full_bytes(32768) / 13
    fit = solver.fit_memory(budget, DIMS, torch.float32, LIMITS, 32768, G=4)
    assert (fit.M * fit.G, fit.mg_scaled) == (400, False)
    assert _plan_bytes(fit, 32768) <= budget
    smaller = [s for s in solver.SIGMAS if s < fit.sigma]
    if smaller:  # the next smaller sigma would not fit
        tighter = solver.fit_memory(budget, DIMS, torch.float32, solver.Limits(io_align_bytes=512, sigma_max=smaller[-1]),
                                    32768, G=4)
        assert tighter is None or tighter.mg_scaled


def test_fit_scales_mg_down_at_short_contexts_and_prefers_shared_buffers_when_slots_cost_tokens():
    budget = _full_bytes(4096) / 34
    with_reuse = solver.fit_memory(budget, DIMS, torch.float32, LIMITS, 4096, G=4)
    assert with_reuse.mg_scaled and with_reuse.M * 4 < 400 and _plan_bytes(with_reuse, 4096) <= budget
    best = solver.quality_fit(budget, DIMS, torch.float32, LIMITS, 4096, G=4)
    assert best.reuse is False and best.M > with_reuse.M and _plan_bytes(best, 4096) <= budget
    assert solver.fit_memory(1000, DIMS, torch.float32, LIMITS, 4096, G=4) is None


def _solve(io_ms_per_byte, io_ms_per_read=1e-4, budget_fraction=1 / 13, context=32768, batch=4):
    def t_io(b, picked, G, hit, record_dtype="auto"):
        stride = RecordLayout(G, 2, 64, torch.float32, 512, record_dtype).stride_bytes
        return DIMS.n_layers * b * picked * (1 - hit) * (stride * io_ms_per_byte + io_ms_per_read)

    def t_model(b, S, rank, picked, G, reuse=True):
        return 2.0 * b

    reuse = lambda G, C, picked: min(0.9, 0.5 * C / picked)  # noqa: E731
    return solver.solve(batch, context, _full_bytes(context) / budget_fraction ** -1, DIMS, torch.float32, LIMITS,
                        t_io, t_model, reuse)


def test_solver_takes_the_smallest_group_size_that_hides_the_io():
    fast = _solve(1e-7)
    assert fast.hidden and fast.G == 1
    slower = _solve(2e-6, io_ms_per_read=1e-3)  # per-read cost: bigger groups, fewer reads
    assert slower.hidden and slower.G == 2
    assert (1 - LIMITS.alpha) * slower.t_io_ms <= slower.t_model_ms


def test_solver_moves_budget_into_the_reuse_buffer_when_no_group_size_hides_the_io():
    sol = _solve(5e-4)
    assert sol.C > sol.M and sol.reuse


def test_solver_refuses_a_budget_without_room_for_one_group():
    with pytest.raises(ValueError, match="max_kv_mem_mib"):
        _solve(1e-6, budget_fraction=1e-6, context=1024)


def test_io_model_is_bytes_over_profiled_bandwidth():
    disk = DiskProfile("/x", {}, "fio io_uring", "io_uring", True, 1.0,
                       [DiskPoint(4096, 32, 100.0, 120.0), DiskPoint(16384, 32, 400.0, 500.0)])
    t_io = io_model(disk, DIMS, torch.float32, 512, 32)
    stride = RecordLayout(4, 2, 64, torch.float32, 512).stride_bytes  # 4 KiB
    assert t_io(2, 10, 4, 0.0) == pytest.approx(4 * 2 * 10 * stride / (100 * 2**20) * 1e3)
    assert t_io(2, 10, 4, 0.5) == pytest.approx(t_io(2, 10, 4, 0.0) / 2)
    assert disk.read_mib_s(8192, 32) == pytest.approx(250.0)  # log-linear between 4K and 16K


def test_a_gap_is_read_through_while_its_bytes_cost_less_than_a_request():
    """fio's rates of this machine's virtio disk at queue depth 32 (install/disk.profile_disk in a deploy: 360.9,
    751.3 and 1383.3 MiB/s at 4, 16 and 64 KiB): over 4-16 KiB a request costs ~7.6 us over its bytes at ~0.81 us a
    KiB, so gaps up to ~9 KiB (2 records of 4 KiB) are read through.  A profile without fio figures plans with the
    reader's."""
    from edgekv.install.iomodel import gap_bytes

    def disk(rates):
        return DiskProfile("/x", {}, "fio io_uring", "io_uring", True, 1.0,
                           [DiskPoint(size, 32, rate) for size, rate in rates.items()])

    virtio = disk({4096: 360.9, 16384: 751.3, 65536: 1383.3})
    assert 9 * 1024 < gap_bytes(virtio, 4096, 32) < 10 * 1024
    assert gap_bytes(virtio, 4096, 32) // 4096 == 2
    # the reader's rates above fio's (another profile of the same disk): fio's decide
    both = DiskProfile("/x", {}, "fio io_uring", "io_uring", True, 1.0,
                       [DiskPoint(4096, 32, 241.7, 358.1), DiskPoint(16384, 32, 1000.0, 800.1)])
    assert gap_bytes(both, 4096, 32) // 4096 == 2
    reader_only = DiskProfile("/x", {}, "fio io_uring", "io_uring", True, 1.0,
                              [DiskPoint(4096, 32, 241.7), DiskPoint(16384, 32, 1000.0)])
    assert gap_bytes(reader_only, 4096, 32) == 4 * 4096  # 16 KiB no dearer than 4: a span's worth
    nvme = disk({4096: 1500.0, 16384: 2250.0})  # a request ~1.2 us over its bytes, a record 1.4 us: no gap
    assert gap_bytes(nvme, 4096, 32) < 4096
    assert gap_bytes(disk({4096: 500.0, 65536: 500.0}), 4096, 32) == 0  # bytes alone cost: never read a gap
    assert gap_bytes([virtio, virtio], 4096, 32) == gap_bytes(virtio, 4096, 32)  # two paths on one device: its rate


def test_reuse_replay_counts_fifo_hits():
    picks = [(0, np.array([[0, 1]]), np.ones((1, 2), bool)),
             (0, np.array([[1, 2]]), np.ones((1, 2), bool)),
             (0, np.array([[0, 3]]), np.ones((1, 2), bool))]
    # capacity 2: step 2 hits group 1; step 3: 0 was evicted by 2 -> no hits
    assert replay_hit_rate(picks, 1, 1, 2, 8, "fifo") == pytest.approx(1 / 6)
    # capacity 4 keeps everything: hits 1 and then 0
    assert replay_hit_rate(picks, 1, 1, 4, 8, "fifo") == pytest.approx(2 / 6)
    assert tables.reuse_rate({4: {1.0: 0.5, 2.0: 0.7}}, 4, 15, 10) == pytest.approx(0.6)


# ---- solutions at runtime ---------------------------------------------------------------------

def _deployed(tmp_path, **extra):
    base = {"platform": "local", "model": "m", "alpha": 0.1, "G": 4, "M": 8, "C": 8, "sigma": 4, "max_batch": 2,
            "max_context": 512, "max_kv_mem_mib": 64, "measurements": {},
            "solutions": [{"batch": 1, "context": 256, "G": 2, "M": 6, "C": 6, "sigma": 4, "reuse": False},
                          {"batch": 2, "context": 512, "G": 4, "M": 8, "C": 8, "sigma": 4, "reuse": True}], **extra}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    return path


def test_solution_table_takes_the_smallest_covering_pair_else_the_nearest(tmp_path):
    base, table = load_deployed(_deployed(tmp_path))
    assert base.G == 4 and isinstance(table, SolutionTable)
    assert table.pick(1, 200).G == 2 and table.pick(1, 200).max_context == 256
    assert table.pick(2, 200).G == 4
    assert table.pick(1, 400).G == 4
    assert table.pick(4, 4000).G == 4  # nothing covers it: nearest
    assert table.pick(1, 200).max_kv_mem_mib == pytest.approx(32)  # B_max / b_max per sequence
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['colour'\]"):
        load_deployed(_deployed(tmp_path, colour="red"))


def test_each_solution_keeps_its_own_record_alignment_and_so_the_memory_it_was_solved_for(tmp_path):
    """A row solved at another G than the top row's has its own ``io_align_bytes`` (a G=2 record of the fixture is
    1 KiB where G=4's takes 2 KiB): run at the top row's, its slots took twice the bytes the solver counted, and a
    deploy whose solver picked such a row failed its own smoke run's budget check (1.04 of 1 MiB)."""
    base, table = load_deployed(_deployed(tmp_path, io_align_bytes=2048, solutions=[
        {"batch": 1, "context": 256, "G": 2, "M": 6, "C": 6, "sigma": 4, "reuse": True, "io_align_bytes": 1024},
        {"batch": 2, "context": 512, "G": 4, "M": 8, "C": 8, "sigma": 4, "reuse": True, "io_align_bytes": 2048}]))
    assert base.io.io_align_bytes == 2048
    assert table.pick(1, 200).io.io_align_bytes == 1024 and table.pick(2, 500).io.io_align_bytes == 2048


def test_engine_runs_each_batch_with_its_solution(model_dirs, kv_path, tmp_path):
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=_deployed(tmp_path),
                                device="cpu") as engine:
        one = engine.generate([[t % 150 + 3 for t in range(150)]], max_new_tokens=4, stop_token_ids=[])[0]
        two = engine.generate([[t % 150 + 3 for t in range(300)], [t % 150 + 5 for t in range(200)]], max_new_tokens=4,
                              stop_token_ids=[])
    assert (one.stats["config"]["G"], one.stats["config"]["reuse"], one.stats["config"]["max_context"]) == (2, False, 256)
    assert (two[0].stats["config"]["G"], two[0].stats["config"]["M"]) == (4, 8)


# ---- deploy end to end ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    return root, tiny_deploy_profile(root, "tiny", [root / "kv"], max_batch=2, context_min=512, disk_seconds=1)


def test_deploy_writes_config_report_and_smoke_stats_and_reuses_only_matching_profiles(tiny_profile, capsys):
    from edgekv.cli import main

    root, path = tiny_profile
    args = ["deploy", "--platform", str(path), "--model", "fixture"]
    out_root = root / "out"
    import edgekv.deploy as deploy

    logs = []
    result = deploy.run(str(path), "fixture", out_root=out_root, cache_dir=root / "cache", log=logs.append)
    config = json.loads((out_root / "local" / "config.json").read_text())
    for key in ("platform", "model", "G", "M", "sigma", "C", "alpha", "max_kv_mem_mib", "max_batch", "max_context",
                "solutions", "measurements"):
        assert key in config, key
    assert config["slot_memory"] == "device"  # the local platform's (no unified memory)
    assert {(s["batch"], s["context"]) for s in config["solutions"]} == {(b, c) for b in (1, 2) for c in (512, 1024)}
    assert all(s["bytes_per_sequence"] <= 1 * 2**20 for s in config["solutions"])  # 2 MiB / 2 sequences
    assert config["measurements"]["disk"]["points"] and config["measurements"]["compute"]["predict_ms"]
    costs = json.loads(Path(config["ttft_costs_path"]).read_text())  # the chunk predictor for stored contexts
    assert costs["predictor"]["kind"] == "fit" and config["measurements"]["chunk_compute_errors"]["layer"]["held_out"]
    assert (out_root / "local" / "report.txt").is_file() and (out_root / "local" / "disk.png").is_file()
    unit = (out_root / "local" / "edgekv.service").read_text()  # systemd serves this deploy (edgekv serve)
    assert f"serve --config {(out_root / 'local' / 'config.json').resolve()} --host 127.0.0.1" in unit
    assert result["stats"]["decode_tok_s"] > 0 and result["stats"]["kv_resident_mib"] <= 2
    assert not list((root / "kv").iterdir())  # no test file or KV left behind
    # the profile's weight formats were measured against the model's own weights, fastest first, and the first within
    # the limit deployed; ggml without its library (make ggml) is a trial that names why and is never chosen
    ggml, int4 = config["measurements"]["weights"]["trials"]
    assert (ggml["weights"], int4["weights"]) == ("ggml", "int4")
    if ggml["ppl_ratio"] is None:
        assert "make ggml builds it" in ggml["note"] and not ggml["chosen"]
    for trial in (t for t in (ggml, int4) if t["ppl_ratio"] is not None):
        assert trial["ppl_ratio"] > 0 and 0 < trial["top1_agreement"] <= 1
    within = [t["weights"] for t in (ggml, int4) if t["ppl_ratio"] is not None and t["ppl_ratio"] <= 1.01]
    assert [t["weights"] for t in (ggml, int4) if t["chosen"]] == within[:1]
    assert config["weights"] == (within[0] if within else "native")
    assert config["measurements"]["compute"]["block_ms"] and f"weights: {config['weights']}" in \
        (out_root / "local" / "report.txt").read_text()
    # the profile's bfloat16 was measured against float32 on this CPU, in the weight format chosen, and deployed only
    # where it held and ran faster
    base, tried = config["measurements"]["dtype"]["trials"]
    assert (base["dtype"], base["ppl_ratio"], tried["dtype"]) == ("float32", 1.0, "bfloat16")
    assert tried["chosen"] == (tried["ppl_ratio"] <= 1.01 and tried["step_ms"] < base["step_ms"])
    assert config["dtype"] == config["measurements"]["compute"]["dtype"].removeprefix("torch.") == \
        ("bfloat16" if tried["chosen"] else "float32")
    assert f"dtype: {config['dtype']}" in (out_root / "local" / "report.txt").read_text()

    logs.clear()
    deploy.run(str(path), "fixture", out_root=out_root, cache_dir=root / "cache", log=logs.append, smoke=False)
    assert any(line.startswith("disk: reusing") for line in logs) and any(line.startswith("compute: reusing") for line in logs)
    logs.clear()
    deploy.run(str(path), "fixture", out_root=out_root, cache_dir=root / "cache", log=logs.append, smoke=False,
               disk_seconds=0.5)
    assert any("disk: cached profile is for another seconds" in line for line in logs)
    assert any(line.startswith("compute: reusing") for line in logs)


def test_deploy_smartssd_scorers_on_a_host_without_the_card_say_the_scoring_is_emulated(tiny_profile, monkeypatch):
    import edgekv.deploy as deploy

    root, path = tiny_profile
    data = yaml.safe_load(path.read_text())
    data["scorers"] = ["cpu", "smartssd"]
    data["memory"]["max_kv_mem_mib"] = 64  # room for the smoke run's hillinfer slots
    mine = root / "smartssd-scorers.yaml"
    mine.write_text(yaml.safe_dump(data))
    monkeypatch.setattr(deploy, "detect_platform", lambda: "local")  # no card on this host
    logs = []
    result = deploy.run(str(mine), "fixture", out_root=root / "out", cache_dir=root / "cache", log=logs.append)
    config = json.loads((root / "out" / "local" / "config.json").read_text())
    assert config["measurements"]["scoring"]["scorer_backend"] == "csim (emulated)" and config["beta"] > 0
    assert config["scorer_backend"] == "csim (emulated)"
    assert any(line.startswith("WARNING: no SmartSSD") for line in logs)
    assert result["stats"]["policy"] == "hillinfer" and result["stats"]["scorer_backend"] == "csim (emulated)"
    report = (root / "out" / "local" / "report.txt").read_text()
    assert "in-storage scorer csim (emulated)" in report and "not the card's" in report


# ---- quality first ----------------------------------------------------------------------------

def _point(mg, sigma, ppl, S=0, W=0, G=4, context=8192):
    from edgekv.install.quality import QualityPoint
    return QualityPoint(context, G, mg, sigma, S, W, ppl, 1.0 - (ppl - 1.0))


SYNTHETIC = [_point(400, 16, 2.5), _point(400, 4, 1.3), _point(1600, 8, 1.04, 4, 64), _point(1600, 1, 1.01, 4, 64),
             _point(400, 1, 1.08, 4, 64)]


def _solve_quality(budget_fraction, target, logs=None, points=SYNTHETIC):
    limits = solver.Limits(io_align_bytes=512, quality_target=target)
    return solver.solve_for_quality(2, 8192, _full_bytes(8192) * budget_fraction, DIMS, torch.float32, limits, points,
                                    lambda b, picked, G, hit, record="auto": 0.1,
                                    lambda b, S, rank, picked, G, reuse=True: 1.0,
                                    lambda G, C, picked: 0.5, log=None if logs is None else logs.append)


def test_solver_meets_the_quality_target_within_the_budget():
    sol = _solve_quality(1 / 4, 1.05)
    assert sol.quality_met and sol.ppl_ratio <= 1.05
    assert (sol.M * sol.G, sol.sink_tokens, sol.window_tokens) in {(1600, 4, 64)}
    assert sol.bytes_per_sequence <= _full_bytes(8192) / 4
    sigma_1 = _solve_quality(1.0, 1.02)  # only the full-rank point meets 1.02, and it fits the whole KV's memory
    assert sigma_1.sigma == 1 and sigma_1.quality_met


def test_the_quality_solver_fills_the_budget_with_reuse_slots_between_the_tables_ratios():
    """A budget that holds C = M and 60 % of the way to C/M = 1.25 but not 1.25: the solver takes the most slots that
    fit (every slot more is more hits, less I/O exposed), not C = M with the rest of the budget unused."""
    point = _point(400, 4, 1.03)
    limits = solver.Limits(io_align_bytes=512, quality_target=1.05)

    def need(C):
        return solver._sequence_bytes(DIMS, torch.float32, limits, 8192, 4, 100, C, 4, True)[0]

    budget = need(100) + 0.6 * (need(125) - need(100))
    sol = solver.solve_for_quality(2, 8192, budget, DIMS, torch.float32, limits, [point],
                                   lambda b, picked, G, hit, record="auto": 1.0 - hit, lambda *a, **k: 0.1,
                                   lambda G, C, picked: min(1.0, C / picked / 4))
    assert sol.reuse and 100 < sol.C < 125 and sol.bytes_per_sequence == need(sol.C) <= budget < need(sol.C + 1)


def test_a_corrected_point_wins_on_quality_and_pays_for_its_extra_reads():
    """At the same geometry the corrected point meets a target the guess misses; its deployed config says how it
    selects, and the reads the guess missed (1 - recall of the picks, within the cap) count as exposed I/O."""
    from dataclasses import replace

    guess = _point(1600, 8, 1.04, 4, 64)
    corrected = replace(guess, ppl_ratio=1.01, correction="corrected", guess_recall=0.9)
    sol = _solve_quality(1 / 4, 1.02, points=[guess, corrected])
    picked = 1600 // 4 - 1 - 16
    assert (sol.correction, sol.score_reduce, sol.correction_reads) == ("corrected", "softmax", -(-picked // 4))
    assert sol.quality_met and sol.t_correct_ms > 0
    both_meet = _solve_quality(1 / 4, 1.05, points=[guess, corrected])
    assert both_meet.correction == "guess"  # both meet 1.05: the one with no reads before attention


def test_a_top1_floor_passes_over_a_cheaper_point_whose_next_tokens_disagree_with_full():
    """Both points meet ppl 1.05; the one that reads a quarter of the groups agrees with full on 85 % of next tokens.
    Without a floor the solver takes it (less I/O exposed); with ``quality_top1_min`` 0.9 it takes the other."""
    from dataclasses import replace

    cheap = replace(_point(400, 4, 1.03), top1_agreement=0.85)
    agreeing = replace(_point(1600, 8, 1.04, 4, 64), top1_agreement=0.93)

    def solve(top1_min):
        limits = solver.Limits(io_align_bytes=512, quality_target=1.05, quality_top1_min=top1_min)
        return solver.solve_for_quality(2, 8192, _full_bytes(8192) / 4, DIMS, torch.float32, limits, [cheap, agreeing],
                                        lambda b, picked, G, hit, record="auto": 0.01 * picked,
                                        lambda b, S, rank, picked, G, reuse=True: 1.0, lambda G, C, picked: 0.0)

    assert (solve(None).M * 4, solve(None).top1_agreement) == (400, 0.85)
    floored = solve(0.9)
    assert (floored.M * 4, floored.top1_agreement, floored.quality_met) == (1600, 0.93, True)
    logs = []
    limits = solver.Limits(io_align_bytes=512, quality_target=1.05, quality_top1_min=0.95)
    missed = solver.solve_for_quality(2, 8192, _full_bytes(8192) / 4, DIMS, torch.float32, limits, [cheap, agreeing],
                                      lambda *a: 0.1, lambda *a: 1.0, lambda *a: 0.0, log=logs.append)
    assert missed.quality_met is False and "with top-1 >= 0.95 not reachable" in logs[0]


def test_a_sigma_sweep_goes_on_past_a_point_that_meets_the_ppl_target_but_not_the_top1_floor():
    """From the largest sigma down, after the family's smallest: sigma 8 meets ppl 1.05 with top-1 0.85, so with a
    floor of 0.9 sigma 4 is measured too; without one the sweep stops at 8.  Then the int4 twin of the point that met
    it (quality.twins); none where the family's best misses."""
    from edgekv.install import quality

    grid = [{"G": 4, "mg_tokens": 400, "sigma": s, "sink_tokens": 0, "window_tokens": 0, "klr_dtype": "int8",
             "correction": "guess"} for s in (2.0, 4.0, 8.0, 16.0)]
    measured = {16.0: (1.3, 0.7), 8.0: (1.01, 0.85), 4.0: (1.0, 0.95), 2.0: (0.99, 0.97)}

    def sweep(top1_min):
        asked = []

        def scorer(policy, config):
            asked.append((config["sigma"], config["klr_dtype"]))
            ppl, top1 = measured[config["sigma"]]
            return {"ppl_ratio": ppl, "top1_agreement": top1}

        quality.measure(scorer, grid, 8192, 1.05, (), top1_min)
        return asked

    int8 = lambda *sigmas: [(s, "int8") for s in sigmas]  # noqa: E731
    assert sweep(None) == int8(2.0, 16.0, 8.0) + [(8.0, "int4")]
    assert sweep(0.9) == int8(2.0, 16.0, 8.0, 4.0) + [(4.0, "int4")]
    assert sweep(0.98) == int8(2.0)  # the family's best misses the floor: nothing more of it is measured, no twin


def test_a_table_measured_before_twins_gets_only_its_twins_measured():
    """A shipped table from before int4 twins (quality.twins) gives every grid point as it is; only the twin of each
    family's point that met the target at the largest sigma is measured: one per family that met it (the bfloat16
    and int8 families' twins at the same sigma are one point), none where nothing met it."""
    from edgekv.install import quality

    grid = quality.candidates(1024, [4], [2.0, 8.0], ("corrected",), shares=(0.2,))
    ppl = {2.0: 1.01, 8.0: 1.3}
    known = [quality.QualityPoint(1024, p["G"], p["mg_tokens"], p["sigma"], p["sink_tokens"], p["window_tokens"],
                                  ppl[p["sigma"]] + (0.1 if p["sink_tokens"] else 0), 0.95, p["klr_dtype"],
                                  "corrected", 0.9) for p in grid]
    asked = []

    def scorer(policy, config):
        asked.append(config)
        return {"ppl_ratio": 1.02, "top1_agreement": 0.94, "guess_recall": 0.88}

    assert len(quality.lacking_twins(known, 1.05)) == 1 and quality.lacking_twins(known, None) == []
    points = quality.measure(scorer, grid, 1024, 1.05, known)
    assert [(c["sigma"], c["klr_dtype"], c["sink_tokens"]) for c in asked] == [(2.0, "int4", 0)]
    assert [(q.klr_dtype, q.ppl_ratio) for q in points if q.klr_dtype == "int4"] == [("int4", 1.02)]
    assert len(points) == len(grid) + 1 and quality.lacking_twins(points, 1.05) == []  # the known points all kept


def test_solver_says_when_no_configuration_meets_the_target():
    logs = []
    sol = _solve_quality(1 / 4, 1.001, logs)
    assert sol.quality_met is False
    assert sol.ppl_ratio == min(p.ppl_ratio for p in SYNTHETIC if p.sigma >= 2)  # the best that fits 1/4 (sigma 1 does not)
    assert len(logs) == 1 and "not reachable" in logs[0] and f"{sol.ppl_ratio:.3f}" in logs[0]


def test_a_budget_below_every_share_of_the_grid_still_gets_the_most_tokens_that_fit():
    from edgekv.install import quality

    limits = solver.Limits(io_align_bytes=512)
    bytes_of = lambda p: solver.smallest_bytes(DIMS, torch.float32, limits, 8192, p)  # noqa: E731
    grid = quality.candidates(8192, [4], solver.SIGMAS)
    least = min(bytes_of(p) for p in grid)
    budget = least * 0.9
    assert quality.frontier(grid, bytes_of, budget) == []
    points = quality.squeezed(8192, 4, solver.SIGMAS, bytes_of, budget)
    assert {(p["sink_tokens"], p["window_tokens"]) for p in points} == set(quality.SINK_WINDOW)
    for p in points:
        leaner = {"klr_dtype": "int8"} if p["klr_dtype"] != "int4" else {}
        assert bytes_of(p) <= budget < bytes_of({**p, "mg_tokens": p["mg_tokens"] + 4, **leaner})
        assert p["mg_tokens"] - p["sink_tokens"] - p["window_tokens"] >= 4
    # each (S, W): the largest sigma in bf16 or int8, and beside it int4 rows of half that sigma
    assert sorted((p["sigma"], p["klr_dtype"] != "int4") for p in points) == \
        [(max(solver.SIGMAS) / 2, False)] * 2 + [(max(solver.SIGMAS), True)] * 2
    assert quality.squeezed(8192, 4, solver.SIGMAS, bytes_of, 1.0) == []
    narrow = quality.squeezed(8192, 4, solver.SIGMAS, bytes_of, budget, sink_windows=quality.NARROW_WINDOWS)
    assert {(p["sink_tokens"], p["window_tokens"]) for p in narrow} == set(quality.NARROW_WINDOWS)


def test_the_grid_takes_the_sink_and_window_pairs_it_is_given():
    """The deploy's grid is the shipped one ((0, 0) and (4, 64)); the eval's adds the narrow windows, and a pair that
    leaves no pick at a small share is skipped there."""
    from edgekv.install import quality

    default = quality.candidates(8192, [4], solver.SIGMAS)
    wider = quality.candidates(8192, [4], solver.SIGMAS, sink_windows=quality.SINK_WINDOW + quality.NARROW_WINDOWS)
    assert {(p["sink_tokens"], p["window_tokens"]) for p in default} == set(quality.SINK_WINDOW)
    assert {(p["sink_tokens"], p["window_tokens"]) for p in wider} == set(quality.SINK_WINDOW + quality.NARROW_WINDOWS)
    assert [p for p in wider if (p["sink_tokens"], p["window_tokens"]) in quality.SINK_WINDOW] == default
    small = quality.candidates(256, [4], solver.SIGMAS, sink_windows=((4, 64), (4, 16)))  # M*G 12, 24 and 52 tokens
    assert {(p["mg_tokens"], p["window_tokens"]) for p in small} == {(24, 16), (52, 16)}


def test_a_rank_starved_family_is_measured_with_int4_rows_of_half_its_sigma_beside_its_best():
    from edgekv.install import quality

    limits = solver.Limits(io_align_bytes=512)
    bytes_of = lambda p: solver.smallest_bytes(DIMS, torch.float32, limits, 8192, p)  # noqa: E731
    grid = quality.candidates(8192, [4], solver.SIGMAS)
    starved = min(bytes_of(p) for p in grid if p["sigma"] == 32 and p["klr_dtype"] == "int8")
    points = quality.frontier(grid, bytes_of, starved)
    best = [p for p in points if p["klr_dtype"] != "int4"]
    lean = [p for p in points if p["klr_dtype"] == "int4"]
    assert best and all(p["sigma"] >= quality.LEAN_FROM_SIGMA for p in best)
    assert {(p["mg_tokens"], p["sink_tokens"], p["sigma"] / 2) for p in best} == \
        {(p["mg_tokens"], p["sink_tokens"], p["sigma"]) for p in lean}
    assert all(bytes_of(p) <= starved for p in lean)
    roomy = quality.frontier(grid, bytes_of, max(bytes_of(p) for p in grid))  # every family at sigma 1
    assert roomy and not any(p["klr_dtype"] == "int4" for p in roomy)


def test_each_corrected_family_is_measured_again_at_the_largest_int4_rank_that_fits():
    from edgekv.install import quality

    limits = solver.Limits(io_align_bytes=512)
    bytes_of = lambda p: solver.smallest_bytes(DIMS, torch.float32, limits, 8192, p)  # noqa: E731
    grid = quality.candidates(8192, [4], solver.SIGMAS, quality.CORRECTIONS, shares=quality.FINE_SHARES)
    assert {p["mg_tokens"] for p in grid} == {quality.share_tokens(quality.FINE_SHARES[0], 8192, 4)}
    budget = min(bytes_of(p) for p in grid if p["sigma"] == 4 and p["klr_dtype"] == "int8")
    points = quality.frontier(grid, bytes_of, budget)
    filled = quality.rank_filled(points, bytes_of, budget, DIMS.n_kv_heads * DIMS.head_dim)
    corrected = {quality._family(p) for p in points if p["correction"] != "guess"}
    assert filled and {quality._family(p) for p in filled} <= corrected
    key_dims = DIMS.n_kv_heads * DIMS.head_dim
    for p in filled:
        rank = round(key_dims / p["sigma"])
        assert p["klr_dtype"] == "int4" and key_dims / rank == p["sigma"]  # the rank is exact
        assert bytes_of(p) <= budget < bytes_of({**p, "sigma": key_dims / (rank + 1)})  # the largest that fits
    keys = [quality.point_key(p) for p in points + filled]
    assert len(keys) == len(set(keys))  # a fill the ladder already has is not measured twice
    assert quality.rank_filled(points + filled, bytes_of, budget, key_dims) == []


def test_each_sequences_own_projection_is_in_the_memory_the_solver_fills():
    """prompt_adapter: a sequence's own projections (float32 [L, H_kv * d, rank]) are in its memory plan, so the same
    point under the same budget gets fewer reuse slots; fails when the solver plans without them."""
    from edgekv.runtime.adapter import LowRankAdapter

    budget = _full_bytes(8192) / 4
    chosen = {}
    for own in (False, True):
        limits = solver.Limits(io_align_bytes=512, quality_target=1.05, prompt_adapter=own)
        chosen[own] = solver.solve_for_quality(2, 8192, budget, DIMS, torch.float32, limits, SYNTHETIC,
                                               lambda b, picked, G, hit, record="auto": 10.0 * (1 - hit),
                                               lambda b, S, rank, picked, G, reuse=True: 1.0,
                                               # more slots, less exposed
                                               lambda G, C, picked: min(1.0, C / (4 * picked)))
    plain, own = chosen[False], chosen[True]
    assert (own.G, own.M, own.sigma, own.prompt_adapter, plain.prompt_adapter) == (plain.G, plain.M, plain.sigma,
                                                                                    True, False)
    rank = LowRankAdapter.rank_for(DIMS.n_kv_heads, DIMS.head_dim, own.sigma)
    projections = DIMS.n_layers * DIMS.n_kv_heads * DIMS.head_dim * rank * 4
    cfg = RuntimeConfig.from_flat({"G": own.G, "M": own.M, "C": own.C, "sigma": own.sigma, "max_batch": 1,
                                   "max_context": 8192, "io_align_bytes": own.io_align_bytes, "prompt_adapter": True,
                                   "sink_tokens": own.sink_tokens, "window_tokens": own.window_tokens})
    stride = solver.Limits(io_align_bytes=512).record_layout(DIMS, torch.float32, own.G, "auto").stride_bytes
    assert plan_memory("kvswap", cfg, DIMS, 4, rank, stride).per_sequence_bytes["prompt_adapter"] == projections
    assert own.C < plain.C and own.bytes_per_sequence <= budget < plain.bytes_per_sequence + projections


def _adapter_choice(monkeypatch, mine: dict, theirs_bytes: float, top1_min=None):
    """choose_adapter over two one-row solves and a trial that measured ``mine`` (the own projection) against a
    calibrated run reading ``theirs_bytes`` a token."""
    from types import SimpleNamespace

    import edgekv.deploy as deploy

    def solve(limits):
        return [solver.Solution(1, 1024, 4, 10, 12 if limits.prompt_adapter else 14, 4.0, 0.5, 1.0, 1.0, True, False,
                                1000, True, ppl_ratio=1.02, quality_met=True, top1_agreement=0.97,
                                prompt_adapter=limits.prompt_adapter)]

    trial = {"prompt": {"kv_read_bytes_per_token": 90.0, **mine},
             "calibrated": {"ppl_ratio": 1.02, "top1_agreement": 0.97, "kv_read_bytes_per_token": theirs_bytes}}
    asked = []
    monkeypatch.setattr(deploy, "adapter_trial", lambda d, cache, adapters, calibration, runs: asked.append(
        {name: (s.C, s.prompt_adapter) for name, s in runs.items()}) or trial)
    logs = []
    d = SimpleNamespace(prof=SimpleNamespace(max_batch=1, max_context=1024), log=logs.append)
    limits = solver.Limits(quality_target=1.05, quality_top1_min=top1_min)
    solutions, record = deploy.choose_adapter(d, None, {}, None, solve, limits, solve(limits))
    assert asked == [{"calibrated": (14, False), "prompt": (12, True)}]  # each as its own solve sized it
    assert record["chosen"] == ("prompt" if solutions[0].prompt_adapter else "calibrated") and len(logs) == 1
    return solutions[0]


def test_the_deploy_takes_each_sequences_own_projection_when_it_meets_the_target_reading_no_more(monkeypatch):
    own = _adapter_choice(monkeypatch, {"ppl_ratio": 1.01, "top1_agreement": 0.96}, 100.0)
    assert (own.prompt_adapter, own.C, own.ppl_ratio, own.top1_agreement) == (True, 12, 1.01, 0.96)  # the trial's


@pytest.mark.parametrize("mine, theirs_bytes, top1_min", [
    ({"ppl_ratio": 1.01, "top1_agreement": 0.96}, 80.0, None),  # reads more than the calibrated adapter
    ({"ppl_ratio": 1.06, "top1_agreement": 0.96}, 100.0, None),  # misses the ppl target
    ({"ppl_ratio": 1.01, "top1_agreement": 0.94}, 100.0, 0.95),  # misses the top-1 floor
])
def test_the_deploy_keeps_the_calibrated_adapter_otherwise(monkeypatch, mine, theirs_bytes, top1_min):
    plain = _adapter_choice(monkeypatch, mine, theirs_bytes, top1_min)
    assert (plain.prompt_adapter, plain.C, plain.ppl_ratio) == (False, 14, 1.02)


def test_solver_without_room_for_any_point_names_the_budget():
    with pytest.raises(ValueError, match="max_kv_mem_mib"):
        _solve_quality(1e-5, 1.05)


def test_deploy_with_a_quality_target_measures_the_table_and_says_whether_it_is_met(tiny_profile, monkeypatch):
    import edgekv.deploy as deploy
    from edgekv.install import quality

    monkeypatch.setattr(quality, "MG_SHARES", (0.2,))  # a small grid: one M*G, with and without sinks and window
    monkeypatch.setattr(quality, "KLR_DTYPES", ("bfloat16",))
    root, path = tiny_profile
    data = yaml.safe_load(path.read_text())
    data["solver"]["sigma_max"] = 8
    logs = []
    for target in (1.5, 1.0001):  # a target the fixture meets, and one no sparse configuration meets
        data.update(quality_target=target, quality_contexts=[1024])
        mine = root / f"quality-{target}.yaml"
        mine.write_text(yaml.safe_dump(data))
        deploy.run(str(mine), "fixture", out_root=root / "q", cache_dir=root / "cache", log=logs.append, smoke=False)
        config = json.loads((root / "q" / "local" / "config.json").read_text())
        table = config["measurements"]["quality_table"]
        assert table and all(p["context"] == 1024 for p in table)
        assert {"sink_tokens", "window_tokens"} <= set(config)
        assert config["correction_recall"] == (data["solver"].get("correction_recall", 1.0)
                                               if config["correction"] == "corrected" else 1.0)
        assert config["guess_from_before"] == (data["solver"].get("guess_from_before", False)
                                               and config["correction"] == "corrected")
        trial = config["measurements"]["adapter_trial"]  # the deployed configuration with either adapter
        assert config["prompt_adapter"] == (trial["chosen"] == "prompt") == all(
            s["prompt_adapter"] for s in config["solutions"])
        assert all(trial[a]["kv_read_bytes_per_token"] > 0 for a in ("calibrated", "prompt"))
        met = [s["quality_met"] for s in config["solutions"]]
        report = (root / "q" / "local" / "report.txt").read_text()
        assert "quality table" in report
        if target == 1.5:
            assert all(met) and all(s["ppl_ratio"] <= 1.5 for s in config["solutions"])
        else:
            assert not any(met) and "MISSED" in report
            assert any("quality target ppl ratio <= 1.0001 not reachable" in line for line in logs)


def test_deploy_of_a_chat_model_answers_through_the_deployed_configuration(tiny_profile, tmp_path, capsys, monkeypatch):
    """A model with a chat template gets one question through the deployed kvswap configuration: deploy prints the
    answer, then the stats JSON as its last line; a quality table shipped for the model file (by its GGUF's SHA-256
    and the settings) is taken instead of measured."""
    from edgekv import deploy
    from edgekv.cli import main
    from edgekv.install import quality
    from tests.gguf_writer import save_bpe_text_model, write_gguf

    monkeypatch.setattr(quality, "MG_SHARES", (0.2,))
    monkeypatch.setattr(quality, "KLR_DTYPES", ("bfloat16",))
    monkeypatch.setattr(quality, "SHIPPED_DIR", tmp_path / "shipped")
    root, path = tiny_profile
    data = yaml.safe_load(path.read_text())
    data["solver"].update(sigma_max=8, corrections=["guess"])
    data.update(quality_target=1.5, quality_contexts=[1024])
    mine = tmp_path / "chat.yaml"
    mine.write_text(yaml.safe_dump(data))
    template = ("{% for m in messages %}<s>{{ m['role'] }} : {{ m['content'] }} .{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant :{% endif %}")
    gguf = write_gguf(save_bpe_text_model(tmp_path / "hf", "llama"), tmp_path / "chat.gguf", chat_template=template)
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGEKV_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # the CLI writes deploy/<platform>/ where it runs: here, not in the checkout
    # one configuration, said to meet 1.5, and its int4 twin (quality.twins): a whole table, nothing left to measure
    points = [quality.QualityPoint(1024, 4, 208, 8.0, 0, 0, 1.01, 0.99),
              quality.QualityPoint(1024, 4, 208, 8.0, 0, 0, 1.01, 0.99, "int4")]
    d = deploy.prepare(str(mine), str(gguf), None, tmp_path / "scratch", False, lambda *a: None)
    fp = {"contexts": [1024], "sigmas": d.sigmas, "groups": [4], "target": 1.5, "budget_mib_per_sequence": 1.0,
          "calibration": "default", "adapters": deploy.adapter_source(d.model_dir, 1024 - 64, 2, None),
          "edgekv": deploy.VERSION, "corrections": ["guess"]}
    quality.ship(tmp_path / "shipped" / "tiny.json", deploy.gguf_sha256(d.model_dir), fp, points, {"machine": "test"})
    capsys.readouterr()
    assert main(["deploy", "--platform", str(mine), "--model", str(gguf), "--kv-path", str(root / "kv")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any("quality table: the one measured for this model file" in line for line in out)
    assert any(line.startswith("quality: the deployed configuration's measured ppl ratio to full is 1.01") for line in out)
    assert out[-3].startswith("chat (the deployed configuration): What is the capital of France?")
    assert out[-2].startswith("  -> ")
    stats = json.loads(out[-1])
    assert stats["policy"] == "kvswap" and stats["G"] == 4


def test_a_table_of_fewer_selections_gives_its_points_and_only_the_rest_are_measured():
    """A shipped table measured before corrections (guess only) serves a profile measuring both: its guess points
    are taken as they are, the corrected ones measured (the scorer sees only those)."""
    from edgekv.install import quality

    grid = quality.candidates(1024, [4], [4.0, 8.0], quality.CORRECTIONS)
    known = [quality.QualityPoint(1024, p["G"], p["mg_tokens"], p["sigma"], p["sink_tokens"], p["window_tokens"], 1.01,
                                  0.99, p["klr_dtype"]) for p in grid if p["correction"] == "guess"]
    asked = []

    def scorer(policy, config):
        asked.append(config)
        return {"ppl_ratio": 1.2, "top1_agreement": 0.9, "guess_recall": 0.875}

    points = quality.measure(scorer, grid, 1024, None, known)
    assert asked and all(c["correction"] == "corrected" and c["score_reduce"] == "softmax" for c in asked)
    assert all(c["correction_reads"] == max(1, -(-quality.picked_groups(c["M"], 4, c["sink_tokens"], c["window_tokens"])
                                                  // 4)) for c in asked)
    assert {(p.correction, p.ppl_ratio, p.guess_recall) for p in points} == {("guess", 1.01, None),
                                                                              ("corrected", 1.2, 0.875)}
    assert len(points) == len(grid)


@pytest.mark.parametrize("field, value, message", [("quality_target", 0.9, "perplexity ratio"),
                                                  ("quality_top1_min", 1.5, "quality_top1_min' is the share"),
                                                  ("quality_top1_min", 0, "quality_top1_min' is the share"),
                                                  ("quality_contexts", [0], "quality_contexts"),
                                                  ("corrections", ["oracle"], "solver.corrections"),
                                                  ("correction_recall", 0.0, "solver.correction_recall"),
                                                  ("correction_recall", 1.2, "solver.correction_recall"),
                                                  ("guess_from_before", "yes", "solver.guess_from_before' must be "
                                                   "bool, got 'yes'; write e.g. true")])
def test_bad_quality_fields_are_named(tmp_path, field, value, message):
    data = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    (data["solver"] if field.startswith(("correction", "guess")) else data)[field] = value
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_a_top1_floor_without_a_ppl_target_is_named(tmp_path):
    data = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    data.pop("quality_target")
    data["quality_top1_min"] = 0.9
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="'quality_top1_min' needs 'quality_target'"):
        load_profile(path)


def test_without_fio_the_disk_figure_for_a_ratio_is_missing_not_the_reader_itself():
    measured = [DiskPoint(4096, 32, 100.0, 120.0), DiskPoint(16384, 32, 400.0, 500.0)]
    unmeasured = [DiskPoint(4096, 32, 100.0), DiskPoint(16384, 32, 400.0)]
    with_fio = DiskProfile("/x", {}, "fio io_uring", "io_uring", True, 1.0, measured)
    without = DiskProfile("/x", {}, "none (fio not installed)", "io_uring", True, 1.0, unmeasured)
    assert with_fio.read_mib_s(4096, 32, source="fio") == pytest.approx(120.0)
    assert without.read_mib_s(4096, 32, source="fio") is None
    assert without.read_mib_s(4096, 32, source="disk") == pytest.approx(100.0)  # the solver still plans with it


def test_on_a_gpu_the_io_model_counts_the_missed_records_crossing_the_bus():
    """The same misses, read then copied host -> device: the bus adds bytes / h2d rate per layer; hits never."""
    disk = DiskProfile("/x", {}, "fio io_uring", "io_uring", True, 1.0,
                       [DiskPoint(4096, 32, 100.0, 120.0), DiskPoint(16384, 32, 400.0, 500.0)])
    cpu = io_model(disk, DIMS, torch.float32, 512, 32)
    gpu = io_model(disk, DIMS, torch.float32, 512, 32, h2d_gib_s=1.0)
    stride = RecordLayout(4, DIMS.n_kv_heads, DIMS.head_dim, torch.float32, 512).stride_bytes
    bus_ms = DIMS.n_layers * 2 * 10 * 0.5 * stride / 2**30 * 1e3
    assert gpu(2, 10, 4, 0.5) == pytest.approx(cpu(2, 10, 4, 0.5) + bus_ms)
    assert gpu(2, 10, 4, 1.0) == cpu(2, 10, 4, 1.0) == 0.0  # every pick a hit: nothing read, nothing copied
