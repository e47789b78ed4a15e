"""NVML through nvidia-ml-py (import name ``pynvml``): the GPU's energy counter in mJ (Volta and
newer), else its power draw in mW integrated over time.  The GPU board only: the host's CPU and
DRAM are RAPL's (the ``rtx`` order combines both, see select.py).

A GPU that falls off the bus makes every query raise ``NVMLError_GpuIsLost`` (NVML_ERROR_GPU_IS_LOST,
nvml.h; pynvml maps each return code to an ``NVMLError_<Name>`` subclass in ``_nvmlCheckReturn``):
the read raises and the base class ends the trace there.  ``nvmlShutdown`` may fail too
(NVML_ERROR_UNKNOWN): that is logged, never raised out of the measurement.
"""
from __future__ import annotations

import logging

from .base import MeterUnavailable, PowerMeter

log = logging.getLogger(__name__)


class NvmlMeter(PowerMeter):
    name = "nvml"

    def __init__(self, rate_hz: float = 10.0, index: int = 0, nvml=None):
        super().__init__(rate_hz)
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                raise MeterUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from exc
        self.nvml = nvml
        try:
            nvml.nvmlInit()
            self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            raise MeterUnavailable(f"NVML has no GPU {index} ({exc})") from exc
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self.has_counter = True
        except nvml.NVMLError:
            self.has_counter = False
        integrated = "" if self.has_counter else ", power integrated (no energy counter)"
        self.notes.append(f"nvml: GPU {index} board only{integrated}")

    def read(self):
        power_w = self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000  # mW
        energy_j = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000 if self.has_counter else None  # mJ
        return power_w, energy_j, {}

    def close(self):
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.warning("nvml: nvmlShutdown failed (%s: %s); the measurement is unaffected", type(exc).__name__, exc)
