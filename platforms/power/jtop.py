"""jetson-stats (jtop): ``jetson.power`` = {'rail': {name: {'power': mW, ...}}, 'tot': {'power': mW, ...}}.

jetson-stats is AGPL-3.0 and needs its jtop service; it is imported only when this meter is
chosen, never installed by edgekv.  Without it the INA3221 hwmon reader covers the same rails.
"""
from __future__ import annotations

from .base import MeterUnavailable, PowerMeter


class JtopMeter(PowerMeter):
    name = "jtop"

    def __init__(self, rate_hz: float = 10.0, source=None):
        super().__init__(rate_hz)
        self._owned = None
        if source is None:
            try:
                from jtop import jtop
            except ImportError as exc:
                raise MeterUnavailable("jetson-stats is not installed (pip install jetson-stats, then its service)") from exc
            self._owned = source = jtop()
            try:
                source.start()
            except Exception as exc:  # jtop raises its own JtopException when the service is down
                raise MeterUnavailable(f"the jtop service is not reachable ({exc}); sudo systemctl start jtop") from exc
        self.source = source

    def read(self):
        power = self.source.power
        rails = {name: r["power"] / 1000 for name, r in power.get("rail", {}).items() if "power" in r}
        return power["tot"]["power"] / 1000, None, rails

    def close(self):
        if self._owned is not None:
            self._owned.close()
