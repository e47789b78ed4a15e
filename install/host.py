"""What the install needs from the host before the venv exists: which torch, which extras, which reader.

Run by the system Python (the standard library only; ``make env`` calls it):

    python3 install/host.py plan --out .venv.plan.sh   # what it found, and shell assignments for the Makefile
    python3 install/host.py check                      # in the venv: a GPU host's torch sees its GPU

- A Jetson (L4T: ``/etc/nv_tegra_release``, or a Jetson/Tegra device tree): JetPack's own PyTorch is the one that
  drives the GPU, so the venv is made with ``--system-site-packages`` and pip is constrained to that torch (never
  replaced); a torch that is missing or has no CUDA stops the install naming NVIDIA's build for the L4T release;
  the ``jtop`` extra (jetson-stats); liburing's version decides the reader (io_uring needs 2.2+, L4T 36 ships 2.1:
  the pthread reader serves).
- An NVIDIA PC (``nvidia-smi`` answers): a CUDA build of torch from the PyTorch index for the newest CUDA the
  driver supports; a driver too old for any stops the install; the ``nvml`` extra (GPU power and clocks).
- Otherwise the CPU: the CPU torch (the wheel on disk here).

Every fact is read through ``HostFacts`` so the tests hand it what real hosts show.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CPU_TORCH = "torch==2.13.0"  # the CPU wheel this project's machines carry on disk
# PyTorch's CUDA wheel indexes, newest first (download.pytorch.org/whl/<tag>)
CUDA_WHEELS = ((13, 0, "cu130"), (12, 9, "cu129"), (12, 8, "cu128"), (12, 6, "cu126"), (12, 4, "cu124"),
               (12, 1, "cu121"), (11, 8, "cu118"))
# L4T release -> JetPack, and the folder of NVIDIA's PyTorch wheels for it (developer.download.nvidia.com/compute/
# redist/jp/<folder>/pytorch/; docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform)
JETPACK = {"36.4": ("6.1", "v61"), "36.3": ("6.0", "v60"), "36.2": ("6.0 DP", "v60dp"), "35.6": ("5.1.4", "v514"),
           "35.5": ("5.1.3", "v513"), "35.4": ("5.1.2", "v512"), "35.3": ("5.1.1", "v511"), "35.2": ("5.1", "v51")}
URING_DATA64 = (2, 2)  # io_uring_{sqe_set,cqe_get}_data64, which the io_uring reader uses, came with liburing 2.2


@dataclass
class HostFacts:
    """What a host shows: file contents and command outputs (None: absent)."""

    machine: str = ""
    tegra_release: str | None = None  # /etc/nv_tegra_release
    device_tree_model: str | None = None  # /proc/device-tree/model
    nvidia_smi: str | None = None  # `nvidia-smi` (its banner names the driver and the CUDA it supports)
    system_torch: str | None = None  # `python3 -c 'import torch; ...'`: "<version> <cuda or None>"
    liburing: str | None = None  # liburing's version (pkg-config, else dpkg)

    @classmethod
    def read(cls) -> "HostFacts":
        model = Path("/proc/device-tree/model")
        return cls(machine=platform.machine(), tegra_release=_read(Path("/etc/nv_tegra_release")),
                   device_tree_model=model.read_bytes().decode(errors="replace").strip("\0") if model.is_file() else None,
                   nvidia_smi=_run(["nvidia-smi"]),
                   system_torch=_run([sys.executable, "-c",
                                      "import torch; print(torch.__version__, torch.version.cuda)"]),
                   liburing=_run(["pkg-config", "--modversion", "liburing"])
                   or _run(["dpkg-query", "-W", "-f=${Version}", "liburing-dev"]))


@dataclass
class Plan:
    kind: str  # jetson, nvidia, cpu
    venv_flags: str = ""
    torch_pip: str = ""  # what pip installs torch from ("" : keep the system's)
    constraint: str = ""  # pins the system torch so pip never replaces it
    extras: list[str] = field(default_factory=lambda: ["dev"])
    reader: str = "io_uring or pthread (liburing decides at build)"
    notes: list[str] = field(default_factory=list)
    stop: str | None = None  # the install cannot give a working GPU torch: why, and the fix

    def shell(self) -> str:
        quote = lambda s: "'" + s.replace("'", "'\\''") + "'"  # noqa: E731
        return "\n".join([f"VENV_FLAGS={quote(self.venv_flags)}", f"TORCH_PIP={quote(self.torch_pip)}",
                          f"TORCH_CONSTRAINT={quote(self.constraint)}", f"EXTRAS={quote(','.join(self.extras))}"]) + "\n"


def plan(facts: HostFacts) -> Plan:
    if is_jetson(facts):
        return _jetson(facts)
    driver_cuda = driver_cuda_version(facts.nvidia_smi)
    if facts.nvidia_smi is not None and driver_cuda is not None:
        return _nvidia(facts, driver_cuda)
    return Plan("cpu", torch_pip=CPU_TORCH, reader=_reader(facts))


def is_jetson(facts: HostFacts) -> bool:
    model = (facts.device_tree_model or "").lower()
    return facts.tegra_release is not None or "jetson" in model or "tegra" in model


def l4t_release(tegra_release: str | None) -> str | None:
    """'# R36 (release), REVISION: 3.0, GCID: ...' -> '36.3'."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)", tegra_release or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def driver_cuda_version(nvidia_smi: str | None) -> tuple[int, int] | None:
    """nvidia-smi's banner ('Driver Version: 550.54.15   CUDA Version: 12.4') -> (12, 4)."""
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torch(system_torch: str | None) -> tuple[str, str | None] | None:
    """'2.5.0a0+872d972e41.nv24.08 12.6' -> (version, cuda); None when torch does not import."""
    words = (system_torch or "").split()
    if len(words) != 2 or not words[0][0].isdigit():
        return None
    return words[0], None if words[1] == "None" else words[1]


