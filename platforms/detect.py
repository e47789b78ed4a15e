"""Which platform is this machine?  Orin, then RTX, then SmartSSD, else ``local``.

Every probe reads files under ``root`` (default ``/``) so a test can hand it a fake tree;
the NVML probe is the only one that calls a library, and it is skipped when absent.
"""
from __future__ import annotations

from pathlib import Path


def is_orin(root: Path) -> bool:
    """L4T writes /etc/nv_tegra_release; the device tree names the module."""
    if (root / "etc/nv_tegra_release").is_file():
        return True
    model = root / "proc/device-tree/model"
    return model.is_file() and "orin" in model.read_bytes().decode(errors="replace").lower()


def has_xrt_device(root: Path) -> bool:
    """A Xilinx card bound to XRT's xocl/xclmgmt driver (the SmartSSD's FPGA)."""
    for driver in ("xocl", "xclmgmt"):
        folder = root / "sys/bus/pci/drivers" / driver
        if folder.is_dir() and any(p.name.count(":") == 2 for p in folder.iterdir()):
            return True
    return False


def has_nvidia_gpu(root: Path) -> bool:
    """An NVIDIA driver with at least one GPU (procfs), confirmed by NVML when it is installed."""
    gpus = root / "proc/driver/nvidia/gpus"
    if not (gpus.is_dir() and any(gpus.iterdir())):
        return False
    if str(root) != "/":
        return True
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return True
    try:
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return False


def detect_platform(root: str | Path = "/") -> str:
    """The profile name for this machine."""
    root = Path(root)
    if is_orin(root):
        return "orin"
    if has_nvidia_gpu(root):
        return "rtx"
    if has_xrt_device(root):
        return "smartssd"
    return "local"
