"""Xilinx XRT electrical sensors of the SmartSSD's FPGA card, from ``xrt-smi`` (XRT >= 2.17) or
``xbutil examine -r electrical`` JSON: ``power_consumption_watts`` and per-rail volts x amps.

Report layout from XRT: tools/common/XBHelpMenus.cpp (``devices``: one entry per examined card,
``device_id`` its BDF as ``dddd:bb:dd.f``; ``system.host.devices[].bdf`` lists the cards in
XRT's index order) and common/sensor.cpp (``electrical``: ``power_rails[]`` with
``voltage.volts`` / ``current.amps``, ``power_consumption_watts``; any of them "N/A" when the
card has no reading, ``msg`` alone when it has no sensors).  An "N/A" power is no reading
(None), and the notes say it happened.

``-d`` takes a BDF (XBUtilities.cpp, ``str2index``: a bare index only names edge devices), so
a card index is turned into its BDF from the host report.  The device comes from ``device=``
or ``EDGEKV_XRT_DEVICE``.  Each read spawns the tool, which loads the host being measured,
so the rate is capped at ``MAX_RATE_HZ`` whatever is asked; ``meter.rate_hz`` is the rate used.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .base import MeterUnavailable, PowerMeter

MAX_RATE_HZ = 1.0


def run_examine(tool: str, report: str, device: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{report}.json"
        cmd = [tool, "examine", "-r", report, "-f", "JSON", "-o", str(out)] + (["-d", device] if device else [])
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if result.returncode != 0 or not out.exists():
            raise MeterUnavailable(f"{' '.join(cmd)} failed: {result.stderr.strip()[-300:]}")
        return json.loads(out.read_text())


def _number(value) -> float | None:
    """XRT writes sensor values as strings; "N/A" (or nothing) is no reading."""
    if value in (None, "", "N/A"):
        return None
    return float(value)


def _bdf(text: str) -> str:
    """XRT's spelling of a BDF: lower case, with the domain (``3b:00.1`` -> ``0000:3b:00.1``)."""
    text = text.strip().lower()
    return text if text.count(":") == 2 else f"0000:{text}"


def device_bdfs(host_report: dict) -> list[str]:
    """The cards' BDFs in XRT's index order, from ``examine -r host``."""
    return [_bdf(d["bdf"]) for d in host_report.get("system", {}).get("host", {}).get("devices", []) if "bdf" in d]


def pick_device(report: dict, bdf: str | None) -> dict:
    """The examined card: the one with ``bdf`` (function optional), else the only one."""
    devices = report.get("devices") or []
    ids = [d.get("device_id", "?") for d in devices]
    if bdf is None:
        if len(devices) == 1:
            return devices[0]
        raise MeterUnavailable(f"the XRT report has {len(devices)} cards {ids}; set EDGEKV_XRT_DEVICE to one BDF")
    want = _bdf(bdf)
    for dev in devices:
        have = _bdf(dev.get("device_id", ""))
        if have == want or ("." not in want and have.startswith(want + ".")):
            return dev
    raise MeterUnavailable(f"the XRT report has no card {want} (it has {ids}); set EDGEKV_XRT_DEVICE to one of them")


def parse_electrical(report: dict, bdf: str | None = None) -> tuple[float | None, dict]:
    """(total W or None when "N/A", {rail: W}) of one card's electrical section."""
    device = pick_device(report, bdf)
    elec = device.get("electrical")
    if not elec or "power_consumption_watts" not in elec:
        detail = f" ({elec['msg']})" if elec and "msg" in elec else ""
        raise MeterUnavailable(f"the XRT report has no electrical section{detail} "
                               "(is the card's management driver loaded?)")
    rails = {}
    for rail in elec.get("power_rails", []):
        volts, amps = _number(rail.get("voltage", {}).get("volts")), _number(rail.get("current", {}).get("amps"))
        if volts is not None and amps is not None:
            rails[rail.get("id", rail.get("description", "rail"))] = volts * amps
    return _number(elec["power_consumption_watts"]), rails


class XrtMeter(PowerMeter):
    name = "xrt"

    def __init__(self, rate_hz: float = 1.0, device: str | int | None = None, examine=None):
        super().__init__(min(rate_hz, MAX_RATE_HZ))
        if rate_hz > MAX_RATE_HZ:
            self.notes.append(f"xrt sampled at {MAX_RATE_HZ:g} Hz, not the {rate_hz:g} Hz asked: each read spawns "
                              "xbutil/xrt-smi, which would load the host being measured")
        if examine is None:
            tool = shutil.which("xrt-smi") or shutil.which("xbutil")
            if tool is None:
                raise MeterUnavailable("XRT is not installed or not sourced (source /opt/xilinx/xrt/setup.sh)")
            examine = lambda report, dev: run_examine(tool, report, dev)  # noqa: E731
        self.examine = examine
        self._na_reads = 0
        device = os.environ.get("EDGEKV_XRT_DEVICE") if device is None else device
        self.device = self._resolve(str(device)) if device is not None else None
        total, _ = parse_electrical(self.examine("electrical", self.device), self.device)  # fail now, not in the thread
        if total is None:
            raise MeterUnavailable("the card reports power_consumption_watts N/A (no power sensor reading)")

    def _resolve(self, device: str) -> str:
        """A card index -> its BDF from XRT's host report; a BDF as given."""
        if not device.isdigit():
            return _bdf(device)
        bdfs = device_bdfs(self.examine("host", None))
        if int(device) >= len(bdfs):
            raise MeterUnavailable(f"XRT lists {len(bdfs)} cards {bdfs}, no index {device}; pass one of their BDFs")
        return bdfs[int(device)]

    def read(self):
        total, rails = parse_electrical(self.examine("electrical", self.device), self.device)
        if total is None:
            self._na_reads += 1
            if self._na_reads == 1:
                self.notes.append("xrt: the card answered power_consumption_watts N/A; those samples have no power")
        return total, None, rails
