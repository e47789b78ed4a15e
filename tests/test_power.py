"""Power meters against fake sources shaped like the real ones; the parsing, units, wrap-around and
integration under test are the production code."""
import json
import sys

import pytest

from edgekv.install.profile import load_profile
from edgekv.platforms import energy
from edgekv.platforms.devices import platform_for
from edgekv.platforms.power import MeterFailed, MeterUnavailable, PowerMeter, PowerSample, PowerTrace, open_meter
from edgekv.platforms.power.base import integrate_power
from edgekv.platforms.power.ina3221 import Ina3221Meter
from edgekv.platforms.power.jtop import JtopMeter
from edgekv.platforms.power.nvml import NvmlMeter
from edgekv.platforms.power.rapl import RaplMeter
from edgekv.platforms.power.xrt import MAX_RATE_HZ, XrtMeter, parse_electrical


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


# Zone layout: Linux Documentation/power/powercap/powercap.rst (class/powercap holds every zone, sub-zones
# intel-rapl:N:M inside package intel-rapl:N) and drivers/powercap/intel_rapl_common.c (names package-N, core,
# uncore, dram, psys; psys registered with no parent, so top-level; intel_rapl_mmio's "intel-rapl-mmio" control
# type re-exposes package-0).
def _rapl_tree(root, zones):
    for zone, (name, uj) in zones.items():
        _write(root, {f"class/powercap/{zone}/name": name, f"class/powercap/{zone}/energy_uj": uj,
                      f"class/powercap/{zone}/max_energy_range_uj": 262_143_328_850})


def _rapl_add(root, zone, joules):
    path = root / f"class/powercap/{zone}/energy_uj"
    path.write_text(str(int(path.read_text()) + int(joules * 1e6)))


RAPL_HOSTS = {
    # an Intel client: psys (the platform) already holds the package; intel-rapl-mmio re-exposes package-0
    "client with psys": ({"intel-rapl:0": ("package-0", 10), "intel-rapl:0:0": ("core", 6), "intel-rapl:0:1": ("uncore", 2),
                          "intel-rapl:1": ("psys", 25), "intel-rapl-mmio:0": ("package-0", 10)}, 25.0, ["psys"]),
    # a two-socket server: DRAM is outside the package domain
    "server": ({"intel-rapl:0": ("package-0", 30), "intel-rapl:0:0": ("dram", 5), "intel-rapl:1": ("package-1", 20),
                "intel-rapl:1:0": ("dram", 4)}, 59.0, ["package-0", "package-1", "package-0/dram", "package-1/dram"]),
    # a client without psys: dram added, core and uncore are inside the package
    "client without psys": ({"intel-rapl:0": ("package-0", 12), "intel-rapl:0:0": ("core", 8),
                             "intel-rapl:0:1": ("uncore", 1), "intel-rapl:0:2": ("dram", 3)}, 15.0,
                            ["package-0", "package-0/dram"]),
}


@pytest.mark.parametrize("host", RAPL_HOSTS)
def test_rapl_counts_each_joule_once(sysfs, host):
    zones, total_j, domains = RAPL_HOSTS[host]
    _rapl_tree(sysfs, {zone: (name, 0) for zone, (name, _) in zones.items()})
    meter = RaplMeter()
    for zone, (_, joules) in zones.items():
        _rapl_add(sysfs, zone, joules)
    assert meter.read()[1] == pytest.approx(total_j) and meter.domains == domains
    assert "psys" not in domains or any("psys" in n for n in meter.notes)


# hwmon files: Linux Documentation/hwmon/ina3221.rst (in[123]_label/_input mV, curr[123]_input mA, in[456] shunt
# uV, in7 and curr4 the sums).  Rail labels: NVIDIA Jetson Linux Developer Guide, "Jetson Orin Nano Series, Jetson
# Orin NX Series and Jetson AGX Orin Series", software power monitoring (NX/Nano: VDD_IN, VDD_CPU_GPU_CV, VDD_SOC;
# AGX Orin: VDD_GPU_SOC, VDD_CPU_CV, VIN_SYS_5V0 and NC, VDDQ_VDD2_1V8AO, NC), as jtop/core/power.py reads them.
def _ina3221(root, hwmon, rails):
    files = {f"class/hwmon/{hwmon}/name": "ina3221", f"class/hwmon/{hwmon}/in7_label": "sum of shunt voltages",
             f"class/hwmon/{hwmon}/in7_input": 2400, f"class/hwmon/{hwmon}/curr4_input": 0}
    for n, (label, mv, ma) in enumerate(rails, start=1):
        files |= {f"class/hwmon/{hwmon}/in{n}_label": label, f"class/hwmon/{hwmon}/in{n}_input": mv,
                  f"class/hwmon/{hwmon}/curr{n}_input": ma, f"class/hwmon/{hwmon}/in{n + 3}_input": 800,
                  f"class/hwmon/{hwmon}/in{n}_enable": 1}
    _write(root, files)


