"""The meter interface and its sampling loop; a meter only implements ``read()``.

A read returns the instantaneous power (W) and, where the hardware keeps one, a cumulative
energy counter (J).  Energy over a window comes from the counter when there is one (exact,
wrap-around handled by the meter), else from integrating power with the trapezoid rule.

A read that raises (the source vanished: a GPU off the bus, a sysfs file gone, a service
stopped, garbage where a number belongs) ends the sampling: the command being measured runs on,
the loss is logged, and the trace keeps the readings taken before it with the time it happened.
Energy is then given only over the window those readings cover; asked past it (or for the whole
measurement) the trace raises, because energy bridged across the missing samples would be a guess.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class MeterUnavailable(RuntimeError):
    """This meter's source is absent or unreadable on this machine; the message says what is missing."""


class MeterFailed(RuntimeError):
    """The meter stopped reading part-way through a measurement; the message says when and why."""


@dataclass(frozen=True)
class PowerSample:
    t_ns: int  # time.monotonic_ns(), the clock the runtime's step events use
    power_w: float | None
    energy_j: float | None = None  # cumulative counter, unwrapped
    rails_w: dict = field(default_factory=dict)


@dataclass
class PowerTrace:
    meter: str
    samples: list[PowerSample]
    rate_hz: float | None = None  # the rate the meter sampled at (after any cap)
    notes: list[str] = field(default_factory=list)  # what the numbers cover and what they miss
    error: str | None = None  # the read that ended sampling early: energy only up to the last reading
    parts: dict[str, PowerTrace] = field(default_factory=dict)  # per-source traces of a combined meter
    lost_at_ns: int | None = None  # when the failed read was made (the meter was lost then)
    lost_cause: str | None = None  # that read's exception, "Type: message"

    def energy_j(self, t0_ns: int | None = None, t1_ns: int | None = None) -> float:
        """Energy between two instants (default: the whole trace): the sum of the parts when the meter
        combines sources, else counter-based when available, else the integral of power.

        After a lost meter only a window ending at its last reading has an energy; the whole
        measurement, or a window reaching past that reading, raises MeterFailed."""
        if self.error and (t1_ns is None or t1_ns > self.samples[-1].t_ns):
            raise MeterFailed(self.error)
        t0 = self.samples[0].t_ns if t0_ns is None else t0_ns
        t1 = self.samples[-1].t_ns if t1_ns is None else t1_ns
        if self.parts:
            return sum(part.energy_j(t0, t1) for part in self.parts.values())
        if all(s.energy_j is not None for s in self.samples):
            return _interp(self.samples, t1, "energy_j") - _interp(self.samples, t0, "energy_j")
        return integrate_power(self.samples, t0, t1)

    @property
    def duration_s(self) -> float:
        return (self.samples[-1].t_ns - self.samples[0].t_ns) / 1e9

    def powers_w(self) -> list[tuple[float, float]]:
        """(seconds from start, W) per sample; from counter differences where the meter has no power reading."""
        t0 = self.samples[0].t_ns
        out = []
        for prev, cur in zip([None] + self.samples[:-1], self.samples):
            power = instant_power_w(prev, cur)
            if power is not None:
                out.append(((cur.t_ns - t0) / 1e9, power))
        return out


def instant_power_w(prev: PowerSample | None, cur: PowerSample) -> float | None:
    """The sample's power reading, else the counter's rate since the previous sample, else None."""
    if cur.power_w is not None:
        return cur.power_w
    if prev is not None and cur.energy_j is not None and prev.energy_j is not None and cur.t_ns > prev.t_ns:
        return (cur.energy_j - prev.energy_j) / ((cur.t_ns - prev.t_ns) / 1e9)
    return None


