"""Linux RAPL through powercap (Intel, and AMD on recent kernels): cumulative package energy in uJ."""
from __future__ import annotations

from ..sysfs import read_int, read_text, sysfs_root
from .base import MeterUnavailable, PowerMeter


class RaplMeter(PowerMeter):
    name = "rapl"

    def __init__(self, rate_hz: float = 10.0):
        super().__init__(rate_hz)
        base = sysfs_root() / "class/powercap"
        # top-level zones only (intel-rapl:0, not intel-rapl:0:0): sub-zones are already inside their package
        self.zones = sorted(p for p in base.glob("*-rapl:*") if p.name.count(":") == 1) if base.is_dir() else []
        if not self.zones:
            raise MeterUnavailable(f"no RAPL zones under {base} (not an Intel/AMD host, or powercap not loaded)")
        try:
            self._last = [read_int(z / "energy_uj") for z in self.zones]
        except (OSError, ValueError) as exc:
            raise MeterUnavailable(f"RAPL energy_uj unreadable ({exc}); run as root or allow reading energy_uj") from exc
        self._range = [read_int(z / "max_energy_range_uj") for z in self.zones]
        self._total_uj = 0
        self.domains = [read_text(z / "name", z.name) for z in self.zones]

    def read(self):
        for i, zone in enumerate(self.zones):
            raw = read_int(zone / "energy_uj")
            delta = raw - self._last[i]
            if delta < 0:  # the counter wrapped at max_energy_range_uj
                delta += self._range[i] + 1
            self._last[i] = raw
            self._total_uj += delta
        return None, self._total_uj / 1e6, {}
