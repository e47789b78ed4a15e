"""jetson-stats (jtop): ``jetson.power`` = {'rail': {name: {'power': mW, ...}}, 'tot': {'power': mW, ...}}.

Layout from jetson-stats (4.x to 7.x), jtop/core/power.py: 'tot' is the VDD_IN / POM_5V_IN
rail (then named in 'tot' and removed from 'rail') or the sum of the rails.  The client is
opened with ``jtop(interval=seconds)`` (jtop/jtop.py) at the meter's period, so the service
refreshes as often as the meter reads; a service already running for another client keeps its
own interval, which ``jetson.interval`` reports and the notes repeat.  Before the first update,
or on a board without sensors, ``power`` is empty (or absent): such a read has no power.

When the service stops, the client's reader thread stores the error (``JtopException("Lost
connection with jtop server")``, or the socket's own) and ``jetson.power`` keeps returning the last
stats it got (jtop/jtop.py: ``run``, ``_get_data``); ``jetson.ok()`` raises that stored error, or
returns False once the client stopped.  So each read asks ``ok(spin=True)`` (no wait for fresh
data) first: a stopped service ends the trace instead of repeating its last values.

jetson-stats is AGPL-3.0 and needs its jtop service; it is imported only when this meter is
chosen, never installed by edgekv.  Without it the INA3221 hwmon reader covers the same rails.
"""
from __future__ import annotations

from .base import MeterFailed, MeterUnavailable, PowerMeter


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
            self._owned = source = jtop(interval=self.period_s)
            try:
                source.start()
            except Exception as exc:  # jtop raises its own JtopException when the service is down
                raise MeterUnavailable(f"the jtop service is not reachable ({exc}); sudo systemctl start jtop") from exc
            served_s = getattr(source, "interval", self.period_s)
            if served_s > self.period_s:
                self.notes.append(f"jtop service refreshes every {served_s:g} s (another client set it), slower than "
                                  f"the {self.period_s:g} s asked: consecutive samples repeat its values")
        self.source = source

    def read(self):
        self._check_alive()
        try:
            power = self.source.power or {}
        except KeyError:  # jtop's stats dict holds no 'power' until the service's first update
            power = {}
        rails = {name: r["power"] / 1000 for name, r in power.get("rail", {}).items() if "power" in r}
        total = power.get("tot", {}).get("power")
        return (total / 1000 if total is not None else None), None, rails

    def _check_alive(self) -> None:
        """Raise the client's stored error, or MeterFailed when it stopped."""
        if not self.source.ok(spin=True):
            raise MeterFailed("jtop: the client stopped (jetson.ok() is False), so its power values are no longer "
                              "updated; sudo systemctl restart jtop")

    def close(self):
        if self._owned is not None:
            self._owned.close()
