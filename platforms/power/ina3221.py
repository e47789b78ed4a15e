"""Jetson INA3221 rail monitors through hwmon: per channel in<N>_input (mV) and curr<N>_input (mA)."""
from __future__ import annotations

from ..sysfs import read_int, read_text, sysfs_root
from .base import MeterUnavailable, PowerMeter


class Ina3221Meter(PowerMeter):
    """Total = the sum of the monitored rails (what jtop reports as 'tot')."""

    name = "ina3221"

    def __init__(self, rate_hz: float = 10.0):
        super().__init__(rate_hz)
        hwmon = sysfs_root() / "class/hwmon"
        devices = [d for d in sorted(hwmon.glob("hwmon*")) if read_text(d / "name") == "ina3221"] if hwmon.is_dir() else []
        self.channels = []  # (rail name, voltage file, current file)
        for dev in devices:
            for volt in sorted(dev.glob("in*_input")):
                n = volt.name[2:-6]
                curr = dev / f"curr{n}_input"
                label = read_text(dev / f"in{n}_label")
                if curr.exists() and label and read_text(dev / f"in{n}_enable", "1") != "0":
                    self.channels.append((label, volt, curr))
        if not self.channels:
            raise MeterUnavailable(f"no ina3221 hwmon rails under {hwmon} (not a Jetson, or the driver is not bound)")

    def read(self):
        rails = {name: read_int(v) * read_int(c) / 1e6 for name, v, c in self.channels}  # mV * mA = uW -> W
        return sum(rails.values()), None, rails
