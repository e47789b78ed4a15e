"""Several KV paths in the install step: profiles, the planned rate over paths, the solver, deploy, the CLI."""
import functools
import json
import logging

import pytest
import torch
import yaml

from edgekv.install import compute, disk, solver
from edgekv.install.disk import DiskPoint, DiskProfile, combine_profiles, planned_mib_s
from edgekv.install.iomodel import io_model
from edgekv.install.profile import PROFILES_DIR, ProfileError, load_profile
from tests.conftest import tiny_deploy_profile
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.model import ModelDims, read_model_config
from edgekv.runtime.solutions import load_deployed

DIMS = ModelDims(n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, vocab=256)
RATES = ((512, 20.0), (4096, 120.0), (16384, 300.0), (65536, 600.0), (262144, 800.0))  # MiB/s at qd 32


def _disk(kv_path, dev, scale=1.0, fio=None, rates=RATES):
    points = [DiskPoint(b, 32, scale * r, None if fio is None else fio * r) for b, r in rates]
    return DiskProfile(kv_path, {"dev": dev, "disk": dev}, "fio io_uring" if fio else "none", "pthread", True, 1.0,
                       points)


# ---- profiles ---------------------------------------------------------------------------------

def _profile(tmp_path, **kv):
    data = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    data["kv"] = {"disk_type": "nvme", **kv}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_profile_takes_a_list_of_kv_paths_or_one_path(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert load_profile(_profile(tmp_path, paths=[a, b])).kv_paths == (a, b)
    assert load_profile(_profile(tmp_path, path=a)).kv_paths == (a,)
    assert load_profile("local").kv_paths == ("deploy/local/kv",)  # the shipped form stays valid


@pytest.mark.parametrize("kv, message", [
    ({"paths": []}, "field 'kv.paths' must name at least one folder"),
    ({"paths": "/mnt/nvme/kv"}, "field 'kv.paths' must be list"),
    ({"paths": ["/mnt/a", 3]}, "field 'kv.paths' entry 1 must be a folder path"),
    ({"paths": ["/mnt/a", ""]}, "field 'kv.paths' entry 1 must be a folder path"),
    ({"path": 3}, "field 'kv.path' must be str"),
    ({"paths": ["/mnt/a", "/mnt/a/"]}, r"field 'kv.paths' names one folder twice \(/mnt/a and /mnt/a/\)"),
    ({"paths": ["/mnt/a"], "path": "/mnt/b"}, "'kv.paths' .* or one as 'kv.path', not both or neither"),
    ({}, "'kv.paths' .* or one as 'kv.path', not both or neither"),
])
def test_bad_kv_paths_name_the_file_and_field(tmp_path, kv, message):
    path = _profile(tmp_path, **kv)
    with pytest.raises(ProfileError, match=message) as err:
        load_profile(path)
    assert str(path) in str(err.value)


def test_a_symlink_to_a_listed_folder_and_a_file_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ProfileError, match="names one folder twice"):
        load_profile(_profile(tmp_path, paths=[str(tmp_path / "a"), str(tmp_path / "link")]))
    with pytest.raises(ProfileError, match=r"entry 1: .*file exists and is not a folder"):
        load_profile(_profile(tmp_path, paths=[str(tmp_path / "a"), str(tmp_path / "file")]))


# ---- the planned rate over several paths ------------------------------------------------------

def test_two_equal_paths_on_two_devices_read_at_twice_the_rate():
    one = _disk("/a", "259:0", fio=1.5)
    plan = combine_profiles([one, _disk("/b", "259:4", fio=1.5)])
    for block, rate in RATES:
        assert plan.read_mib_s(block, 32) == pytest.approx(2 * rate)
        assert plan.read_mib_s(block, 32, source="disk") == pytest.approx(2 * 1.5 * rate)
    assert plan.read_mib_s(8192, 32) == pytest.approx(2 * one.read_mib_s(8192, 32))
    assert combine_profiles([one]) is one


def test_a_slow_path_caps_the_plan_at_n_times_the_slowest():
    fast, slow = _disk("/fast", "259:0", 4.0), _disk("/slow", "8:0", 1.0)
    plan = combine_profiles([fast, slow])
    for block, rate in RATES:
        assert plan.read_mib_s(block, 32) == pytest.approx(2 * rate)  # 2 x slow, not fast + slow = 5 x
        assert plan.read_mib_s(block, 32) < fast.read_mib_s(block, 32) + slow.read_mib_s(block, 32)
    assert plan.points[0].fio_mib_s is None  # no fio figures: no planned disk figures either


