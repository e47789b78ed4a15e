"""Pick a meter by name, or the first that works for a platform; never an estimate."""
from __future__ import annotations

from .base import MeterUnavailable, PowerMeter
from .ina3221 import Ina3221Meter
from .jtop import JtopMeter
from .nvml import NvmlMeter
from .rapl import RaplMeter
from .xrt import XrtMeter

METERS = {"rapl": RaplMeter, "ina3221": Ina3221Meter, "jtop": JtopMeter, "nvml": NvmlMeter, "xrt": XrtMeter}
PLATFORM_ORDER = {"orin": ["jtop", "ina3221"], "rtx": ["nvml", "rapl"], "smartssd": ["xrt", "rapl"], "local": ["rapl"]}


def open_meter(name: str = "auto", platform: str | None = None, rate_hz: float = 10.0) -> PowerMeter:
    """``name`` a meter or 'auto' (the platform's order, else every meter); raises MeterUnavailable with each reason."""
    if name != "auto":
        if name not in METERS:
            raise ValueError(f"unknown meter {name!r}; choose auto or one of {sorted(METERS)}")
        return METERS[name](rate_hz=rate_hz)
    order = PLATFORM_ORDER.get(platform or "", list(METERS))
    reasons = []
    for candidate in order:
        try:
            return METERS[candidate](rate_hz=rate_hz)
        except MeterUnavailable as exc:
            reasons.append(f"{candidate}: {exc}")
    raise MeterUnavailable("no power meter available on this machine, so no energy is reported: " + "; ".join(reasons))
