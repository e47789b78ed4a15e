"""Energy of a workload: a meter sampled in the background, aligned with the runtime's step events.

``measure_energy(engine=...)`` subscribes to the engine's events; ``edgekv energy -- <cmd>``
measures a child process, which writes its events to ``EDGEKV_EVENTS_FILE`` (JSON lines on
the same monotonic clock).  Prefill is the union of prefill_start..prefill_end windows,
decode the union of decode steps; J/token divides by the prompt tokens and the generated
tokens of those windows.
"""
from __future__ import annotations

import csv
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .power import PowerTrace, open_meter


@dataclass
class EnergyReport:
    meter: str
    energy_j: float
    duration_s: float
    avg_power_w: float
    peak_power_w: float
    samples: int
    phases: dict = field(default_factory=dict)  # prefill/decode: energy_j, seconds, tokens, j_per_token

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


def report(trace: PowerTrace, events: list[dict] | None = None) -> EnergyReport:
    powers = [p for _, p in trace.powers_w()]
    energy = trace.energy_j()
    duration = trace.duration_s
    phases = {}
    for name, windows in phase_windows(events or []).items():
        if windows:
            joules = sum(trace.energy_j(t0, t1) for t0, t1, _ in windows)
            tokens = sum(n for _, _, n in windows)
            phases[name] = {"energy_j": joules, "seconds": sum(t1 - t0 for t0, t1, _ in windows) / 1e9,
                            "tokens": tokens, "j_per_token": joules / tokens if tokens else None}
    return EnergyReport(trace.meter, energy, duration, energy / duration if duration > 0 else 0.0,
                        max(powers) if powers else 0.0, len(trace.samples), phases)


@contextmanager
def measure_energy(meter: str = "auto", platform: str | None = None, rate_hz: float = 10.0, engine=None):
    """``with measure_energy(engine=engine) as m: engine.generate(...)``; then ``m.report``, ``m.trace``, ``m.events``."""
    result = _Measurement(open_meter(meter, platform, rate_hz))
    if engine is not None:
        engine.events.subscribe(result.on_event)
    result.meter.start()
    try:
        yield result
    finally:
        result.trace = result.meter.stop()
        result.meter.close()
        if engine is not None:
            engine.events.unsubscribe(result.on_event)
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