def test_the_slowest_path_is_taken_at_the_record_size_itself():
    """Which path is slower changes between measured sizes: the plan takes each path's rate at the record size,
    not a line between the planned rates at the measured sizes (that would give 2 x 150 here)."""
    a = _disk("/a", "259:0", rates=((4096, 100.0), (65536, 400.0)))
    b = _disk("/b", "8:0", rates=((4096, 200.0), (65536, 200.0)))
    assert (a.read_mib_s(16384, 32), b.read_mib_s(16384, 32)) == pytest.approx((250.0, 200.0))
    assert planned_mib_s([a, b], 16384, 32) == pytest.approx(2 * 200.0)
    assert planned_mib_s([a], 16384, 32) == a.read_mib_s(16384, 32)


def test_paths_on_one_device_add_no_bandwidth():
    a, b = _disk("/a", "259:0", 3.0), _disk("/b", "259:0", 3.0)
    assert combine_profiles([a, b]).read_mib_s(16384, 32) == pytest.approx(a.read_mib_s(16384, 32))
    assert disk.shared_devices([a, b, _disk("/c", "8:0")]) == {"259:0": ["/a", "/b"]}
    # two paths on a device of 3x, one on a device of 1x: 3 x min(3 * rate / 2, 1 * rate / 1)
    plan = combine_profiles([a, b, _disk("/c", "8:0", 1.0)])
    assert plan.read_mib_s(16384, 32) == pytest.approx(3 * 300.0)


def test_io_model_over_two_paths_takes_half_the_time_of_one():
    one = io_model(_disk("/a", "259:0"), DIMS, torch.float32, 512, 32)
    two = io_model([_disk("/a", "259:0"), _disk("/b", "259:4")], DIMS, torch.float32, 512, 32)
    shared = io_model([_disk("/a", "259:0"), _disk("/b", "259:0")], DIMS, torch.float32, 512, 32)
    assert two(4, 100, 4, 0.2) == pytest.approx(one(4, 100, 4, 0.2) / 2)
    assert shared(4, 100, 4, 0.2) == pytest.approx(one(4, 100, 4, 0.2))


def _solve(profiles, t_model_ms):
    budget = DIMS.n_layers * 32768 * 2 * DIMS.n_kv_heads * DIMS.head_dim * 4 / 13
    t_io = io_model(profiles, DIMS, torch.float32, 512, 32)
    return solver.solve(4, 32768, budget, DIMS, torch.float32, solver.Limits(io_align_bytes=512), t_io,
                        lambda b, S, rank, picked, G, reuse=True: t_model_ms,
                        lambda G, C, picked: min(0.9, 0.5 * C / picked))


def test_solver_with_a_second_disk_hides_reads_it_could_not_and_takes_smaller_groups():
    one, two = [_disk("/a", "259:0")], [_disk("/a", "259:0"), _disk("/b", "259:4")]
    assert not _solve(one, 1.0).hidden and _solve(two, 1.0).hidden
    lone, pair = _solve(one, 8.0), _solve(two, 8.0)
    assert lone.hidden and pair.hidden
    assert pair.G < lone.G and pair.sigma <= lone.sigma  # finer groups, no more K compression
    same_disk = _solve([_disk("/a", "259:0"), _disk("/b", "259:0")], 8.0)
    assert (same_disk.G, same_disk.M, same_disk.C, same_disk.sigma) == (lone.G, lone.M, lone.C, lone.sigma)


# ---- deploy -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_path_profile(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy-kv-paths")
    return root, tiny_deploy_profile(root, "two", [root / "kv0", root / "kv1"], max_batch=1, context_min=1024,
                                     disk_seconds=0.5)


def _fixed_model_phases(monkeypatch, deploy, root):
    """Disk, solver, config and report are under test here, not the model's tables: those phases answer with fixed
    figures (the deploy tests of test_install.py measure them), which keeps this test at seconds."""
    adapter, costs = root / "adapter.safetensors", root / "ttft_costs.json"
    adapter.write_bytes(b"")
    costs.write_text("{}")
    reuse = {g: {1.0: 0.4, 2.0: 0.6} for g in solver.group_sizes(8)}
    monkeypatch.setattr(deploy, "lookup_tables", lambda d, *_: (reuse, {float(s): str(adapter) for s in d.sigmas}))
    monkeypatch.setattr(deploy, "measure_compute", lambda d, *_: compute.ComputeProfile(
        {}, d.dims.n_layers, block_ms=[[1, 64, 0.05], [1, 1024, 0.2]], predict_ms=[[1, 1024, 8, 0.02]],
        reuse_ms=[[1, 64, 0.01]]))
    monkeypatch.setattr(deploy, "measure_chunks", lambda d, *_: (costs, {}))
    monkeypatch.setattr(deploy, "record_table", lambda *_: {})  # exact records only


