"""Power meters: one interface (``start()``, ``sample()``, ``stop() -> PowerTrace``), one class per source."""
from .base import MeterUnavailable, PowerMeter, PowerSample, PowerTrace
from .select import METERS, open_meter

__all__ = ["PowerMeter", "PowerSample", "PowerTrace", "MeterUnavailable", "METERS", "open_meter"]