def test_ina3221_orin_nx_total_is_the_module_input(sysfs):
    _ina3221(sysfs, "hwmon1", [("VDD_IN", 5000, 1600), ("VDD_CPU_GPU_CV", 5000, 600), ("VDD_SOC", 5000, 400)])
    _write(sysfs, {"class/hwmon/hwmon0/name": "cpu_thermal"})
    meter = Ina3221Meter()
    power, joules, rails = meter.read()
    assert power == pytest.approx(8.0) and joules is None  # VDD_IN already holds the other rails
    assert rails == {"VDD_CPU_GPU_CV": 3.0, "VDD_SOC": 2.0} and meter.total_rail == "VDD_IN"


def test_ina3221_agx_orin_sums_both_chips_and_skips_nc(sysfs):
    _ina3221(sysfs, "hwmon2", [("VDD_GPU_SOC", 5000, 1200), ("VDD_CPU_CV", 5000, 400), ("VIN_SYS_5V0", 5000, 800)])
    _ina3221(sysfs, "hwmon3", [("NC", 40, 8), ("VDDQ_VDD2_1V8AO", 5000, 100), ("NC", 40, 8)])
    power, _, rails = Ina3221Meter().read()
    assert rails == {"VDD_GPU_SOC": 6.0, "VDD_CPU_CV": 2.0, "VIN_SYS_5V0": 4.0, "VDDQ_VDD2_1V8AO": 0.5}
    assert power == pytest.approx(12.5)  # no module-input rail: jtop's 'tot' is the sum of the rails


def test_missing_sources_say_what_is_missing(sysfs):
    with pytest.raises(MeterUnavailable, match="no RAPL zones"):
        RaplMeter()
    with pytest.raises(MeterUnavailable, match="no ina3221 hwmon rails"):
        Ina3221Meter()
    with pytest.raises(MeterUnavailable, match="no power meter available.*rapl: no RAPL zones"):
        open_meter("auto", "local")


# jetson.power as jetson-stats (4.x to 7.x) builds it, jtop/core/power.py: rails in mW with volt/curr/avg; 'tot'
# is the VDD_IN rail named 'VDD_IN' and taken out of 'rail' (Orin NX), or the plain sum {'power', 'avg'} (AGX Orin).
ORIN_NX_POWER = {"rail": {"VDD_CPU_GPU_CV": {"type": "INA3221", "online": True, "volt": 5000, "curr": 600,
                                             "power": 3000, "avg": 2900},
                          "VDD_SOC": {"type": "INA3221", "online": True, "volt": 5000, "curr": 400, "power": 2000,
                                      "avg": 1900}},
                 "tot": {"type": "INA3221", "online": True, "volt": 5000, "curr": 1600, "power": 8000, "avg": 7800,
                         "name": "VDD_IN"}}
AGX_ORIN_POWER = {"rail": {"VDD_GPU_SOC": {"type": "INA3221", "online": True, "volt": 5000, "curr": 1200, "power": 6000,
                                           "avg": 5800},
                           "VDD_CPU_CV": {"type": "INA3221", "online": True, "volt": 5000, "curr": 400, "power": 2000,
                                          "avg": 1900}},
                  "tot": {"power": 8000, "avg": 7700}}


class FakeJtopClient:
    """jtop/jtop.py: jtop(interval=1.0) in seconds; ``interval`` is the service's speed once started; ``power`` is
    self._stats['power'], and _stats is {} until the service's first update."""

    opened = []

    def __init__(self, interval=1.0):
        self.asked_s, self._stats = float(interval), {}
        FakeJtopClient.opened.append(self)

    def start(self):
        self.interval = self.asked_s

    def ok(self, spin=False):
        """jtop.ok(): True while the service feeds the client (raises its stored error otherwise)."""
        return True

    @property
    def power(self):
        return self._stats["power"]

    def close(self):
        pass


