"""ggml's CPU library (llama.cpp's tensor library) for the ``ggml`` weight format, built once into the cache where
runtime/ggml_weights.py looks for it: the source of the llama-cpp-python release the format was checked against, from
the package index (its source package vendors llama.cpp), of which only ggml-base and ggml-cpu are compiled, for this
CPU (about 40 s on 2 cores, where the whole package builds llama.cpp for ~15 minutes).

    python -m edgekv.install.ggml_build        # make ggml (make deploy and make test run it)

Without cmake, a C++ compiler or the index it says which is missing and exits 1; the format is then unavailable
and the install step deploys the next one (int4).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from edgekv.runtime.ggml_weights import LIBRARIES, ggml_cache_folder

PACKAGE = "llama-cpp-python==0.3.36"  # its llama.cpp's ggml 0.25.3; runtime/ggml_weights.py checks the traits it reads
SOURCE_STAMP = "source.txt"  # in the built folder: the package it was built from (another one is built again)
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DGGML_BACKEND_DL=OFF",
               "-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_CURL=OFF")


class GgmlBuildError(RuntimeError):
    """What stopped the build, and the fix."""


def built(folder: Path) -> bool:
    """Whether ``folder`` holds both libraries, built from ``PACKAGE``."""
    stamp = folder / SOURCE_STAMP
    return all((folder / name).is_file() for name in LIBRARIES) and stamp.is_file() and stamp.read_text() == PACKAGE


def missing_tools() -> list[str]:
    """The build tools this machine lacks."""
    need = {"cmake": ("cmake",), "a C++ compiler": ("c++", "g++", "clang++"), "a C compiler": ("cc", "gcc", "clang")}
    return [what for what, names in need.items() if not any(shutil.which(n) for n in names)]


def fetch_source(work: Path) -> Path:
    """``PACKAGE``'s source package downloaded into ``work`` and its llama.cpp tree extracted: that tree."""
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", "-d", str(work),
         PACKAGE], f"downloading the llama.cpp source (pip download {PACKAGE})")
    archive = next(work.glob("llama_cpp_python-*.tar.gz"), None)
    if archive is None:
        raise GgmlBuildError(f"pip downloaded no source package of {PACKAGE} into {work}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.10.12+ / 3.11.4+
        tar.extractall(work, members=members, **safe)
    return next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))


def compile_ggml(source: Path, work: Path, progress) -> Path:
    """ggml-base and ggml-cpu built from the llama.cpp tree ``source`` under ``work``: the folder holding them.
    ``progress(done, total)`` follows the build's steps."""
    build_dir = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_FLAGS], "configuring ggml (cmake)")
    command = ["cmake", "--build", str(build_dir), "--target", "ggml-cpu", "--parallel"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            step = re.match(r"\[(\d+)/(\d+)\]|\[\s*(\d+)%\]", line)
            if step and step.group(1):
                progress(int(step.group(1)), int(step.group(2)))
            elif step:
                progress(int(step.group(3)), 100)
    if proc.returncode:
        raise GgmlBuildError(f"building ggml failed ({' '.join(command)}):\n{''.join(lines[-30:])}")
    return build_dir / "bin"


def install(built_dir: Path, folder: Path) -> None:
    """The two libraries copied from ``built_dir`` into ``folder`` in one rename: never half a folder."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in LIBRARIES:
        shutil.copy2((built_dir / name).resolve(), tmp / name)
    (tmp / SOURCE_STAMP).write_text(PACKAGE)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise GgmlBuildError(f"{what} failed:\n{(result.stderr or result.stdout).strip()[-3000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="build ggml's CPU library for the 'ggml' weight format into the cache")
    ap.add_argument("--force", action="store_true", help="build again even if the cache has it")
    args = ap.parse_args(argv)
    folder = ggml_cache_folder()
    if built(folder) and not args.force:
        print(f"ggml: {folder} (built from {PACKAGE})")
        return 0
    lacking = missing_tools()
    if lacking:
        print(f"ggml: not built, this machine lacks {' and '.join(lacking)} (e.g. apt-get install cmake g++); "
              "the 'ggml' weight format is skipped and int4 serves", file=sys.stderr)
        return 1
    from tqdm import tqdm

    try:
        with tempfile.TemporaryDirectory(prefix="edgekv-ggml-") as tmp:
            print(f"ggml: downloading {PACKAGE}'s source (76 MB)", file=sys.stderr, flush=True)
            source = fetch_source(Path(tmp))
            with tqdm(total=100, desc="ggml build", unit="step", file=sys.stderr) as bar:  # its ETA: the compile's

                def progress(done: int, total: int) -> None:
                    bar.total = total
                    bar.n = done
                    bar.refresh()

                install(compile_ggml(source, Path(tmp), progress), folder)
    except GgmlBuildError as exc:
        print(f"ggml: not built: {exc}\nthe 'ggml' weight format is skipped and int4 serves", file=sys.stderr)
        return 1
    print(f"ggml: built {folder} from {PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
