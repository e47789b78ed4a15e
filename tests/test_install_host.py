"""The install's host plan (install/host.py) on this CPU machine, fed what real hosts show: a Jetson's
/etc/nv_tegra_release and device-tree model (L4T 36.3, an AGX Orin), nvidia-smi's banner on an RTX PC, a system
torch with and without CUDA; and the GPU facts that key cached compute profiles."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgekv.install import host  # the file the Makefile runs with the system Python, before any venv
from edgekv.platforms import devices

ROOT = Path(__file__).resolve().parents[1]

# /etc/nv_tegra_release of JetPack 6.0 (L4T R36.3.0), as the release notes show it
TEGRA_36_3 = "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, DATE: Mon May  6 17:34:21 UTC 2024\n"
ORIN_MODEL = "NVIDIA Jetson AGX Orin Developer Kit"  # /proc/device-tree/model (tegra234-p3737-0000+p3701-0000.dts)
# nvidia-smi's banner on a driver 550 PC (the line it prints above the GPU table)
SMI_550 = ("+-----------------------------------------------------------------------------------------+\n"
           "| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |\n"
           "|-----------------------------------------+------------------------+----------------------+\n")
JETSON_TORCH = "2.3.0a0+40ec155e58.nv24.03 12.2"  # NVIDIA's JetPack 6.0 wheel: torch.__version__, torch.version.cuda


def jetson(**over):
    return host.HostFacts(**{"machine": "aarch64", "tegra_release": TEGRA_36_3, "device_tree_model": ORIN_MODEL,
                             "system_torch": JETSON_TORCH, "liburing": "2.1-2build1", **over})


def test_a_jetson_keeps_jetpacks_cuda_torch_and_gets_jtop():
    plan = host.plan(jetson())
    assert (plan.kind, plan.venv_flags, plan.torch_pip, plan.stop) == ("jetson", "--system-site-packages", "", None)
    assert plan.constraint == "torch==2.3.0a0+40ec155e58.nv24.03" and "jtop" in plan.extras
    assert "JetPack 6.0" in plan.notes[0] and "pthread" in plan.reader and "liburing 2.1" in plan.reader
    assert "TORCH_CONSTRAINT='torch==2.3.0a0+40ec155e58.nv24.03'" in plan.shell()


@pytest.mark.parametrize("torch, says", [(None, "no PyTorch in the system Python"),
                                         ("2.5.1 None", "is a CPU build (no CUDA)")])
def test_a_jetson_without_a_cuda_torch_stops_naming_the_jetpack_build(torch, says):
    plan = host.plan(jetson(system_torch=torch))
    assert says in plan.stop and "JetPack 6.0 (L4T R36.3)" in plan.stop
    assert "https://developer.download.nvidia.com/compute/redist/jp/v60/pytorch/" in plan.stop


def test_a_jetson_of_an_unlisted_release_is_still_sent_to_nvidias_guide():
    plan = host.plan(jetson(tegra_release="# R38 (release), REVISION: 1.0\n", system_torch=None))
    assert "L4T 38.1" in plan.stop and "install-pytorch-jetson-platform" in plan.stop


def test_an_nvidia_pc_gets_the_cuda_build_its_driver_runs_and_nvml():
    plan = host.plan(host.HostFacts(machine="x86_64", nvidia_smi=SMI_550, liburing="2.5"))
    assert plan.kind == "nvidia" and plan.torch_pip == "torch --index-url https://download.pytorch.org/whl/cu124"
    assert "nvml" in plan.extras and plan.stop is None and plan.reader == "io_uring (liburing 2.5)"


def test_an_nvidia_driver_older_than_any_build_stops():
    plan = host.plan(host.HostFacts(machine="x86_64", nvidia_smi=SMI_550.replace("12.4", "11.4")))
    assert "CUDA 11.4, older than any PyTorch build" in plan.stop and "update the driver" in plan.stop


def test_a_cpu_host_gets_the_cpu_wheel():
    plan = host.plan(host.HostFacts(machine="x86_64"))
    assert (plan.kind, plan.torch_pip, plan.extras, plan.venv_flags) == ("cpu", host.CPU_TORCH, ["dev"], "")
    assert plan.reader.startswith("pthread (no liburing")


def test_the_plan_writes_shell_the_makefile_sources(tmp_path):
    out = tmp_path / "plan.sh"
    done = subprocess.run([sys.executable, str(ROOT / "install" / "host.py"), "plan", "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "install: KV reader:" in done.stdout
    sourced = subprocess.run(["sh", "-c", f". {out} && echo \"$VENV_FLAGS|$EXTRAS\""], capture_output=True, text=True)
    assert sourced.stdout.strip() in ("|dev", "--system-site-packages|dev,jtop", "|dev,nvml")


def test_an_orins_cache_facts_hold_its_l4t_release_and_power_mode(monkeypatch):
    from edgekv.install.profile import load_profile

    monkeypatch.setattr(devices, "_run", lambda cmd: "NV Power Mode: MODE_30W\n2" if cmd[0] == "nvpmodel" else
                        "unavailable")
    monkeypatch.setattr(devices, "read_text", lambda path, default: TEGRA_36_3)
    orin = devices.OrinPlatform(load_profile("orin"))
    monkeypatch.setattr(type(orin), "device", property(lambda self: "cpu"))  # no GPU here: the GPU name is None
    facts = orin.cache_facts()
    assert facts["power_mode"] == "MODE_30W (2)" and facts["l4t"].startswith("# R36 (release), REVISION: 3.0")
    assert devices.power_mode("NV Power Mode: MAXN\n0\n") == "MAXN (0)"


def test_the_gpu_driver_is_read_from_nvidia_smi(monkeypatch):
    monkeypatch.setattr(devices, "_run", lambda cmd: "550.54.15\n")
    assert devices.gpu_driver() == "550.54.15"


def test_gpu_check_without_a_gpu_says_so_and_the_fix(capsys):
    from edgekv.gpu_check import main

    assert main(["--json", "/nonexistent/x.json"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_gpu_check_makes_its_output_folders_and_passes_pinned_configurations(tmp_path, monkeypatch):
    """Its defaults are under deploy/, which a fresh clone lacks: the run ended in a FileNotFoundError after the
    bench, its plot unwritten (seen on a lent H200 with --json elsewhere).  --quality-configs pins the kvswap rows'
    configuration across runs (a missing file is refused first).  The bench itself is stubbed here."""
    import torch

    from edgekv import bench, gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "gpu_facts", lambda: {"gpu": "H200", "driver": "580", "torch": "2.11"})
    calls = []
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: calls.append(kwargs) or ([], {}))
    monkeypatch.setattr(bench, "table", lambda runs: "")
    plotted = []
    monkeypatch.setattr(bench, "plot", lambda runs, png: plotted.append(Path(png).parent.is_dir()))
    out, png = tmp_path / "a" / "check.json", tmp_path / "b" / "check.png"
    chosen = tmp_path / "eval.json"
    chosen.write_text("{}")
    assert gpu_check.main(["--skip-suite", "--kv-path", str(tmp_path), "--json", str(out), "--png", str(png),
                           "--quality-configs", str(chosen)]) == 0
    assert out.is_file() and plotted == [True]
    assert calls[0]["chosen_from"] == str(chosen)  # pinned configurations reach the bench
    with pytest.raises(SystemExit):
        gpu_check.main(["--skip-suite", "--quality-configs", str(tmp_path / "missing.json")])


def test_gpu_check_quick_runs_the_preset_then_flexgen_beside_kvswap(tmp_path, monkeypatch):
    """--quick is what fits a lent machine's few minutes: 16K at batch 1/4/8 without flexgen (its step reads the whole
    KV), then flexgen beside kvswap at one point, both in the JSON.  The bench itself is stubbed here."""
    import torch

    from edgekv import bench, gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "gpu_facts", lambda: {"gpu": "H200", "driver": "580", "torch": "2.11"})
    calls = []
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: calls.append(args) or ([], {"steps": args[5]}))
    monkeypatch.setattr(bench, "table", lambda runs: "")
    monkeypatch.setattr(bench, "plot", lambda runs, png: None)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--skip-suite", "--quick", "--kv-path", str(tmp_path), "--json", str(out), "--png",
                           str(tmp_path / "check.png")]) == 0
    (_, _, batches, contexts, _, steps, warmup, disk_s, policies), flex = calls[0][:9], calls[1]
    assert (batches, contexts, steps, warmup, disk_s) == ([1, 4, 8], [16384], 8, 2, 2.0)
    assert "flexgen" not in policies and {"full", "kvswap", "kvswap-ram", "kvswap-mapped"} <= set(policies)
    assert (flex[2], flex[3], flex[5], flex[8]) == ([1], [16384], 1, ["flexgen", "kvswap"])
    written = json.loads(out.read_text())
    assert written["bench"]["meta"] == {"steps": 8} and written["flexgen_beside_kvswap"]["meta"] == {"steps": 1}
