"""Jetson INA3221 rail monitors through hwmon: per channel in<N>_input (mV) and curr<N>_input (mA).

Channels 1-3 of each chip are the rails (Documentation/hwmon/ina3221.rst; in4-in7 and curr4
are shunt voltages and sums, not rails).  Channels labelled ``NC`` are not connected.

The total follows jetson-stats (jtop/core/power.py, ``total_power``): a module-input rail,
``VDD_IN`` (Orin NX/Nano, Xavier NX) or ``POM_5V_IN`` (Nano, TX), already contains every
other rail, so it alone is the total; without one (AGX Orin, AGX Xavier: two chips of
sub-rails) the total is the sum of the rails.  The input rail is the reading, the others
stay in ``rails_w``.
"""
from __future__ import annotations

from ..sysfs import read_int, read_text, sysfs_root
from .base import MeterUnavailable, PowerMeter

INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


class Ina3221Meter(PowerMeter):
    name = "ina3221"

    def __init__(self, rate_hz: float = 10.0):
        super().__init__(rate_hz)
        hwmon = sysfs_root() / "class/hwmon"
        devices = [d for d in sorted(hwmon.glob("hwmon*")) if read_text(d / "name") == "ina3221"] if hwmon.is_dir() else []
        self.channels = []  # (rail name, voltage file, current file)
        for dev in devices:
            for n in (1, 2, 3):
                volt, curr = dev / f"in{n}_input", dev / f"curr{n}_input"
                label = read_text(dev / f"in{n}_label")
                enabled = read_text(dev / f"in{n}_enable", "1") != "0"
                if volt.exists() and curr.exists() and label and label != "NC" and enabled:
                    self.channels.append((label, volt, curr))
        if not self.channels:
            raise MeterUnavailable(f"no ina3221 hwmon rails under {hwmon} (not a Jetson, or the driver is not bound)")
        names = [name for name, _, _ in self.channels]
        self.total_rail = next((r for r in INPUT_RAILS if r in names), None)
        self.notes.append(f"ina3221 total: {self.total_rail} (the module input)" if self.total_rail
                          else f"ina3221 total: the sum of {', '.join(names)} (no module-input rail)")

    def read(self):
        rails = {name: read_int(v) * read_int(c) / 1e6 for name, v, c in self.channels}  # mV * mA = uW -> W
        if self.total_rail:
            return rails.pop(self.total_rail), None, rails
        return sum(rails.values()), None, rails
