"""The backend (runtime/kernels.py): resolved once for a device, the torch reference asked for by name, a library
that does not build leaving a CPU on the reference with the build's error, and every part of a policy taking its
kernels from the backend the engine resolved."""
import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.kernels import CPU_KERNELS, load_backend, resolve_backend

NATIVE = resolve_backend("cpu")
native_only = pytest.mark.skipif(NATIVE.name != "native", reason="no C compiler for the native kernels")


@native_only
def test_a_cpu_resolves_the_native_backend_once_with_every_library_loaded():
    assert resolve_backend(torch.device("cpu")) is NATIVE and resolve_backend("cpu", None) is NATIVE
    assert NATIVE.reason is None and sorted(NATIVE.libraries) == sorted(CPU_KERNELS)
    assert all(NATIVE.lib(name) is not None for name in CPU_KERNELS)


def test_the_torch_reference_holds_no_library_and_says_it_was_asked_for():
    reference = resolve_backend("cpu", "torch")
    assert reference.name == "torch" and reference.libraries == {} and reference.lib("score") is None
    assert "asked for" in reference.reason


@pytest.mark.parametrize("device, name, message", [("cpu", "fast", "backend 'fast': one of native, torch, cuda"),
                                                   ("cpu", "cuda", "backend 'cuda' runs on a GPU, not on cpu"),
                                                   ("cuda", "native", "backend 'native' runs on the CPU, not on cuda")])
def test_a_backend_the_device_cannot_run_is_refused_by_name(device, name, message):
    with pytest.raises(ValueError, match=message):
        resolve_backend(device, name)


def test_a_library_that_does_not_build_leaves_the_cpu_on_the_reference(failing_build, caplog):
    failing_build("dense", "the in-memory cache's decode attention", "x.c:1: error: broken")
    with caplog.at_level("WARNING", logger="edgekv.runtime.kernels"):
        backend = load_backend("cpu")
    assert backend.name == "torch" and backend.libraries == {}
    assert backend.reason == "building the in-memory cache's decode attention failed: x.c:1: error: broken"
    assert [r.getMessage() for r in caplog.records] == [f"{backend.reason}: every operation runs the torch reference"]
    with pytest.raises(OSError, match="error: broken"):
        load_backend("cpu", "native")


@native_only
@pytest.mark.parametrize("policy, extra", [("kvswap", {"reuse": True}), ("full", {})])
def test_each_part_of_a_policy_takes_its_kernels_from_the_engines_backend(tmp_path, monkeypatch, policy, extra):
    """A batch's policy built on the native backend holds the native scorer, slot assignment, request planning, one-call
    fetch planning, ring writes, records' or cache's attention and helper thread; on the torch backend the reference's,
    each chosen when it was built."""
    from edgekv.runtime.fetch_plan import NativePlanner
    from edgekv.runtime.offload.attention import SlotAttention
    from edgekv.runtime import aside

    monkeypatch.setattr(aside, "cores", lambda: 2)
    config = {"G": 4, "M": 6, "C": 12, "sigma": 2, "max_context": 128, "max_batch": 1, **extra}
    for name in ("native", "torch"):
        (tmp_path / name).mkdir()
        with Engine.from_pretrained("fixture", tmp_path / name, config=config, policy=policy, device="cpu",
                                    backend=name) as engine:
            assert engine.backend is resolve_backend("cpu", name)
            with engine.open_batch(1, 64) as batch:
                kv, native = batch.policy, name == "native"
                if policy == "full":
                    assert (kv.dense is not None) == native and (kv._attention == kv._dense_attention) == native
                    continue
                assert (kv.selector._scorer is not None) == native and isinstance(kv.attention, SlotAttention) == native
                assert (kv.aside is not None) == native and (kv.window.write == kv.window._write_native) == native
                assert isinstance(kv.planner, NativePlanner) == native and kv.takes_on_io == native
                assert (kv.slots._assign == kv.slots._assign_native) == native
                assert (kv.store._requests == kv.store._planned) == native
                assert kv.selector.stats()["scorer_fallback"] == (
                    None if native else "the torch backend (the torch reference was asked for): scored through torch")
