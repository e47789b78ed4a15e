"""Energy of a workload: a meter sampled in the background, aligned with the runtime's step events.

``measure_energy(engine=...)`` subscribes to the engine's events; ``edgekv energy -- <cmd>``
measures a child process, which writes its events to ``EDGEKV_EVENTS_FILE`` (JSON lines on
the same monotonic clock).  Prefill is the union of prefill_start..prefill_end windows,
decode the union of decode steps; J/token divides by the prompt tokens and the generated
tokens of those windows.  A combined meter (``nvml+rapl``) reports each part beside the total.

A meter lost part-way (its source vanished or answered garbage) never stops the workload: the
report keeps ``energy_j`` None (the run's energy is unknown), says why in ``error``, and gives in
``meter_lost`` when it happened and the energy over the window its readings cover, with only the
phases that ended inside that window; nothing is extrapolated past the last reading.
"""
from __future__ import annotations

import csv
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .detect import jetson_module
from .power import PowerTrace, open_meter


@dataclass
class EnergyReport:
    meter: str
    energy_j: float | None  # None when the meter was lost part-way (see error and meter_lost)
    duration_s: float
    avg_power_w: float | None
    peak_power_w: float | None
    samples: int
    phases: dict = field(default_factory=dict)  # prefill/decode: energy_j, seconds, tokens, j_per_token
    parts: dict = field(default_factory=dict)  # per source of a combined meter (nvml, rapl): the same fields
    rate_hz: float | None = None  # the rate sampled at, after any cap
    samples_without_reading: int = 0  # samples with neither power nor counter (an "N/A" sensor, jtop before its update)
    notes: list = field(default_factory=list)  # what the meter covers and what it leaves out
    error: str | None = None  # why the meter stopped early; no energy for the whole run then
    jetson_module: str | None = None  # which Jetson this ran on (None elsewhere)
    # a lost meter: at_s (seconds from the first reading), error (the failed read), covered_s, and the
    # energy_j, avg/peak W, phases and parts of the covered window; phases_left_out counts the spans past it
    meter_lost: dict | None = None

    def to_json(self) -> dict:
        return self.__dict__.copy()


def phase_windows(events: list[dict]) -> dict[str, list[tuple[int, int, int]]]:
    """{'prefill': [(t0, t1, tokens)], 'decode': [(t0, t1, tokens)]} from step events (dicts with kind, t_ns, info)."""
    out = {"prefill": [], "decode": []}
    open_at = {}
    for e in events:
        kind, info = e["kind"], e.get("info", {})
        if kind in ("prefill_start", "decode_step_start"):
            open_at[kind] = e["t_ns"]
        elif kind == "prefill_end" and "prefill_start" in open_at:
            out["prefill"].append((open_at.pop("prefill_start"), e["t_ns"], int(info.get("tokens", 0))))
        elif kind == "decode_step_end" and "decode_step_start" in open_at:
            out["decode"].append((open_at.pop("decode_step_start"), e["t_ns"], int(info.get("active", 0))))
    return out


def _measure(trace: PowerTrace, windows: dict, until_ns: int | None = None) -> dict:
    """energy_j, duration_s, avg and peak W, and per-phase energy of one trace (up to ``until_ns`` when given)."""
    powers = [p for _, p in trace.powers_w()]
    energy = trace.energy_j(None, until_ns)
    duration = trace.duration_s
    phases = {}
    for name, spans in windows.items():
        if spans:
            joules = sum(trace.energy_j(t0, t1) for t0, t1, _ in spans)
            tokens = sum(n for _, _, n in spans)
            phases[name] = {"energy_j": joules, "seconds": sum(t1 - t0 for t0, t1, _ in spans) / 1e9,
                            "tokens": tokens, "j_per_token": joules / tokens if tokens else None}
    return {"energy_j": energy, "duration_s": duration, "avg_power_w": energy / duration if duration > 0 else 0.0,
            "peak_power_w": max(powers) if powers else 0.0, "phases": phases}