def test_deploy_profiles_each_path_plans_with_them_and_reports_each(two_path_profile, monkeypatch, caplog):
    import edgekv.deploy as deploy

    root, path = two_path_profile
    _fixed_model_phases(monkeypatch, deploy, root)
    monkeypatch.setattr(disk, "profile_disk", functools.partial(disk.profile_disk, block_sizes=(4096, 65536),
                                                                queue_depths=(32,)))  # two points a path: fast
    kv = [str(root / "kv0"), str(root / "kv1")]
    logs = []
    deploy.run(str(path), "fixture", out_root=root / "out", cache_dir=root / "cache", log=logs.append, smoke=False)
    config = json.loads((root / "out" / "local" / "config.json").read_text())
    assert config["kv_paths"] == kv and config["kv_path"] == kv[0]
    load_deployed(config)  # kv_paths is metadata the runtime accepts
    measured = config["measurements"]["disk"]
    assert [p["kv_path"] for p in measured["paths"]] == kv
    at = measured["at_record"]
    assert len(at["paths_mib_s"]) == 2 and at["queue_depth"] == 32
    # both folders sit on this machine's one disk: the plan is that disk once, not twice
    assert list(measured["shared_devices"].values()) == [kv]
    assert at["plan_mib_s"] == pytest.approx(sum(at["paths_mib_s"]) / 2, abs=0.2)
    assert any(line.startswith("WARNING: KV paths") and "no extra bandwidth" in line for line in logs)
    report = (root / "out" / "local" / "report.txt").read_text()
    for i, folder in enumerate(kv):
        assert f"path {i + 1} {folder}: " in report and f"{at['paths_mib_s'][i]:.1f} MiB/s at " in report
    assert "no extra bandwidth" in report and f"plan: the solver's rate with 2 paths" in report
    assert config["io_gap_bytes"] == measured["gap_bytes"] >= 0  # the runtime reads through the gaps the disk is worth
    records = config["io_gap_bytes"] // at["block_bytes"]
    assert (f"gaps read through: {records} records of " if records else "gaps read through: none") in report
    assert not list((root / "kv0").iterdir()) and not list((root / "kv1").iterdir())

    # a disk profile cached before the rename (each path's 'kv_dir'): still reused, the old name warned about
    cached = root / "out" / "local" / "disk.json"
    cached.write_text(cached.read_text().replace('"kv_path"', '"kv_dir"'))
    logs.clear()
    with caplog.at_level(logging.WARNING, logger="edgekv.install.disk"):
        deploy.run(str(path), "fixture", out_root=root / "out", cache_dir=root / "cache", log=logs.append, smoke=False)
    assert any(line.startswith("disk: reusing") for line in logs)
    assert f"{cached}: field 'kv_dir' is now 'kv_path'" in caplog.text
    config = json.loads((root / "out" / "local" / "config.json").read_text())
    assert [p["kv_path"] for p in config["measurements"]["disk"]["paths"]] == kv

    # the same folders on two devices: profiled again (another disk), planned at 2 x the slower one
    real = disk.disk_fingerprint
    monkeypatch.setattr(disk, "disk_fingerprint", lambda d: {**real(d), "disk": str(d)})
    logs.clear()
    deploy.run(str(path), "fixture", out_root=root / "out", cache_dir=root / "cache", log=logs.append, smoke=False)
    assert any("disk: cached profile is for another paths" in line for line in logs)
    config = json.loads((root / "out" / "local" / "config.json").read_text())
    at = config["measurements"]["disk"]["at_record"]
    assert at["plan_mib_s"] == pytest.approx(2 * min(at["paths_mib_s"]), abs=0.2)
    top = config["solutions"][-1]  # the solver's reads ran at that rate
    n_layers = ModelDims.from_config(read_model_config(resolve_checkpoint("fixture"))).n_layers
    read_bytes = n_layers * top["batch"] * top["M"] * (1 - top["reuse_rate"]) * at["block_bytes"]
    assert top["t_io_ms"] == pytest.approx(read_bytes / (at["plan_mib_s"] * 2**20) * 1e3, rel=0.02)
    assert not config["measurements"]["disk"]["shared_devices"]
    assert "WARNING" not in (root / "out" / "local" / "report.txt").read_text()


