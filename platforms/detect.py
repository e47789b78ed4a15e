"""Which platform is this machine?  A Jetson, then RTX, then SmartSSD, else ``local``.

Every probe reads files under ``root`` (default ``/``) so a test can hand it a fake tree;
the NVML probe is the only one that calls a library, and it is skipped when absent.
"""
from __future__ import annotations

from pathlib import Path


# (text in the device-tree model, module): the model strings of the kernel's device trees
# (arch/arm64/boot/dts/nvidia: tegra234-p3737-0000+p3701-0000.dts "NVIDIA Jetson AGX Orin Developer Kit",
# tegra234-p3768-0000+p3767-0000.dts "NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
# tegra234-p3768-0000+p3767-0005.dts "NVIDIA Jetson Orin Nano Developer Kit", tegra194-p2972-0000.dts
# "NVIDIA Jetson AGX Xavier Developer Kit", tegra194-p3509-0000+p3668-0000.dts "NVIDIA Jetson Xavier NX
# Developer Kit") and L4T's "Jetson-AGX" for the AGX Xavier kit.
MODEL_NAMES = (("agx orin", "Jetson AGX Orin"), ("orin nx", "Jetson Orin NX"), ("orin nano", "Jetson Orin Nano"),
               ("agx xavier", "Jetson AGX Xavier"), ("jetson-agx", "Jetson AGX Xavier"),
               ("xavier nx", "Jetson Xavier NX"))
# module part numbers in the device tree's compatible list, for carriers with their own model string
# (jetson-stats, jtop/core/jetson_variables.py, MODULE_NAME_TABLE; p2972 the AGX Xavier kit, as Jetson.GPIO matches it)
PART_NAMES = (("p3701-", "Jetson AGX Orin"), ("p3767-0000", "Jetson Orin NX"), ("p3767-0001", "Jetson Orin NX"),
              ("p3767-0003", "Jetson Orin Nano"), ("p3767-0004", "Jetson Orin Nano"),
              ("p3767-0005", "Jetson Orin Nano"), ("p2888-", "Jetson AGX Xavier"), ("p2972-", "Jetson AGX Xavier"),
              ("p3668-", "Jetson Xavier NX"))


def _device_tree(root: Path, name: str) -> list[str]:
    """A device-tree property's strings (NUL-separated, NUL-terminated); [] when absent."""
    path = root / "proc/device-tree" / name
    if not path.is_file():
        return []
    return [s for s in path.read_bytes().decode(errors="replace").split("\0") if s]


def is_jetson(root: Path) -> bool:
    """L4T writes /etc/nv_tegra_release; the device tree names a Jetson or a Tegra SoC."""
    model = " ".join(_device_tree(root, "model")).lower()
    compatible = _device_tree(root, "compatible")
    return ((root / "etc/nv_tegra_release").is_file() or "jetson" in model
            or any(c.startswith("nvidia,tegra") for c in compatible))


def jetson_module(root: str | Path = "/") -> str | None:
    """The Jetson module ("Jetson AGX Orin", "Jetson Orin NX", "Jetson Orin Nano", "Jetson AGX Xavier",
    "Jetson Xavier NX", else "other Jetson (<model>)"), or None when this is not a Jetson."""
    root = Path(root)
    if not is_jetson(root):
        return None
    model = " ".join(_device_tree(root, "model"))
    for text, module in MODEL_NAMES:
        if text in model.lower():
            return module
    parts = [p for c in _device_tree(root, "compatible") for p in c.removeprefix("nvidia,").split("+")]
    for prefix, module in PART_NAMES:
        if any(p.startswith(prefix) for p in parts):
            return module
    return f"other Jetson ({model or 'no device-tree model'})"


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
    """The profile name for this machine: every Jetson runs the ``orin`` profile (``jetson_module`` names which)."""
    root = Path(root)
    if is_jetson(root):
        return "orin"
    if has_nvidia_gpu(root):
        return "rtx"
    if has_xrt_device(root):
        return "smartssd"
    return "local"
