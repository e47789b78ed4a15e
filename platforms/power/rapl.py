"""Linux RAPL through powercap (Intel, and AMD on recent kernels): cumulative energy counters in uJ.

Which zones are summed, chosen by each zone's ``name`` file so no joule is counted twice:

* ``psys`` (the platform domain, top-level on Intel client machines) when present: it already
  contains the packages, so it is used alone;
* else every ``package-N`` (``package-N-die-M`` on multi-die parts) plus the ``dram`` sub-zones,
  because DRAM is outside the package domain on the servers that report it.

``core`` and ``uncore`` sub-zones are parts of their package and never added, and the
``intel-rapl-mmio`` control type re-exposes package-0 through MMIO, so only ``intel-rapl:*``
zones are read.  Layout from the kernel: Documentation/power/powercap/powercap.rst (the tree,
packages with core/uncore sub-zones) and drivers/powercap/intel_rapl_common.c (zone names;
psys registered without a parent, every other domain under its package).
``meter.domains`` lists the zones summed.
"""
from __future__ import annotations

from pathlib import Path

from ..sysfs import read_int, read_text, sysfs_root
from .base import MeterUnavailable, PowerMeter


def choose_zones(base: Path) -> list[tuple[str, Path]]:
    """[(label, zone folder)] to sum: psys alone, else packages and their dram sub-zones."""
    zones = sorted(base.glob("intel-rapl:*")) if base.is_dir() else []
    named = [(read_text(z / "name"), z) for z in zones]
    psys = [(name, z) for name, z in named if name == "psys" or name.startswith("psys-")]
    if psys:
        return psys
    packages = {z.name: name for name, z in named if z.name.count(":") == 1 and name.startswith("package")}
    drams = [(f"{packages[z.name.rsplit(':', 1)[0]]}/dram", z) for name, z in named
             if name == "dram" and z.name.rsplit(":", 1)[0] in packages]
    return [(name, base / zone) for zone, name in packages.items()] + drams


class RaplMeter(PowerMeter):
    name = "rapl"

    def __init__(self, rate_hz: float = 10.0):
        super().__init__(rate_hz)
        base = sysfs_root() / "class/powercap"
        chosen = choose_zones(base)
        if not chosen:
            raise MeterUnavailable(f"no RAPL zones (package or psys) under {base} (not an Intel/AMD host, or "
                                   "powercap not loaded: modprobe intel_rapl_msr)")
        self.domains = [label for label, _ in chosen]
        self.zones = [zone for _, zone in chosen]
        try:
            self._last = [read_int(z / "energy_uj") for z in self.zones]
        except (OSError, ValueError) as exc:
            raise MeterUnavailable(f"RAPL energy_uj unreadable ({exc}); run as root or allow reading energy_uj") from exc
        self._range = [read_int(z / "max_energy_range_uj") for z in self.zones]
        self._total_uj = 0
        self.notes.append(f"rapl domains summed: {', '.join(self.domains)}"
                          + (" (the platform domain, which contains the packages)" if self.domains[0].startswith("psys")
                             else ""))

    def read(self):
        for i, zone in enumerate(self.zones):
            raw = read_int(zone / "energy_uj")
            delta = raw - self._last[i]
            if delta < 0:  # the counter wrapped at max_energy_range_uj
                delta += self._range[i] + 1
            self._last[i] = raw
            self._total_uj += delta
        return None, self._total_uj / 1e6, {}
