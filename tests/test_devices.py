"""Where a run computes and in which dtype (runtime/devices.py), and a GPU profile on a host whose torch has no
CUDA: refused by name, never measured on the CPU under the GPU's name.  All on the CPU (the CUDA side is
tests/test_cuda.py)."""
import json
from pathlib import Path

import pytest
import torch

from edgekv.cli import main
from edgekv.runtime import Engine
from edgekv.runtime.config import ConfigError
from edgekv.runtime.devices import DeviceUnavailable, resolve_device, resolve_dtype


def test_the_tests_are_pinned_to_the_cpu_even_where_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host: conftest's EDGEKV_DEVICE still rules
    assert resolve_device(None).type == "cpu" and resolve_device(None, deployed="cuda").type == "cpu"


def test_the_device_named_wins_then_the_environment_then_the_deployed_one(monkeypatch):
    monkeypatch.delenv("EDGEKV_DEVICE")
    assert resolve_device("cpu", deployed="cuda").type == "cpu"
    assert resolve_device(None, deployed="cpu").type == "cpu"
    with pytest.raises(ConfigError, match="'tpu!' is not a torch device"):
        resolve_device("tpu!")


def test_a_gpu_asked_for_on_a_torch_without_cuda_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match=r"sees no CUDA GPU: .*torch.*; or run on the CPU \(--device cpu\)"):
        resolve_device("cuda")


def test_the_deployed_dtype_applies_on_the_device_it_was_deployed_on():
    cpu = torch.device("cpu")
    assert resolve_dtype(cpu) == torch.float32
    assert resolve_dtype(cpu, deployed="bfloat16", deployed_device="cpu") == torch.bfloat16
    assert resolve_dtype(cpu, deployed="float16", deployed_device="cuda") == torch.float32  # Orin's fp16, run here
    assert resolve_dtype(cpu, "float16", deployed="bfloat16", deployed_device="cpu") == torch.float16  # --dtype wins
    with pytest.raises(ConfigError, match="dtype 'fp8' is not one of"):
        resolve_dtype(cpu, "fp8")


def test_the_gpu_default_is_bf16_only_where_it_is_native(monkeypatch):
    gpu = torch.device("cuda")
    for native, want in ((True, torch.bfloat16), (False, torch.float16)):  # what a T4 or an Ampere card answers
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        assert resolve_dtype(gpu) == want


def test_an_engine_runs_in_the_dtype_its_config_was_deployed_with(kv_dir):
    deployed = {"platform": "local", "model": "fixture", "device": "cpu", "dtype": "bfloat16", "G": 4, "M": 8,
                "C": 16, "sigma": 8, "max_batch": 1, "max_context": 256,
                "solutions": [{"batch": 1, "context": 256, "G": 4, "M": 8, "C": 16, "sigma": 8}]}
    with Engine.from_pretrained("fixture", kv_offload_path=kv_dir, config=deployed) as engine:
        assert engine.model.dtype == torch.bfloat16
    with Engine.from_pretrained("fixture", kv_offload_path=kv_dir, config=deployed, dtype="float32") as engine:
        assert engine.model.dtype == torch.float32


def test_generate_takes_device_and_dtype_flags(kv_dir, capsys):
    assert main(["generate", "--model", "fixture", "--policy", "full", "--prompt", "[4, 5, 6]", "--max-new-tokens",
                 "3", "--device", "cpu", "--dtype", "bfloat16", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    with pytest.raises(SystemExit) as refused:  # argparse's choices: exit 2 naming the flag
        main(["generate", "--model", "fixture", "--prompt", "[4]", "--dtype", "fp8"])
    assert refused.value.code == 2 and "--dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_deploying_a_gpu_profile_where_torch_has_no_cuda_stops_naming_cuda_and_the_fix(tmp_path, monkeypatch,
                                                                                        capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    kv = tmp_path / "kv"
    rc = main(["deploy", "--platform", "rtx", "--model", "fixture", "--kv-path", str(kv)])
    err = capsys.readouterr().err
    assert rc == 2 and "computes on CUDA" in err and "Fix: install" in err and "--device cpu" in err
    assert not Path("deploy").exists() and not kv.exists()  # nothing measured, nothing written


def test_deploy_on_the_cpu_is_an_explicit_choice(monkeypatch):
    from edgekv.deploy import compute_device
    from edgekv.install.profile import load_profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rtx = load_profile("rtx")
    assert compute_device(rtx, "cpu").type == "cpu"
    assert compute_device(load_profile("local"), None).type == "cpu"
    with pytest.raises(DeviceUnavailable):
        compute_device(rtx, None)