def _interp(samples, t_ns: int, attr: str) -> float:
    xs = [s.t_ns for s in samples]
    ys = [getattr(s, attr) for s in samples]
    if t_ns <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if t_ns <= x1:
            return y0 + (y1 - y0) * (t_ns - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[-1]


def integrate_power(samples, t0_ns: int, t1_ns: int) -> float:
    """Trapezoid integral of power (W) over [t0, t1] in joules, linear between samples."""
    pts = [(s.t_ns, s.power_w) for s in samples if s.power_w is not None]
    if len(pts) < 2 or t1_ns <= t0_ns:
        return 0.0
    total = 0.0
    for (x0, p0), (x1, p1) in zip(pts, pts[1:]):
        a, b = max(x0, t0_ns), min(x1, t1_ns)
        if b <= a:
            continue
        pa = p0 + (p1 - p0) * (a - x0) / (x1 - x0)
        pb = p0 + (p1 - p0) * (b - x0) / (x1 - x0)
        total += (pa + pb) / 2 * (b - a) / 1e9
    return total


def failure_text(exc: Exception) -> str:
    """"Type: message"; a MeterFailed already names its source and cause."""
    return str(exc) if isinstance(exc, MeterFailed) else f"{type(exc).__name__}: {exc}"


class PowerMeter:
    """Samples ``read()`` on a background thread at ``rate_hz`` between start() and stop().

    ``notes`` collects what a reader of the numbers must know (domains chosen, sources missing,
    rate caps); they travel with the trace into the energy report.
    """

    name = "abstract"

    def __init__(self, rate_hz: float = 10.0):
        if rate_hz <= 0:
            raise ValueError(f"rate_hz must be > 0, got {rate_hz}")
        self.rate_hz = rate_hz
        self.period_s = 1.0 / rate_hz
        self.notes: list[str] = []
        self._samples: list[PowerSample] = []
        self._error: str | None = None
        self._lost_at_ns: int | None = None
        self._lost_cause: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> tuple[float | None, float | None, dict]:
        """(power W or None, cumulative energy J or None, per-rail W)."""
        raise NotImplementedError

    def sample(self) -> PowerSample:
        power, energy, rails = self.read()
        s = PowerSample(time.monotonic_ns(), power, energy, rails)
        self._samples.append(s)
        return s

    def start(self) -> None:
        """Take the first reading and start the sampling thread; a meter that cannot read at all raises
        MeterUnavailable here, before anything is measured."""
        self._samples = []
        self._error = self._lost_at_ns = self._lost_cause = None
        self._stop.clear()
        try:
            self.sample()
        except Exception as exc:  # noqa: BLE001 - whatever the source raised, nothing can be measured
            raise MeterUnavailable(f"the {self.name} meter failed its first reading ({failure_text(exc)}), so nothing is "
                                   "measured; check its source and start again") from exc
        self._thread = threading.Thread(target=self._loop, name=f"edgekv-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - any failure ends sampling and is reported by stop()
                self._fail(exc)
                return

    def _fail(self, exc: Exception) -> None:
        self._lost_at_ns = time.monotonic_ns()
        self._lost_cause = failure_text(exc)
        t0 = self._samples[0].t_ns
        elapsed, covered = (self._lost_at_ns - t0) / 1e9, (self._samples[-1].t_ns - t0) / 1e9
        self._error = (f"the {self.name} meter was lost {elapsed:.1f} s into the measurement, after {len(self._samples)} "
                       f"samples: {self._lost_cause}; energy is reported only for the {covered:.1f} s its readings "
                       "cover (meter_lost in the report), never for the whole run: check the meter's source "
                       "and measure again")
        log.warning(self._error)

    def stop(self) -> PowerTrace:
        """The trace; when a read failed, ``trace.error`` says so and ``trace.energy_j()`` raises MeterFailed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is None:
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - same contract as the thread
                self._fail(exc)
        return PowerTrace(self.name, list(self._samples), self.rate_hz, list(self.notes), self._error,
                          lost_at_ns=self._lost_at_ns, lost_cause=self._lost_cause)

    def close(self) -> None:
        """Release the source; a meter whose source fails to close logs it and does not raise (the measurement
        it ends is already taken)."""
