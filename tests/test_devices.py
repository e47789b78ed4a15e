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
from edgekv.runtime.devices import DeviceUnavailable, decode_threads, intra_op_threads, resolve_device, resolve_dtype


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


def test_an_engine_runs_in_the_dtype_its_config_was_deployed_with(kv_path):
    deployed = {"platform": "local", "model": "fixture", "device": "cpu", "dtype": "bfloat16", "G": 4, "M": 8,
                "C": 16, "sigma": 8, "max_batch": 1, "max_context": 256,
                "solutions": [{"batch": 1, "context": 256, "G": 4, "M": 8, "C": 16, "sigma": 8}]}
    with Engine.from_pretrained("fixture", kv_path=kv_path, config=deployed) as engine:
        assert engine.model.dtype == torch.bfloat16
    with Engine.from_pretrained("fixture", kv_path=kv_path, config=deployed, dtype="float32") as engine:
        assert engine.model.dtype == torch.float32


def test_an_engine_loads_the_weight_format_its_config_was_deployed_with_where_it_was_deployed(kv_path):
    deployed = {"platform": "local", "model": "fixture", "device": "cpu", "dtype": "float32", "weights": "int4",
                "G": 4, "M": 8, "C": 16, "sigma": 8, "max_batch": 1, "max_context": 256,
                "solutions": [{"batch": 1, "context": 256, "G": 4, "M": 8, "C": 16, "sigma": 8}]}
    with Engine.from_pretrained("fixture", kv_path=kv_path, config=deployed) as engine:
        assert engine.model.weights == "int4"
    with Engine.from_pretrained("fixture", kv_path=kv_path, config=deployed, weights="native") as engine:
        assert engine.model.weights == "native"  # named wins
    with Engine.from_pretrained("fixture", kv_path=kv_path, config=deployed, dtype="bfloat16") as engine:
        assert engine.model.weights == "native"  # not the deployed dtype: its own default, not a refusal


def test_generate_takes_device_and_dtype_flags(kv_path, capsys):
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


# ---- threads of a CPU decode step --------------------------------------------------------------------------------

def test_a_disk_policy_leaves_one_core_to_its_reads_and_an_asked_count_wins(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    cpu = torch.device("cpu")
    assert decode_threads(cpu, None, reads_kv=True) == 7
    assert decode_threads(cpu, None, reads_kv=False) is None  # full: torch's own setting
    assert decode_threads(cpu, None, reads_kv=False, helper_computes=True) == 7  # its layers on the helper
    assert decode_threads(cpu, 3, reads_kv=True) == 3 and decode_threads(cpu, 8, reads_kv=False) == 8
    assert decode_threads(torch.device("cuda"), 3, reads_kv=True) is None  # the GPU computes; host threads stay
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert decode_threads(cpu, None, reads_kv=True) == 1  # one core: nothing to leave


def test_the_thread_count_is_restored_after_the_block_even_when_it_raises():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with intra_op_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before


@pytest.mark.parametrize("policy", ["kvswap", "full"])
def test_a_decode_step_computes_on_the_batchs_threads_and_gives_the_same_tokens(model_dirs, tmp_path, monkeypatch,
                                                                                policy):
    """The step runs with the batch's thread count (seen from inside the model) and hands torch's back; the tokens
    do not depend on it."""
    monkeypatch.setattr(torch, "get_num_threads", _threads := _FakeThreads(4))
    monkeypatch.setattr(torch, "set_num_threads", _threads.set)
    seen = []
    runs = {}
    for asked in (None, 2):
        cfg = {"G": 4, "M": 6, "C": 12, "sigma": 2, "max_context": 128, "max_batch": 1, "decode_cpu_threads": asked}
        (kv := tmp_path / f"kv{asked}").mkdir()
        with Engine.from_pretrained(model_dirs["llama"], kv_path=kv, config=cfg,
                                    policy=policy, device="cpu") as engine:
            finish = engine.model.finish_layer
            monkeypatch.setattr(engine.model, "finish_layer", _decode_threads_into(seen, finish, _threads))
            runs[asked] = engine.generate([[5 + i % 90 for i in range(50)]], max_new_tokens=6, stop_token_ids=[])[0]
        assert _threads.n == 4  # handed back after every step
        expected = asked or (3 if policy == "kvswap" else 4)
        assert set(seen) == {expected} and runs[asked].stats["decode_threads"] == expected
        seen.clear()
    assert runs[None].token_ids == runs[2].token_ids


def test_the_compute_profile_is_sampled_on_a_disk_steps_threads(monkeypatch):
    """The solver's T_model prices a disk policy's step, so it is timed on that step's threads, and torch's come
    back after."""
    from types import SimpleNamespace

    from edgekv.install import compute

    monkeypatch.setattr(torch, "get_num_threads", threads := _FakeThreads(4))
    monkeypatch.setattr(torch, "set_num_threads", threads.set)
    seen = []
    for name in ("time_block", "time_reuse", "time_predictor"):
        monkeypatch.setattr(compute, name, lambda *a, **k: seen.append(threads.n) or 1.0)
    model = SimpleNamespace(device=torch.device("cpu"), dims=SimpleNamespace(n_layers=3))
    profile = compute.profile_compute(model, {}, [1], [1024], [16], 400)
    assert seen and set(seen) == {3} and threads.n == 4
    assert profile.block_ms and profile.predict_ms


def _decode_threads_into(seen: list, finish, threads):
    """``finish_layer`` noting the thread count of each decode layer (one token; the prefill's have many)."""
    def wrapped(layer, x, attn_out):
        if x.shape[1] == 1:
            seen.append(threads.n)
        return finish(layer, x, attn_out)
    return wrapped


class _FakeThreads:
    """torch's thread count, kept here: a test that changed the process's real count would slow the others."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self) -> int:
        return self.n

    def set(self, n: int) -> None:
        self.n = n
