"""Several meters read together, e.g. an RTX host: the GPU board (NVML) and the host's CPU and
DRAM (RAPL) cover disjoint parts, so their energies add up.

Every sample reads each part at the same instant; the trace keeps one trace per part
(``trace.parts``), so each part's energy comes from its own counter or integral, and the total
is their sum.  A sample's power is the parts' power summed (a counter-only part contributes
its rate since the previous sample) and its rails are the parts' powers side by side.

A part that fails a read ends the whole trace at the last sample every part read (the total
would otherwise silently drop that part's share); the error names the part.
"""
from __future__ import annotations

import logging
import time

from .base import MeterFailed, PowerMeter, PowerSample, PowerTrace, failure_text, instant_power_w

log = logging.getLogger(__name__)


class CompositeMeter(PowerMeter):
    def __init__(self, parts: list[PowerMeter]):
        if not parts:
            raise ValueError("a composite meter needs at least one part")
        super().__init__(min(p.rate_hz for p in parts))  # the slowest part's cap (xrt) holds for the whole
        self.parts = parts
        self.name = "+".join(p.name for p in parts)
        self.notes = [note for p in parts for note in p.notes]
        self._part_samples: dict[str, list[PowerSample]] = {p.name: [] for p in parts}

    def sample(self) -> PowerSample:
        readings = []
        for part in self.parts:
            try:
                readings.append(part.read())
            except Exception as exc:  # noqa: BLE001 - tagged with the part, handled as any failed read
                raise MeterFailed(f"{part.name}: {failure_text(exc)}") from exc
        t_ns = time.monotonic_ns()
        powers, rails = [], {}
        for part, (power, energy, part_rails) in zip(self.parts, readings):
            history = self._part_samples[part.name]
            s = PowerSample(t_ns, power, energy, part_rails)
            powers.append(instant_power_w(history[-1] if history else None, s))
            history.append(s)
            rails[part.name] = powers[-1]
            rails.update({f"{part.name}:{rail}": w for rail, w in part_rails.items()})
        total = sum(powers) if all(p is not None for p in powers) else None
        s = PowerSample(t_ns, total, None, rails)
        self._samples.append(s)
        return s

    def start(self) -> None:
        self._part_samples = {p.name: [] for p in self.parts}
        super().start()

    def stop(self) -> PowerTrace:
        trace = super().stop()
        trace.notes = list(dict.fromkeys(self.notes + [n for p in self.parts for n in p.notes]))
        trace.parts = {p.name: PowerTrace(p.name, list(self._part_samples[p.name]), trace.rate_hz)
                       for p in self.parts}
        return trace

    def close(self) -> None:
        """Every part is closed, even after one fails to: that one is logged, as a single meter's close would be."""
        for part in self.parts:
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - the others must still be closed
                log.warning("%s: closing failed (%s); the measurement is unaffected", part.name, failure_text(exc))
