"""Platform detection and the Jetson module name, from fake /proc/device-tree trees.

The strings are the real ones: model and compatible of the kernel's device trees
(arch/arm64/boot/dts/nvidia/*.dts, NUL-terminated strings, compatible a NUL-separated list),
"Jetson-AGX" the model of L4T's AGX Xavier kit, L4T compatible values as NVIDIA's Jetson.GPIO
matches them (lib/python/Jetson/GPIO/gpio_pin_data.py: "nvidia,jetson-xavier", "+p3668-0000" ...),
and the module part numbers of jetson-stats' MODULE_NAME_TABLE (jtop/core/jetson_variables.py).
"""
import pytest

from edgekv.platforms import energy
from edgekv.platforms.detect import detect_platform, jetson_module
from edgekv.platforms.power import PowerSample, PowerTrace

AGX_ORIN = ("NVIDIA Jetson AGX Orin Developer Kit",
            ["nvidia,p3737-0000+p3701-0000", "nvidia,p3701-0000", "nvidia,tegra234"])
ORIN_NX = ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
           ["nvidia,p3768-0000+p3767-0000", "nvidia,p3767-0000", "nvidia,tegra234"])
ORIN_NANO = ("NVIDIA Jetson Orin Nano Developer Kit",
             ["nvidia,p3768-0000+p3767-0005", "nvidia,p3767-0005", "nvidia,tegra234"])
XAVIER_NX = ("NVIDIA Jetson Xavier NX Developer Kit", ["nvidia,p3509-0000+p3668-0000", "nvidia,tegra194"])
AGX_XAVIER = ("NVIDIA Jetson AGX Xavier Developer Kit", ["nvidia,p2972-0000", "nvidia,tegra194"])
L4T_AGX_XAVIER = ("Jetson-AGX", ["nvidia,jetson-xavier", "nvidia,tegra194"])
CUSTOM_CARRIER_NX = ("Vendor Box 3000", ["vendor,box3000+p3767-0001", "nvidia,p3767-0001", "nvidia,tegra234"])
JETSON_NANO = ("NVIDIA Jetson Nano Developer Kit", ["nvidia,p3450-0000", "nvidia,tegra210"])


def _tree(root, model, compatible, release=False):
    dt = root / "proc/device-tree"
    dt.mkdir(parents=True)
    (dt / "model").write_bytes(model.encode() + b"\0")
    (dt / "compatible").write_bytes(b"".join(c.encode() + b"\0" for c in compatible))
    if release:
        (root / "etc").mkdir()
        (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic\n")
    return root


@pytest.mark.parametrize("board, module", [
    (AGX_ORIN, "Jetson AGX Orin"), (ORIN_NX, "Jetson Orin NX"), (ORIN_NANO, "Jetson Orin Nano"),
    (XAVIER_NX, "Jetson Xavier NX"), (AGX_XAVIER, "Jetson AGX Xavier"), (L4T_AGX_XAVIER, "Jetson AGX Xavier"),
    (CUSTOM_CARRIER_NX, "Jetson Orin NX"), (JETSON_NANO, "other Jetson (NVIDIA Jetson Nano Developer Kit)"),
])
def test_every_jetson_runs_the_orin_profile_and_is_named(tmp_path, board, module):
    root = _tree(tmp_path, *board)
    assert detect_platform(root) == "orin"
    assert jetson_module(root) == module


def test_not_a_jetson_has_no_module(tmp_path):
    (tmp_path / "proc/driver/nvidia/gpus/0000:01:00.0").mkdir(parents=True)
    assert jetson_module(tmp_path) is None and detect_platform(tmp_path) == "rtx"


def test_the_energy_report_names_the_module(tmp_path):
    root = _tree(tmp_path, *ORIN_NX, release=True)
    trace = PowerTrace("ina3221", [PowerSample(0, 8.0), PowerSample(10**9, 8.0)])
    assert energy.report(trace, root=root).to_json()["jetson_module"] == "Jetson Orin NX"
