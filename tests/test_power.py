"""Power meters against fake sources shaped like the real ones; the parsing, units, wrap-around and
integration under test are the production code."""
import json
import sys

import pytest

from edgekv.platforms import energy
from edgekv.platforms.power import MeterUnavailable, PowerSample, PowerTrace, open_meter
from edgekv.platforms.power.base import integrate_power
from edgekv.platforms.power.ina3221 import Ina3221Meter
from edgekv.platforms.power.jtop import JtopMeter
from edgekv.platforms.power.nvml import NvmlMeter
from edgekv.platforms.power.rapl import RaplMeter
from edgekv.platforms.power.xrt import XrtMeter, parse_electrical


def _write(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(str(text))


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_SYSFS_ROOT", str(tmp_path))
    return tmp_path


def test_rapl_counts_package_energy_across_a_wrap(sysfs):
    zone = "class/powercap/intel-rapl:0"
    _write(sysfs, {f"{zone}/name": "package-0", f"{zone}/energy_uj": 999_000_000, f"{zone}/max_energy_range_uj": 999_999_999,
                   "class/powercap/intel-rapl:0:0/energy_uj": 5})  # a sub-zone: not counted twice
    meter = RaplMeter()
    assert meter.read()[1] == 0.0
    (sysfs / zone / "energy_uj").write_text("1000000")  # wrapped: 999,999,999 - 999,000,000 + 1 + 1,000,000 uJ
    power, joules, _ = meter.read()
    assert power is None and joules == pytest.approx((999_999_999 - 999_000_000 + 1 + 1_000_000) / 1e6)


def test_ina3221_rails_in_watts_and_total(sysfs):
    dev = "class/hwmon/hwmon3"
    _write(sysfs, {f"{dev}/name": "ina3221", f"{dev}/in1_label": "VDD_GPU_SOC", f"{dev}/in1_input": 5000,
                   f"{dev}/curr1_input": 1200, f"{dev}/in2_label": "VDD_CPU_CV", f"{dev}/in2_input": 5000,
                   f"{dev}/curr2_input": 400, f"{dev}/in3_label": "VIN_SYS_5V0", f"{dev}/in3_input": 5000,
                   f"{dev}/curr3_input": 800, "class/hwmon/hwmon0/name": "cpu_thermal"})
    power, joules, rails = Ina3221Meter().read()
    assert rails == {"VDD_GPU_SOC": 6.0, "VDD_CPU_CV": 2.0, "VIN_SYS_5V0": 4.0}  # mV x mA -> W
    assert power == pytest.approx(12.0) and joules is None


def test_missing_sources_say_what_is_missing(sysfs):
    with pytest.raises(MeterUnavailable, match="no RAPL zones"):
        RaplMeter()
    with pytest.raises(MeterUnavailable, match="no ina3221 hwmon rails"):
        Ina3221Meter()
    with pytest.raises(MeterUnavailable, match="no power meter available.*rapl: no RAPL zones"):
        open_meter("auto", "local")


class FakeJetson:
    power = {"rail": {"VDD_GPU_SOC": {"online": True, "type": "INA3221", "volt": 5000, "curr": 1200, "power": 6000,
                                      "avg": 5800},
                      "VDD_CPU_CV": {"online": True, "type": "INA3221", "volt": 5000, "curr": 400, "power": 2000, "avg": 1900}},
             "tot": {"volt": 0, "curr": 0, "power": 12500, "avg": 12000, "name": "ALL"}}


def test_jtop_reads_the_power_dict_in_milliwatts():
    power, joules, rails = JtopMeter(source=FakeJetson()).read()
    assert power == 12.5 and rails == {"VDD_GPU_SOC": 6.0, "VDD_CPU_CV": 2.0} and joules is None


class FakeNvml:
    """The real function names and units: energy in mJ, power in mW."""

    class NVMLError(Exception):
        pass

    def __init__(self, counter=True):
        self.counter, self.energy_mj, self.power_mw = counter, 1_000_000, 250_000

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        if i != 0:
            raise self.NVMLError("Invalid Argument")
        return "gpu0"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.counter:
            raise self.NVMLError("Not Supported")
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.power_mw


def test_nvml_energy_counter_in_millijoules_and_power_fallback():
    fake = FakeNvml()
    meter = NvmlMeter(nvml=fake)
    assert meter.read() == (250.0, 1000.0, {})
    old = FakeNvml(counter=False)
    assert NvmlMeter(nvml=old).read() == (250.0, None, {})
    with pytest.raises(MeterUnavailable, match="NVML has no GPU 3"):
        NvmlMeter(index=3, nvml=fake)


XRT_REPORT = {"schema_version": {"schema": "JSON", "creation_date": "x"},
              "devices": [{"interface_type": "pcie", "device_id": "0000:3b:00.1",
                           "electrical": {"power_rails": [
                               {"id": "12v_pex", "description": "12 Volts PCI Express",
                                "voltage": {"volts": "12.100", "is_present": "true"}, "current": {"amps": "1.000", "is_present": "true"}},
                               {"id": "vccint", "description": "Internal FPGA Vcc",
                                "voltage": {"volts": "0.850", "is_present": "true"}, "current": {"amps": "N/A"}}],
                               "power_consumption_max_watts": "25.0", "power_consumption_watts": "14.2"}}]}


def test_xrt_electrical_report():
    total, rails = parse_electrical(XRT_REPORT)
    assert total == 14.2 and rails == {"12v_pex": pytest.approx(12.1)}
    assert XrtMeter(examine=lambda: XRT_REPORT).read()[0] == 14.2
    with pytest.raises(MeterUnavailable, match="no electrical section"):
        parse_electrical({"devices": [{}]})


def test_energy_integration_is_exact_on_a_known_trace():
    # 10 W for 1 s, ramp 10 -> 30 W over 1 s, 30 W for 1 s: 10 + 20 + 30 = 60 J
    s = [PowerSample(int(t * 1e9), p) for t, p in [(0, 10), (1, 10), (2, 30), (3, 30)]]
    assert integrate_power(s, 0, int(3e9)) == pytest.approx(60.0)
    assert integrate_power(s, int(0.5e9), int(1.5e9)) == pytest.approx(5 + 7.5)  # 10 W x 0.5 s + mean 15 W x 0.5 s
    trace = PowerTrace("fake", s)
    events = [{"kind": "prefill_start", "t_ns": 0, "info": {"tokens": 100}},
              {"kind": "prefill_end", "t_ns": int(1e9), "info": {"tokens": 100}},
              {"kind": "decode_step_start", "t_ns": int(2e9), "info": {"step": 0, "active": 2}},
              {"kind": "decode_step_end", "t_ns": int(3e9), "info": {"step": 0, "active": 2}}]
    rep = energy.report(trace, events)
    assert rep.energy_j == pytest.approx(60.0) and rep.duration_s == 3 and rep.avg_power_w == pytest.approx(20.0)
    assert rep.peak_power_w == 30
    assert rep.phases["prefill"]["energy_j"] == pytest.approx(10.0) and rep.phases["prefill"]["j_per_token"] == pytest.approx(0.1)
    assert rep.phases["decode"]["energy_j"] == pytest.approx(30.0) and rep.phases["decode"]["j_per_token"] == pytest.approx(15.0)


def test_counter_trace_uses_the_counter():
    s = [PowerSample(int(t * 1e9), None, e) for t, e in [(0, 100.0), (1, 112.0), (2, 130.0)]]
    trace = PowerTrace("rapl", s)
    assert trace.energy_j() == pytest.approx(30.0) and trace.energy_j(int(0.5e9), int(1.5e9)) == pytest.approx(15.0)
    assert [p for _, p in trace.powers_w()] == [12.0, 18.0]


def test_energy_command_measures_a_child_and_aligns_its_events(sysfs, tmp_path, model_dirs):
    from edgekv.cli import main

    zone = "class/powercap/intel-rapl:0"
    _write(sysfs, {f"{zone}/name": "package-0", f"{zone}/energy_uj": 0, f"{zone}/max_energy_range_uj": 2**32})
    out = tmp_path / "e.json"
    child = [sys.executable, "-c", "from edgekv.runtime import Engine\n"
             f"e = Engine.from_pretrained({model_dirs['llama']!r}, config={{'G': 4, 'M': 4, 'C': 4, 'sigma': 4}}, policy='full')\n"
             "e.generate([[5, 6, 7, 8, 9]], max_new_tokens=3, stop_token_ids=[])"]
    rc = main(["energy", "--meter", "rapl", "--rate-hz", "50", "--json", str(out), "--csv", str(tmp_path / "t.csv"),
               "--png", str(tmp_path / "p.png"), "--", *child])
    data = json.loads(out.read_text())
    assert rc == 0 and data["meter"] == "rapl" and data["returncode"] == 0 and data["samples"] >= 2
    assert {"energy_j", "duration_s", "avg_power_w", "peak_power_w"} <= set(data)
    assert data["energy_j"] == 0.0  # the fake counter never moved: nothing is invented
    assert data["phases"]["prefill"]["tokens"] == 5 and data["phases"]["decode"]["tokens"] == 2
    assert (tmp_path / "t.csv").read_text().startswith("t_s,power_w,energy_j")