@pytest.mark.parametrize("layout, total_w, rails", [
    (ORIN_NX_POWER, 8.0, {"VDD_CPU_GPU_CV": 3.0, "VDD_SOC": 2.0}),
    (AGX_ORIN_POWER, 8.0, {"VDD_GPU_SOC": 6.0, "VDD_CPU_CV": 2.0}),
])
def test_jtop_reads_the_power_dict_in_milliwatts(layout, total_w, rails):
    source = FakeJtopClient()
    source._stats["power"] = layout
    assert JtopMeter(source=source).read() == (total_w, None, rails)


def test_jtop_opens_at_the_meter_rate_and_survives_an_empty_power_dict(monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", type(sys)("jtop"))
    sys.modules["jtop"].jtop = FakeJtopClient
    meter = JtopMeter(rate_hz=10.0)
    client = FakeJtopClient.opened[-1]
    assert client.asked_s == pytest.approx(0.1)  # jtop(interval=...) in seconds, the meter's period
    assert meter.read() == (None, None, {})  # before the service's first update: no 'power' key
    client._stats["power"] = {}  # a board whose service found no sensors
    assert meter.read() == (None, None, {})


def test_jtop_says_when_the_service_runs_slower_than_asked(monkeypatch):
    class BusyService(FakeJtopClient):
        def start(self):
            self.interval = 1.0  # another client started the service at jtop's default

    monkeypatch.setitem(sys.modules, "jtop", type(sys)("jtop"))
    sys.modules["jtop"].jtop = BusyService
    assert any("every 1 s" in note for note in JtopMeter(rate_hz=10.0).notes)


class FakeNvml:
    """The real function names and units (NVML API reference, nvml.h / nvidia-ml-py):
    nvmlDeviceGetTotalEnergyConsumption in mJ since the driver loaded (Volta and newer, else NVML_ERROR_NOT_SUPPORTED),
    nvmlDeviceGetPowerUsage in mW."""

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


# `xbutil/xrt-smi examine -r electrical -f JSON` as XRT writes it: tools/common/XBHelpMenus.cpp (schema_version,
# devices[] with interface_type, device_id as %04x:%02x:%02x.%01x, device_status, then the report) and
# common/sensor.cpp read_legacy_electrical (power_rails[] id/description, voltage.volts and current.amps as
# "%.3f" strings with is_present; power_consumption_watts from microwatts, "N/A" when unreadable).
def _electrical(bdf, watts, pex_amps="1.000"):
    return {"schema_version": {"schema": "JSON", "creation_date": "Mon Jan  6 10:00:00 2025 GMT"},
            "devices": [{"interface_type": "pcie", "device_id": bdf, "device_status": "HEALTHY", "electrical": {
                "power_rails": [
                    {"id": "12v_pex", "description": "12 Volts PCI Express",
                     "voltage": {"volts": "12.100", "is_present": "true"},
                     "current": {"amps": pex_amps, "is_present": "true"}},
                    {"id": "vccint", "description": "Internal FPGA Vcc",
                     "voltage": {"volts": "0.850", "is_present": "true"}, "current": {"amps": "N/A"}}],
                "power_consumption_max_watts": "75", "power_consumption_watts": watts,
                "power_consumption_warning": "false"}}]}


# `examine -r host`: ReportHost.cpp puts XBUtilities::get_available_devices under system.host.devices (bdf, vbnv, ...)
HOST_REPORT = {"schema_version": {"schema": "JSON", "creation_date": "Mon Jan  6 10:00:00 2025 GMT"},
               "system": {"host": {"os": {"sysname": "Linux"}, "xrt": {"version": "2.16.204"}, "devices": [
                   {"bdf": "0000:3b:00.1", "device_class": "Alveo", "vbnv": "xilinx_u2_gen3x4_xdma_gc_base_2",
                    "id": "0x0", "instance": "mgmt(inst=1)", "is_ready": "true"},
                   {"bdf": "0000:d8:00.1", "device_class": "Alveo", "vbnv": "xilinx_u2_gen3x4_xdma_gc_base_2",
                    "id": "0x0", "instance": "mgmt(inst=2)", "is_ready": "true"}]}}}


class FakeXrt:
    """Answers examine(report, device) as the tool does: one examined card per -d BDF."""

    def __init__(self, watts=None):
        self.watts = watts or {"0000:3b:00.1": "14.200000", "0000:d8:00.1": "21.500000"}
        self.calls = []

    def __call__(self, report, device):
        self.calls.append((report, device))
        if report == "host":
            return HOST_REPORT
        bdf = next(b for b in self.watts if b.startswith(device or ""))  # -d takes a BDF, function optional
        return _electrical(bdf, self.watts[bdf])


@pytest.fixture
def no_xrt_env(monkeypatch):
    monkeypatch.delenv("EDGEKV_XRT_DEVICE", raising=False)


def test_xrt_electrical_report(no_xrt_env):
    total, rails = parse_electrical(_electrical("0000:3b:00.1", "14.200000"))
    assert total == 14.2 and rails == {"12v_pex": pytest.approx(12.1)}
    assert XrtMeter(examine=FakeXrt()).read()[0] == 14.2
    with pytest.raises(MeterUnavailable, match="no electrical section .No sensors present"):
        parse_electrical({"devices": [{"device_id": "0000:3b:00.1", "electrical": {"msg": "No sensors present"}}]})


def test_xrt_na_power_is_no_reading_and_the_notes_say_so(no_xrt_env):
    xrt = FakeXrt()
    meter = XrtMeter(examine=xrt)
    xrt.watts["0000:3b:00.1"] = "N/A"
    power, joules, rails = meter.read()
    assert power is None and joules is None and rails == {"12v_pex": pytest.approx(12.1)}
    assert any("N/A" in note for note in meter.notes)
    with pytest.raises(MeterUnavailable, match="N/A"):  # a card that never reads is no meter
        XrtMeter(examine=xrt)


@pytest.mark.parametrize("device, bdf, watts", [(1, "0000:d8:00.1", 21.5), ("d8:00.1", "0000:d8:00.1", 21.5),
                                                ("0000:3B:00", "0000:3b:00", 14.2)])
def test_xrt_reads_the_card_asked_for_on_a_multi_card_host(no_xrt_env, device, bdf, watts):
    xrt = FakeXrt()
    meter = XrtMeter(device=device, examine=xrt)
    assert meter.device == bdf and meter.read()[0] == watts
    assert ("electrical", bdf) in xrt.calls  # passed to -d as a BDF, the form -d takes
    two_cards = {"devices": [_electrical(bdf, watts)["devices"][0] for bdf, watts in (("0000:3b:00.1", "1.0"),
                                                                                    ("0000:d8:00.1", "2.0"))]}
    assert parse_electrical(two_cards, "0000:d8:00.1")[0] == 2.0
    with pytest.raises(MeterUnavailable, match="2 cards.*EDGEKV_XRT_DEVICE"):
        parse_electrical(two_cards)
    with pytest.raises(MeterUnavailable, match="no index 5"):
        XrtMeter(device=5, examine=xrt)


def test_xrt_rate_is_capped_whatever_is_asked(no_xrt_env):
    meter = XrtMeter(rate_hz=10.0, examine=FakeXrt())
    assert meter.rate_hz == MAX_RATE_HZ == 1.0 and meter.period_s == 1.0
    assert any("1 Hz" in note and "10 Hz" in note for note in meter.notes)


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


class FlakyMeter(PowerMeter):
    """Reads 10 W, and raises on its third read (the second in the sampling thread)."""

    name = "flaky"

    def __init__(self):
        super().__init__(rate_hz=1000.0)
        self.calls = 0

    def read(self):
        self.calls += 1
        if self.calls == 3:
            raise OSError("hwmon read failed")
        return 10.0, None, {}


def test_a_read_failing_in_the_sampling_thread_surfaces_on_stop(tmp_path):
    meter = FlakyMeter()
    meter.start()
    meter._thread.join()  # the failed read ends the thread
    trace = meter.stop()
    assert trace.error and "OSError: hwmon read failed" in trace.error and "after 2 samples" in trace.error
    assert meter.calls == 3  # no read after the failure bridges the gap
    with pytest.raises(MeterFailed, match="hwmon read failed"):
        trace.energy_j()
    rep = energy.report(trace, root=tmp_path)
    assert rep.energy_j is None and rep.avg_power_w is None and "hwmon read failed" in rep.to_json()["error"]


def _gpu_and_host(sysfs, monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)  # what `import pynvml` returns
    _rapl_tree(sysfs, {"intel-rapl:0": ("package-0", 0)})
    return fake


def test_rtx_reads_gpu_and_host_side_by_side_and_sums_them(sysfs, monkeypatch, tmp_path):
    nvml = _gpu_and_host(sysfs, monkeypatch)
    meter = platform_for(load_profile("rtx")).meter(rate_hz=0.001)  # one sample at start, one at stop
    assert meter.name == "nvml+rapl"
    meter.start()
    nvml.energy_mj += 50_000  # 50 J on the GPU board
    _rapl_add(sysfs, "intel-rapl:0", 20)  # 20 J in the CPU package
    trace = meter.stop()
    meter.close()
    assert trace.parts["nvml"].energy_j() == pytest.approx(50.0)  # the GPU board
    assert trace.parts["rapl"].energy_j() == pytest.approx(20.0)  # the host
    assert trace.energy_j() == pytest.approx(70.0)
    rep = energy.report(trace, root=tmp_path).to_json()
    assert {"meter", "energy_j", "duration_s", "avg_power_w", "peak_power_w", "samples", "phases"} <= set(rep)
    assert rep["energy_j"] == pytest.approx(70.0) and rep["meter"] == "nvml+rapl"
    assert {name: p["energy_j"] for name, p in rep["parts"].items()} == pytest.approx({"nvml": 50.0, "rapl": 20.0})
    energy.write_csv(tmp_path / "t.csv", trace)
    header = (tmp_path / "t.csv").read_text().splitlines()[0].split(",")
    assert {"nvml", "rapl"} <= set(header)  # the parts' power side by side


def test_rtx_without_rapl_uses_nvml_alone_and_says_why(sysfs, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    meter = open_meter("auto", "rtx")
    assert meter.name == "nvml"
    assert any(note.startswith("rapl left out") and "no RAPL zones" in note for note in meter.notes)


def test_orin_profile_falls_back_to_the_ina3221_reader(sysfs, monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", None)  # jetson-stats absent: `from jtop import jtop` raises ImportError
    _ina3221(sysfs, "hwmon1", [("VDD_IN", 5000, 1600), ("VDD_CPU_GPU_CV", 5000, 600), ("VDD_SOC", 5000, 400)])
    meter = platform_for(load_profile("orin")).meter()
    assert isinstance(meter, Ina3221Meter) and meter.read()[0] == pytest.approx(8.0)
    with pytest.raises(MeterUnavailable, match="power_meter: none"):
        open_meter("none")


def test_energy_command_measures_a_child_and_aligns_its_events(sysfs, tmp_path, model_dirs):
    from edgekv.cli import main

    zone = "class/powercap/intel-rapl:0"
    _write(sysfs, {f"{zone}/name": "package-0", f"{zone}/energy_uj": 0, f"{zone}/max_energy_range_uj": 2**32})
    out = tmp_path / "e.json"
    child = [sys.executable, "-c", "from edgekv.runtime import Engine\n"
             f"e = Engine.from_pretrained({model_dirs['llama']!r}, config={{'G': 4, 'M': 4, 'C': 4, 'sigma': 4}}, policy='full',\n"
             "                              device='cpu')\n"
             "e.generate([[5, 6, 7, 8, 9]], max_new_tokens=3, stop_token_ids=[])"]
    rc = main(["energy", "--meter", "rapl", "--rate-hz", "50", "--json", str(out), "--csv", str(tmp_path / "t.csv"),
               "--png", str(tmp_path / "p.png"), "--", *child])
    data = json.loads(out.read_text())
    assert rc == 0 and data["meter"] == "rapl" and data["returncode"] == 0 and data["samples"] >= 2
    assert {"energy_j", "duration_s", "avg_power_w", "peak_power_w"} <= set(data)
    assert data["energy_j"] == 0.0  # the fake counter never moved: nothing is invented
    assert data["phases"]["prefill"]["tokens"] == 5 and data["phases"]["decode"]["tokens"] == 2
    assert (tmp_path / "t.csv").read_text().startswith("t_s,power_w,energy_j")


def test_energy_command_fails_when_the_meter_failed_part_way(tmp_path, monkeypatch, capsys):
    from edgekv.cli import main
    from edgekv.platforms import power

    monkeypatch.setattr(power, "open_meter", lambda *a: FlakyMeter())
    out = tmp_path / "e.json"
    rc = main(["energy", "--json", str(out), "--", sys.executable, "-c", "import time; time.sleep(0.2)"])
    data = json.loads(out.read_text())
    assert rc != 0 and data["returncode"] == 0 and "hwmon read failed" in data["error"] and data["energy_j"] is None
    assert "hwmon read failed" in capsys.readouterr().err