def test_deploy_names_a_kv_folder_it_cannot_create(two_path_profile):
    import edgekv.deploy as deploy

    root, path = two_path_profile
    (root / "a-file").write_text("x")
    with pytest.raises(OSError, match=r"cannot create the KV folder .*a-file/kv \(given to deploy\)"):
        deploy.run(str(path), "fixture", [str(root / "kv0"), str(root / "a-file" / "kv")], out_root=root / "out",
                   log=lambda line: None)
    with pytest.raises(ProfileError, match="kv_paths names one folder twice"):
        deploy.run(str(path), "fixture", [str(root / "kv0"), str(root / "kv0")], out_root=root / "out",
                   log=lambda line: None)


# ---- the command line -------------------------------------------------------------------------

class _Stop(ValueError):
    """Raised by a stand-in once it has seen its arguments: the command then exits with status 2."""


def test_kv_path_and_kv_paths_together_are_refused_naming_both(tmp_path, capsys):
    from edgekv.cli import main

    for command in (["generate", "--model", "fixture", "--prompt", "[1, 2]"], ["eval"], ["deploy"], ["bench"]):
        assert main([*command, "--kv-path", str(tmp_path), "--kv-paths", f"{tmp_path},{tmp_path}/b"]) == 2
        err = capsys.readouterr().err
        assert "--kv-path " in err and "--kv-paths " in err and "pass one of them" in err


def test_kv_paths_reports_a_missing_folder_as_the_user_wrote_it(tmp_path, monkeypatch, capsys):
    from edgekv.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "a").mkdir()
    assert main(["generate", "--model", "fixture", "--prompt", "[1, 2]", "--kv-paths", "~/a,~/missing"]) == 2
    assert "--kv-paths: no folder ~/missing;" in capsys.readouterr().err
    assert main(["generate", "--model", "fixture", "--prompt", "[1, 2]", "--kv-paths", f"{tmp_path}/a,~/a"]) == 2
    assert "--kv-paths names one folder twice" in capsys.readouterr().err
    assert main(["generate", "--model", "fixture", "--prompt", "[1, 2]", "--kv-paths", f"{tmp_path}/a,"]) == 2
    assert "--kv-paths entry 1 must be a folder path" in capsys.readouterr().err


def test_kv_paths_reach_the_engine_deploy_eval_and_bench(tmp_path, monkeypatch):
    import edgekv.bench
    import edgekv.deploy
    from edgekv.cli import main
    from edgekv.evals import harness
    from edgekv.runtime import Engine

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    seen = {}

    def stop(name):
        def record(*args, **kwargs):
            seen[name] = (args, kwargs)
            raise _Stop(name)
        return record

    monkeypatch.setattr(Engine, "from_pretrained", stop("engine"))
    monkeypatch.setattr(edgekv.deploy, "run", stop("deploy"))
    monkeypatch.setattr(harness, "evaluate", stop("eval"))
    monkeypatch.setattr(edgekv.bench, "run", stop("bench"))
    assert main(["generate", "--model", "fixture", "--prompt", "[1, 2]", "--kv-paths", f"{a},{b}"]) == 2
    assert seen["engine"][1]["kv_path"] == [str(a), str(b)]
    assert main(["deploy", "--kv-paths", f"{tmp_path}/new0,{tmp_path}/new1"]) == 2  # deploy creates them
    assert seen["deploy"][0][2] == [f"{tmp_path}/new0", f"{tmp_path}/new1"]
    assert main(["eval", "--kv-paths", f"{a},{b}", "--tasks", "single_needle"]) == 2
    assert [p.parent for p in seen["eval"][0][1]] == [a, b]  # a scratch folder on each path
    assert main(["bench", "--kv-paths", f"{a}, {b}", "--path-limit-mib-s", "50"]) == 2
    args, kwargs = seen["bench"]
    assert [p.parent for p in kwargs["kv_paths"]] == [a, b] and args[1] == kwargs["kv_paths"][0]
    assert kwargs["path_limit_mib_s"] == 50.0
    assert main(["bench", "--kv-path", str(a)]) == 2
    assert seen["bench"][1]["kv_paths"] is None and seen["bench"][1]["path_limit_mib_s"] is None
    assert not list(a.iterdir()) and not list(b.iterdir())  # the scratch folders are gone
