"""Power meters: one interface (``start()``, ``sample()``, ``stop() -> PowerTrace``), one class per source."""
from .base import MeterFailed, MeterUnavailable, PowerMeter, PowerSample, PowerTrace
from .composite import CompositeMeter
from .select import METERS, open_meter

__all__ = ["PowerMeter", "PowerSample", "PowerTrace", "MeterUnavailable", "MeterFailed", "CompositeMeter", "METERS",
           "open_meter"]