def report(trace: PowerTrace, events: list[dict] | None = None, root: str | Path = "/") -> EnergyReport:
    """The trace's energy, per phase and per part; a failed trace reports its error and no energy."""
    common = {"meter": trace.meter, "samples": len(trace.samples), "rate_hz": trace.rate_hz, "notes": list(trace.notes),
              "samples_without_reading": sum(s.power_w is None and s.energy_j is None
                                             for t in (list(trace.parts.values()) or [trace]) for s in t.samples),
              "jetson_module": jetson_module(root)}
    windows = phase_windows(events or [])
    if trace.error:
        return EnergyReport(energy_j=None, duration_s=trace.duration_s, avg_power_w=None, peak_power_w=None,
                            error=trace.error, meter_lost=_lost(trace, windows), **common)
    parts = {name: _measure(part, windows) for name, part in trace.parts.items()}
    return EnergyReport(**_measure(trace, windows), parts=parts, **common)


def _lost(trace: PowerTrace, windows: dict) -> dict:
    """The covered window of a lost meter: its readings' energy, and the phases that ended before its last one."""
    t0, end = trace.samples[0].t_ns, trace.samples[-1].t_ns
    covered = {name: [s for s in spans if s[1] <= end] for name, spans in windows.items()}
    measured = _measure(trace, covered, end)
    return {"at_s": (trace.lost_at_ns - t0) / 1e9 if trace.lost_at_ns is not None else None,
            "error": trace.lost_cause, "covered_s": trace.duration_s, "samples": len(trace.samples),
            "energy_j": measured["energy_j"], "avg_power_w": measured["avg_power_w"],
            "peak_power_w": measured["peak_power_w"], "phases": measured["phases"],
            "phases_left_out": {name: len(spans) - len(covered[name]) for name, spans in windows.items()},
            "parts": {name: _measure(part, covered, end) for name, part in trace.parts.items()}}


@contextmanager
def measure_energy(meter: str = "auto", platform: str | None = None, rate_hz: float = 10.0, engine=None):
    """``with measure_energy(engine=engine) as m: engine.generate(...)``; then ``m.report``, ``m.trace``, ``m.events``.

    A meter that cannot take its first reading raises MeterUnavailable before the body runs (closed, the engine
    left unsubscribed); one lost later lets the body finish and its report says so (see the module docstring)."""
    result = _Measurement(open_meter(meter, platform, rate_hz))
    try:
        result.meter.start()
    except BaseException:
        result.meter.close()
        raise
    if engine is not None:
        engine.events.subscribe(result.on_event)
    try:
        yield result
    finally:
        if engine is not None:
            engine.events.unsubscribe(result.on_event)
        result.trace = result.meter.stop()
        result.meter.close()
        result.report = report(result.trace, result.events)


class _Measurement:
    def __init__(self, meter):
        self.meter = meter
        self.events: list[dict] = []
        self.trace: PowerTrace | None = None
        self.report: EnergyReport | None = None

    def on_event(self, event) -> None:
        if event.kind != "groups_selected":
            self.events.append({"kind": event.kind, "t_ns": event.t_ns, "info": event.info})


def read_events(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_csv(path: Path, trace: PowerTrace) -> None:
    rails = sorted({r for s in trace.samples for r in s.rails_w})
    t0 = trace.samples[0].t_ns
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "power_w", "energy_j", *rails])
        for s in trace.samples:
            w.writerow([f"{(s.t_ns - t0) / 1e9:.4f}", s.power_w, s.energy_j, *[s.rails_w.get(r) for r in rails]])


def plot(path: Path, trace: PowerTrace, events: list[dict]) -> None:
    """Power over time with prefill and decode shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = trace.samples[0].t_ns
    pts = trace.powers_w()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot([t for t, _ in pts], [p for _, p in pts], "-", lw=1, label=f"power ({trace.meter})")
    for name, part in trace.parts.items():
        part_pts = part.powers_w()
        ax.plot([t for t, _ in part_pts], [p for _, p in part_pts], "-", lw=0.8, alpha=0.7, label=name)
    if trace.lost_at_ns is not None:
        ax.axvline((trace.lost_at_ns - t0) / 1e9, color="C3", ls="--", lw=1, label=f"meter lost ({trace.lost_cause})")
    colors = {"prefill": "C1", "decode": "C2"}
    for name, windows in phase_windows(events).items():
        for i, (a, b, _) in enumerate(windows):
            ax.axvspan((a - t0) / 1e9, (b - t0) / 1e9, color=colors[name], alpha=0.15, lw=0, label=name if i == 0 else None)
    ax.set(xlabel="time (s)", ylabel="W")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
