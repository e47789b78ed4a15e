"""Where the ``ggml`` weight format finds ggml's CPU library (runtime/ggml_weights.py ggml_folder) and when
``make ggml`` (install/ggml_build.py) builds it again; the build itself downloads llama.cpp's source and is run by
make, not here."""
import importlib.util

import pytest

from edgekv.install import ggml_build
from edgekv.runtime import ggml_weights
from edgekv.runtime.ggml_weights import GGML_LIB_ENV, LIBRARIES, ggml_cache_folder, ggml_folder


def _libraries(folder, stamp=None):
    folder.mkdir(parents=True, exist_ok=True)
    for name in LIBRARIES:
        (folder / name).write_bytes(b"")
    if stamp is not None:
        (folder / ggml_build.SOURCE_STAMP).write_text(stamp)
    return folder


def test_the_library_is_looked_for_in_the_env_then_the_cache_then_llama_cpp_python(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(GGML_LIB_ENV, raising=False)
    package = tmp_path / "site" / "llama_cpp"
    _libraries(package / "lib")
    spec = importlib.util.spec_from_loader("llama_cpp", loader=None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "llama_cpp" else real(name))
    assert ggml_folder() == package / "lib"
    cached = _libraries(ggml_cache_folder())
    assert ggml_folder() == cached
    monkeypatch.setenv(GGML_LIB_ENV, str(tmp_path / "mine"))
    assert ggml_folder() == tmp_path / "mine"
    monkeypatch.delenv(GGML_LIB_ENV)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else real(name))
    (cached / LIBRARIES[1]).unlink()  # half a build is no library
    assert ggml_folder() is None


def test_without_the_library_the_format_names_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(ggml_weights, "ggml_folder", lambda: None)
    ggml_weights.ggml.cache_clear()
    try:
        assert "make ggml builds it" in ggml_weights.ggml_unavailable()
        monkeypatch.setattr(ggml_weights, "ggml_folder", lambda: _libraries(tmp_path / "empty"))  # files, no library
        ggml_weights.ggml.cache_clear()
        assert "does not load" in ggml_weights.ggml_unavailable()
    finally:
        ggml_weights.ggml.cache_clear()


def test_a_build_from_another_package_or_an_unfinished_one_is_built_again(tmp_path):
    assert ggml_build.built(_libraries(tmp_path / "ok", ggml_build.PACKAGE))
    assert not ggml_build.built(_libraries(tmp_path / "old", "llama-cpp-python==0.3.1"))
    assert not ggml_build.built(_libraries(tmp_path / "unstamped"))


def test_a_machine_without_the_tools_is_told_which_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    monkeypatch.setattr(ggml_build.shutil, "which", lambda name: None)
    assert ggml_build.main([]) == 1
    assert "lacks cmake and a C++ compiler and a C compiler" in capsys.readouterr().err
    assert not (tmp_path / "ggml").exists()


@pytest.mark.parametrize("fail_at", ["fetch", "compile"])
def test_a_failed_build_leaves_no_folder(tmp_path, monkeypatch, fail_at, capsys):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    monkeypatch.setattr(ggml_build, "missing_tools", lambda: [])

    def fetch(work):
        if fail_at == "fetch":
            raise ggml_build.GgmlBuildError("downloading the llama.cpp source failed: no index")
        return work

    def compile_ggml(source, work, progress):
        raise ggml_build.GgmlBuildError("building ggml failed: an error")

    monkeypatch.setattr(ggml_build, "fetch_source", fetch)
    monkeypatch.setattr(ggml_build, "compile_ggml", compile_ggml)
    assert ggml_build.main([]) == 1
    assert "int4 serves" in capsys.readouterr().err
    folder = ggml_cache_folder()
    assert not folder.exists() and not folder.with_name(folder.name + ".tmp").exists()
