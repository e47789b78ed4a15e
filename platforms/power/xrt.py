"""Xilinx XRT electrical sensors of the SmartSSD's FPGA card, from ``xrt-smi`` (XRT >= 2.17) or
``xbutil examine -r electrical`` JSON: ``power_consumption_watts`` and per-rail volts x amps."""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from .base import MeterUnavailable, PowerMeter


def run_examine(tool: str, device: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "electrical.json"
        cmd = [tool, "examine", "-r", "electrical", "-f", "JSON", "-o", str(out)] + (["-d", device] if device else [])
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if result.returncode != 0 or not out.exists():
            raise MeterUnavailable(f"{' '.join(cmd)} failed: {result.stderr.strip()[-300:]}")
        return json.loads(out.read_text())


def parse_electrical(report: dict) -> tuple[float, dict]:
    """(total W, {rail: W}) from an examine report; the first device's electrical section."""
    devices = report.get("devices") or []
    if not devices or "electrical" not in devices[0]:
        raise MeterUnavailable("the XRT report has no electrical section (is the card's management driver loaded?)")
    elec = devices[0]["electrical"]
    rails = {}
    for rail in elec.get("power_rails", []):
        volts, amps = rail.get("voltage", {}).get("volts"), rail.get("current", {}).get("amps")
        if volts not in (None, "N/A") and amps not in (None, "N/A"):
            rails[rail.get("id", rail.get("description", "rail"))] = float(volts) * float(amps)
    return float(elec["power_consumption_watts"]), rails


class XrtMeter(PowerMeter):
    name = "xrt"

    def __init__(self, rate_hz: float = 1.0, device: str | None = None, examine=None):
        super().__init__(rate_hz)
        if examine is None:
            tool = shutil.which("xrt-smi") or shutil.which("xbutil")
            if tool is None:
                raise MeterUnavailable("XRT is not installed or not sourced (source /opt/xilinx/xrt/setup.sh)")
            examine = lambda: run_examine(tool, device)  # noqa: E731
        self.examine = examine
        parse_electrical(self.examine())  # fail now, not in the sampling thread

    def read(self):
        total, rails = parse_electrical(self.examine())
        return total, None, rails
