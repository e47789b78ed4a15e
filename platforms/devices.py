"""Platform adapters: what the deploy command needs to know about the machine, one class each.

The profile (data) says what the user wants; the adapter says what the hardware is: compute
device, memory model (Orin shares DRAM between CPU and GPU, so host copies are not pinned;
an RTX card gets pinned buffers and CUDA streams), the power meter order, the scorer backends
and the facts a profiling run records with its results.
"""
from __future__ import annotations

import os
import platform as host
import shutil
import subprocess
from pathlib import Path

from .power import open_meter
from .sysfs import read_text


def _run(cmd: list[str]) -> str:
    if not shutil.which(cmd[0]):
        return "unavailable"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return (out.stdout or out.stderr).strip() or "unavailable"
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"


class Platform:
    name = "local"
    unified_memory = False  # CPU and accelerator share DRAM
    pinned_host_buffers = False

    def __init__(self, profile):
        self.profile = profile

    @property
    def device(self) -> str:
        import torch

        return "cuda" if self.profile.device == "cuda" and torch.cuda.is_available() else "cpu"

    @property
    def slot_memory(self) -> str:
        """Where a GPU's reuse slots live (runtime config ``slot_memory``): the profile's choice, else mapped pinned
        host memory where CPU and GPU share DRAM (no copy to make), device memory fed by copies elsewhere."""
        return self.profile.slot_memory or ("mapped" if self.unified_memory else "device")

    @property
    def scorers(self) -> tuple[str, ...]:
        return self.profile.scorers

    def meter(self, rate_hz: float = 10.0):
        return open_meter(self.profile.power_meter if self.profile.power_meter != "auto" else "auto", self.name, rate_hz)

    def facts(self) -> dict:
        import torch

        return {"platform": self.name, "kernel": host.release(), "machine": host.machine(), "cpus": os.cpu_count(),
                "torch": torch.__version__, "cuda": torch.version.cuda, "device": self.device}

    def cache_facts(self) -> dict:
        """What a cached compute measurement must match to be reused: the GPU, its driver and CUDA, and on a
        Jetson the power mode (a profile measured at one nvpmodel mode is not this mode's); nothing that drifts
        between runs (clocks, temperatures)."""
        import torch

        gpu = torch.cuda.get_device_name(0) if self.device == "cuda" else None
        return {"gpu": gpu, "cuda": torch.version.cuda, "driver": gpu_driver() if gpu else None}


class LocalPlatform(Platform):
    name = "local"


class OrinPlatform(Platform):
    name = "orin"
    unified_memory = True

    def cache_facts(self) -> dict:
        return {**super().cache_facts(), "l4t": read_text(Path("/etc/nv_tegra_release"), "unavailable").splitlines()[0],
                "power_mode": power_mode(_run(["nvpmodel", "-q"]))}

    def facts(self) -> dict:
        return {**super().facts(), "l4t": read_text(Path("/etc/nv_tegra_release"), "unavailable").splitlines()[0],
                "nvpmodel": _run(["nvpmodel", "-q"]), "jetson_clocks": _run(["jetson_clocks", "--show"])[:400]}


class RtxPlatform(Platform):
    name = "rtx"
    pinned_host_buffers = True

    def facts(self) -> dict:
        facts = super().facts()
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            facts |= {"gpu": pynvml.nvmlDeviceGetName(h), "driver": pynvml.nvmlSystemGetDriverVersion(),
                      "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                      "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)}
            pynvml.nvmlShutdown()
        except Exception as exc:  # NVML absent or failing: the facts say so
            facts["gpu"] = f"unavailable ({exc})"
        return facts


class SmartSsdPlatform(Platform):
    name = "smartssd"

    def facts(self) -> dict:
        tool = shutil.which("xrt-smi") or shutil.which("xbutil") or "xbutil"
        return {**super().facts(), "xrt": _run([tool, "--version"])[:400],
                "shell": _run([tool, "examine"])[:400]}


def gpu_driver() -> str:
    """The NVIDIA driver's version (nvidia-smi's; a Jetson's is its L4T release, in the L4T fact instead)."""
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out != "unavailable" else out


def power_mode(nvpmodel_q: str) -> str:
    """``nvpmodel -q`` output -> the mode's name and id ("NV Power Mode: MAXN" then "0": "MAXN (0)")."""
    lines = [line.strip() for line in nvpmodel_q.splitlines() if line.strip()]
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("NV Power Mode")), None)
    mode = next((line for line in lines if line.isdigit()), None)
    return f"{name} ({mode})" if name and mode else (name or nvpmodel_q)


PLATFORMS = {p.name: p for p in (LocalPlatform, OrinPlatform, RtxPlatform, SmartSsdPlatform)}


def platform_for(profile) -> Platform:
    return PLATFORMS.get(profile.platform, LocalPlatform)(profile)