def _jetson(facts: HostFacts) -> Plan:
    release = l4t_release(facts.tegra_release)
    jetpack, folder = JETPACK.get(release or "", ("for this L4T release", None))
    where = (f"NVIDIA's PyTorch for JetPack {jetpack} (L4T R{release}): pip3 install a wheel from "
             f"https://developer.download.nvidia.com/compute/redist/jp/{folder}/pytorch/" if folder else
             f"NVIDIA's PyTorch for this JetPack (L4T {release or 'unknown'}): see "
             "docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform")
    out = Plan("jetson", venv_flags="--system-site-packages", extras=["dev", "jtop"], reader=_reader(facts),
               notes=[f"Jetson, L4T R{release or '?'} (JetPack {jetpack}): the venv uses the system's PyTorch"])
    torch = _torch(facts.system_torch)
    if torch is None:
        out.stop = f"no PyTorch in the system Python: install {where}, then make env again"
    elif torch[1] is None:
        out.stop = (f"the system's torch {torch[0]} is a CPU build (no CUDA): it cannot use this Jetson's GPU; "
                    f"install {where} in its place, then make env again")
    else:
        out.constraint = f"torch=={torch[0]}"
        out.notes.append(f"torch {torch[0]} with CUDA {torch[1]} kept (pip is constrained to it)")
    return out


def _nvidia(facts: HostFacts, driver_cuda: tuple[int, int]) -> Plan:
    tag = next((t for major, minor, t in CUDA_WHEELS if (major, minor) <= driver_cuda), None)
    out = Plan("nvidia", extras=["dev", "nvml"], reader=_reader(facts),
               notes=[f"NVIDIA driver supports CUDA {driver_cuda[0]}.{driver_cuda[1]}"])
    if tag is None:
        out.stop = (f"the NVIDIA driver supports CUDA {driver_cuda[0]}.{driver_cuda[1]}, older than any PyTorch build "
                    f"({CUDA_WHEELS[-1][2]} needs 11.8): update the driver, then make env again")
    else:
        out.torch_pip = f"torch --index-url https://download.pytorch.org/whl/{tag}"
        out.notes.append(f"torch from PyTorch's {tag} index (the newest CUDA the driver runs)")
    return out


def _reader(facts: HostFacts) -> str:
    version = tuple(int(x) for x in re.findall(r"\d+", facts.liburing or "")[:2])
    if not version:
        return "pthread (no liburing: install liburing-dev 2.2+ for the io_uring reader)"
    if version < URING_DATA64:
        return (f"pthread (liburing {'.'.join(map(str, version))} lacks the *_data64 calls the io_uring reader "
                f"uses; liburing 2.2+ enables it)")
    return f"io_uring (liburing {'.'.join(map(str, version))})"


def check() -> int:
    """In the venv: on a GPU host the torch that will run must see the GPU (exit 1 naming the fix)."""
    import torch  # noqa: PLC0415 (the venv's)

    facts = HostFacts.read()
    kind = plan(facts).kind
    if kind != "cpu" and not torch.cuda.is_available():
        print(f"install check: this host has an NVIDIA GPU ({kind}) but the venv's torch {torch.__version__} "
              f"(CUDA {torch.version.cuda}) cannot use it; make clean && make env, or see install/host.py",
              file=sys.stderr)
        return 1
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "the CPU"
    print(f"install check: torch {torch.__version__} computes on {where}")
    return 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _run(cmd: list[str]) -> str | None:
    if not shutil.which(cmd[0]) and not os.path.isabs(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the install's host plan (make env)")
    ap.add_argument("action", choices=("plan", "check"))
    ap.add_argument("--out", help="with plan: write the Makefile's shell assignments here")
    args = ap.parse_args(argv)
    if args.action == "check":
        return check()
    found = plan(HostFacts.read())
    for note in found.notes + [f"KV reader: {found.reader}"]:
        print(f"install: {note}")
    if found.stop:
        print(f"install: stopped: {found.stop}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(found.shell())
    else:
        print(json.dumps(found.__dict__, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
