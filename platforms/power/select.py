"""Pick a meter by name, or the first that works for a platform; never an estimate.

A name is one meter (``rapl``), ``auto`` (the platform's order), ``none`` (no meter), or
meters joined by ``+`` (``nvml+rapl``): those read together as one combined meter.  A part
that is missing is left out and its reason kept in ``meter.notes``; only when every part is
missing is the name unavailable.
"""
from __future__ import annotations

from .base import MeterUnavailable, PowerMeter
from .composite import CompositeMeter
from .ina3221 import Ina3221Meter
from .jtop import JtopMeter
from .nvml import NvmlMeter
from .rapl import RaplMeter
from .xrt import XrtMeter

METERS = {"rapl": RaplMeter, "ina3221": Ina3221Meter, "jtop": JtopMeter, "nvml": NvmlMeter, "xrt": XrtMeter}
# orin: jtop, else the same INA3221 rails read from hwmon; rtx: the GPU board and the host side by side
PLATFORM_ORDER = {"orin": ["jtop", "ina3221"], "rtx": ["nvml+rapl"], "smartssd": ["xrt", "rapl"], "local": ["rapl"]}


def _open(name: str, rate_hz: float) -> PowerMeter:
    names = name.split("+")
    unknown = [n for n in names if n not in METERS]
    if unknown:
        raise ValueError(f"unknown meter {unknown[0]!r}; choose auto, none, one of {sorted(METERS)}, "
                         "or several joined by +")
    if len(names) == 1:
        return METERS[name](rate_hz=rate_hz)
    parts, missing = [], []
    for part in names:
        try:
            parts.append(METERS[part](rate_hz=rate_hz))
        except MeterUnavailable as exc:
            missing.append((part, exc))
    if not parts:
        raise MeterUnavailable("; ".join(f"{part}: {exc}" for part, exc in missing))
    meter = parts[0] if len(parts) == 1 else CompositeMeter(parts)
    meter.notes += [f"{part} left out, so its share is not counted ({exc})" for part, exc in missing]
    return meter


def open_meter(name: str = "auto", platform: str | None = None, rate_hz: float = 10.0) -> PowerMeter:
    """``name`` as in the module docstring; raises MeterUnavailable with each reason."""
    if name == "none":
        raise MeterUnavailable("the profile says power_meter: none, so no energy is reported")
    if name != "auto":
        return _open(name, rate_hz)
    order = PLATFORM_ORDER.get(platform or "", list(METERS))
    reasons = []
    for candidate in order:
        try:
            return _open(candidate, rate_hz)
        except MeterUnavailable as exc:
            reasons.append(f"{candidate}: {exc}")
    raise MeterUnavailable("no power meter available on this machine, so no energy is reported: " + "; ".join(reasons))
