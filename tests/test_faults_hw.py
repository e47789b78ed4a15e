"""Fault injection, hardware side: a power meter lost mid-measurement, and an in-storage scorer
(the csim, or the card through pyxrt) that fails mid-request.

The fakes fail the way the real sources do:
- pynvml (nvidia-ml-py 12.560.30, pynvml.py): every call returns through ``_nvmlCheckReturn``, which raises
  ``NVMLError(ret)``; ``NVMLError.__new__`` hands back the subclass ``_extractNVMLErrorsAsClasses`` made for that code:
  NVML_ERROR_GPU_IS_LOST (15) is ``NVMLError_GpuIsLost``, str "GPU is lost" (nvml.h: "the GPU has fallen off the bus or
  has otherwise become inaccessible"); NVML_ERROR_UNKNOWN (999) is ``NVMLError_Unknown``, "Unknown Error".
- jetson-stats (rbonghi/jetson_stats f41d5cad, jtop/jtop.py): the client's reader thread (``run``) stores any exception
  in ``_error`` (``JtopException("Lost connection with jtop server")`` from ``_get_data`` on EOFError) and stops
  updating ``_stats``, so ``power`` keeps returning the last values; ``ok()`` raises the stored error, or returns
  ``_running`` (False once the client stopped).
- sysfs: a powercap zone or hwmon device that goes away takes its files along (FileNotFoundError); a driver whose read
  fails returns its errno (ENODEV); a file can hold text that is no number.
- xrt-smi: ``run_examine`` runs the tool; a non-zero exit is MeterUnavailable with its stderr, a truncated JSON report
  a JSONDecodeError.  A stand-in tool on PATH does both.
- pyxrt: tests/fake_pyxrt.py (its docstring cites XRT for each fault); the csim: its C function's return codes.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import signal
import string
import subprocess
import sys
import types

import numpy as np
import pytest

import tests.fake_pyxrt as fake_pyxrt
from edgekv.platforms import energy
from edgekv.platforms.power import MeterFailed, MeterUnavailable, open_meter
from edgekv.platforms.power.ina3221 import Ina3221Meter
from edgekv.platforms.power.jtop import JtopMeter
from edgekv.platforms.power.nvml import NvmlMeter
from edgekv.platforms.power.rapl import RaplMeter
from edgekv.platforms.power.xrt import XrtMeter
from edgekv.platforms.smartssd import CsimScorer, XrtScorer
from edgekv.runtime import Engine
from edgekv.runtime.events import EventBus
from edgekv.runtime.hillinfer import ScoringError
from edgekv.runtime.scoring import KeyPool, NumpyScorer, ScoreBlockError, check_result, write_pool
from tests.conftest import files_under
from tests.test_exactness import EXACT, PROMPTS

# ---- fakes of the meters' sources ---------------------------------------------------------------------------------


def fake_pynvml(gpu: "FakeGpu") -> types.ModuleType:
    """A ``pynvml`` module built as nvidia-ml-py builds its errors (see the module docstring)."""
    m = types.ModuleType("pynvml")
    codes = {"UNINITIALIZED": 1, "NOT_SUPPORTED": 3, "GPU_IS_LOST": 15, "UNKNOWN": 999}
    text = {1: "Uninitialized", 3: "Not Supported", 15: "GPU is lost", 999: "Unknown Error"}

    class NVMLError(Exception):
        _valClassMapping: dict = {}

        def __new__(typ, value):
            if typ == NVMLError:
                typ = NVMLError._valClassMapping.get(value, typ)
            obj = Exception.__new__(typ)
            obj.value = value
            return obj

        def __str__(self):
            return text.get(self.value, f"NVML Error with code {self.value}")

    m.NVMLError = NVMLError
    for name, value in codes.items():
        setattr(m, f"NVML_ERROR_{name}", value)
        cls_name = "NVMLError_" + string.capwords(name, "_").replace("_", "")
        cls = type(cls_name, (NVMLError,), {"__new__": (lambda v: lambda typ: NVMLError.__new__(typ, v))(value)})
        setattr(m, cls_name, cls)
        NVMLError._valClassMapping[value] = cls

    def check(ret=0):
        if ret:
            raise NVMLError(ret)

    m.nvmlInit = lambda: check()
    m.nvmlShutdown = lambda: check(gpu.shutdown_error)
    m.nvmlDeviceGetHandleByIndex = lambda i: check(0 if i == 0 else 2) or "gpu0"

    def power(handle):
        gpu.reads += 1
        if gpu.lose_after is not None and gpu.reads > gpu.lose_after:
            gpu.lost = codes["GPU_IS_LOST"]
        check(gpu.lost)
        return gpu.power_mw

    def energy_mj(handle):
        check(gpu.lost)
        gpu.energy_mj += gpu.step_mj  # the board draws between reads
        return gpu.energy_mj

    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTotalEnergyConsumption = energy_mj
    return m


class FakeGpu:
    """The board behind the fake NVML: mW, a mJ counter that advances ``step_mj`` per read, and a return code that
    every query gets once the GPU is lost (``lost``, or after ``lose_after`` power reads)."""

    def __init__(self, lose_after=None):
        self.power_mw, self.energy_mj, self.step_mj = 250_000, 1_000_000, 500
        self.lost = 0
        self.lose_after, self.reads = lose_after, 0
        self.shutdown_error = 0


class JtopException(Exception):
    """jtop/core/exceptions.py: JtopException(message, errors=""), str() is the message."""

    def __init__(self, message, errors=""):
        super().__init__(message, errors)
        self.message = message

    def __str__(self):
        return str(self.message)


class FakeJtopClient:
    """jtop/jtop.py's client as the meter uses it: ``power`` is ``_stats['power']``; the service's updates land in
    ``_stats``; ``ok()`` raises ``_error[1]`` once the reader thread stored one, else returns ``_running``."""

    def __init__(self):
        self._stats = {"power": {"rail": {}, "tot": {"power": 8000, "avg": 7900}}}
        self._error = None
        self._running = True

    @property
    def power(self):
        return self._stats["power"]

    def ok(self, spin=False):
        if self._error:
            raise self._error[1]
        return self._running

    def service_stops(self):
        """The socket to the service closes: the reader thread's _get_data raises, run() stores it; _stats stays."""
        exc = JtopException("Lost connection with jtop server")
        self._error = (JtopException, exc, None)

    def close(self):
        self._running = False


def _write(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(str(text))


RAPL = "class/powercap/intel-rapl:0"
INA = "class/hwmon/hwmon1"


def _rapl(root):
    _write(root, {f"{RAPL}/name": "package-0", f"{RAPL}/energy_uj": 1_000_000, f"{RAPL}/max_energy_range_uj": 2**32})


def _rapl_step(root):
    """The package draws 1 J between two reads."""
    path = root / RAPL / "energy_uj"
    if path.is_file() and path.read_text().strip().isdigit():
        path.write_text(str(int(path.read_text()) + 1_000_000))


def _ina(root):
    _write(root, {f"{INA}/name": "ina3221", f"{INA}/in1_label": "VDD_IN", f"{INA}/in1_input": 5000,
                  f"{INA}/curr1_input": 1600, f"{INA}/in2_label": "VDD_SOC", f"{INA}/in2_input": 5000,
                  f"{INA}/curr2_input": 400})


XRT_TOOL = """#!/bin/sh
# xrt-smi examine -r REPORT -f JSON -o OUT [-d BDF], answering from $EDGEKV_FAKE_XRT
state=$(cat "$EDGEKV_FAKE_XRT/state")
if [ "$state" = gone ]; then echo "ERROR: 0000:3b:00.1: No such device" >&2; exit 1; fi
if [ "$state" = garbled ]; then head -c 40 "$EDGEKV_FAKE_XRT/$3.json" > "$7"; exit 0; fi
cp "$EDGEKV_FAKE_XRT/$3.json" "$7"
"""


def _xrt_tool(tmp_path, monkeypatch):
    from tests.test_power import _electrical

    state = tmp_path / "xrt"
    (state / "bin").mkdir(parents=True)
    (state / "electrical.json").write_text(json.dumps(_electrical("0000:3b:00.1", "14.200000")))
    (state / "state").write_text("ok")
    tool = state / "bin" / "xrt-smi"
    tool.write_text(XRT_TOOL)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{state / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("EDGEKV_FAKE_XRT", str(state))
    monkeypatch.delenv("EDGEKV_XRT_DEVICE", raising=False)
    return state


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_SYSFS_ROOT", str(tmp_path))
    return tmp_path


def _case_nvml(code):
    def make(root, monkeypatch):
        gpu = FakeGpu()
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpu))
        return NvmlMeter(rate_hz=1000), lambda: setattr(gpu, "lost", code), lambda: setattr(gpu, "lost", 0), None
    return make


def _case_jtop(how):
    def make(root, monkeypatch):
        client = FakeJtopClient()
        lose = client.service_stops if how == "service" else client.close

        def heal():
            client._error, client._running = None, True
        return JtopMeter(rate_hz=1000, source=client), lose, heal, None
    return make


def _case_rapl(how):
    def make(root, monkeypatch):
        _rapl(root)
        if how == "gone":
            lose = lambda: shutil.rmtree(root / RAPL)  # noqa: E731
        else:
            lose = lambda: (root / RAPL / "energy_uj").write_text("")  # noqa: E731
        return RaplMeter(rate_hz=1000), lose, lambda: _rapl(root), lambda: _rapl_step(root)
    return make


def _case_ina(how):
    def make(root, monkeypatch):
        from edgekv.platforms.power import ina3221

        _ina(root)
        broken = {"on": False}
        real = ina3221.read_int

        def read_int(path):
            if broken["on"]:
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), str(path))
            return real(path)

        monkeypatch.setattr(ina3221, "read_int", read_int)
        if how == "gone":
            lose = lambda: shutil.rmtree(root / INA)  # noqa: E731
        elif how == "enodev":
            lose = lambda: broken.update(on=True)  # noqa: E731
        else:
            lose = lambda: (root / INA / "curr1_input").write_text("garbage")  # noqa: E731

        def heal():
            broken["on"] = False
            _ina(root)
        return Ina3221Meter(rate_hz=1000), lose, heal, None
    return make


def _case_xrt(how):
    def make(root, monkeypatch):
        state = _xrt_tool(root, monkeypatch)
        meter = XrtMeter()
        meter.period_s = 0.001  # the 1 Hz cap is for the real tool's load; the stand-in is cheap
        return meter, lambda: (state / "state").write_text(how), lambda: (state / "state").write_text("ok"), None
    return make


# (case, the meter's source and how it breaks, what the loss is reported as)
METER_FAULTS = {
    "nvml: GPU fell off the bus": (_case_nvml(15), "NVMLError_GpuIsLost: GPU is lost"),
    "nvml: unknown error": (_case_nvml(999), "NVMLError_Unknown: Unknown Error"),
    "jtop: service stopped": (_case_jtop("service"), "JtopException: Lost connection with jtop server"),
    "jtop: client stopped": (_case_jtop("client"), "jetson.ok() is False"),
    "rapl: zone gone": (_case_rapl("gone"), "FileNotFoundError"),
    "rapl: garbage": (_case_rapl("garbage"), "ValueError: invalid literal for int()"),
    "ina3221: device gone": (_case_ina("gone"), "FileNotFoundError"),
    "ina3221: ENODEV": (_case_ina("enodev"), "OSError: [Errno 19] No such device"),
    "ina3221: garbage": (_case_ina("garbage"), "ValueError: invalid literal for int()"),
    "xrt: card gone": (_case_xrt("gone"), "No such device"),
    "xrt: garbled report": (_case_xrt("garbled"), "JSONDecodeError"),
}
LOSE_ON_READ = 4  # the read that meets the broken source: 3 good readings before it


def _lose(meter, lose, step=None, on_read=LOSE_ON_READ, target=None):
    """Start ``meter``; its ``on_read``-th read (of ``target``, a part of a combined meter) meets the source broken by
    ``lose()``; returns the trace once the sampling thread ended there."""
    target = target or meter
    real, reads = target.read, []

    def read():
        reads.append(1)
        if step:
            step()
        if len(reads) == on_read:
            lose()
        return real()

    target.read = read
    meter.start()
    meter._thread.join(timeout=30)
    assert not meter._thread.is_alive(), "the meter kept reading a source that is gone"
    trace = meter.stop()
    del target.read
    return trace


@pytest.mark.parametrize("case", METER_FAULTS)
def test_a_meter_lost_mid_measurement_reports_its_covered_window(sysfs, monkeypatch, caplog, case):
    make, cause = METER_FAULTS[case]
    meter, lose, heal, step = make(sysfs, monkeypatch)
    with caplog.at_level(logging.WARNING):
        trace = _lose(meter, lose, step)
    assert len(trace.samples) == LOSE_ON_READ - 1 and cause in trace.lost_cause
    assert trace.lost_at_ns >= trace.samples[-1].t_ns
    assert any(cause in r.getMessage() and "was lost" in r.getMessage() for r in caplog.records), "no warning"
    with pytest.raises(MeterFailed, match="was lost"):
        trace.energy_j()  # the whole measurement has no energy ...
    covered = trace.energy_j(None, trace.samples[-1].t_ns)  # ... its readings' window has
    rep = energy.report(trace, root=sysfs).to_json()
    lost = rep["meter_lost"]
    assert rep["energy_j"] is None and cause in rep["error"]
    assert cause in lost["error"] and lost["samples"] == LOSE_ON_READ - 1
    assert lost["at_s"] >= lost["covered_s"] == pytest.approx(trace.duration_s)
    assert lost["energy_j"] == pytest.approx(covered)
    if step:  # a counter: exactly what it counted between the first and the last good reading, 1 J per read
        assert covered == pytest.approx(LOSE_ON_READ - 2)
    heal()
    meter.start()  # the next measurement starts on the same meter
    again = meter.stop()
    meter.close()
    assert again.error is None and again.lost_at_ns is None and again.energy_j() >= 0


def test_a_combined_meter_names_the_part_it_lost_and_keeps_each_parts_window(sysfs, monkeypatch):
    gpu = FakeGpu()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpu))
    _rapl(sysfs)
    meter = open_meter("nvml+rapl", rate_hz=1000)
    nvml = meter.parts[0]
    trace = _lose(meter, lambda: setattr(gpu, "lost", 15), lambda: _rapl_step(sysfs), target=nvml)
    rep = energy.report(trace, root=sysfs).to_json()
    assert rep["meter_lost"]["error"] == "nvml: NVMLError_GpuIsLost: GPU is lost"
    parts = rep["meter_lost"]["parts"]
    assert parts["nvml"]["energy_j"] == pytest.approx(0.5 * (LOSE_ON_READ - 2))  # 500 mJ per read
    assert parts["rapl"]["energy_j"] == pytest.approx(LOSE_ON_READ - 2)
    assert rep["meter_lost"]["energy_j"] == pytest.approx(parts["nvml"]["energy_j"] + parts["rapl"]["energy_j"])


def test_a_lost_meters_report_gives_only_the_phases_inside_its_window(tmp_path):
    from edgekv.platforms.power import PowerSample, PowerTrace

    # 10 W read at 0, 1 and 2 s; the read at 2.5 s failed
    trace = PowerTrace("fake", [PowerSample(int(t * 1e9), 10.0) for t in (0, 1, 2)], error="the fake meter was lost",
                       lost_at_ns=int(2.5e9), lost_cause="OSError: gone")
    events = [{"kind": "prefill_start", "t_ns": 0, "info": {"tokens": 10}},
              {"kind": "prefill_end", "t_ns": int(1e9), "info": {"tokens": 10}},
              {"kind": "decode_step_start", "t_ns": int(1.5e9), "info": {"active": 1}},
              {"kind": "decode_step_end", "t_ns": int(2e9), "info": {"active": 1}},
              {"kind": "decode_step_start", "t_ns": int(2e9), "info": {"active": 1}},
              {"kind": "decode_step_end", "t_ns": int(3e9), "info": {"active": 1}}]  # past the last reading
    lost = energy.report(trace, events, root=tmp_path).meter_lost
    assert lost["at_s"] == 2.5 and lost["covered_s"] == 2 and lost["energy_j"] == pytest.approx(20.0)
    assert lost["phases"]["prefill"]["energy_j"] == pytest.approx(10.0)
    assert lost["phases"]["decode"] == {"energy_j": pytest.approx(5.0), "seconds": 0.5, "tokens": 1,
                                        "j_per_token": pytest.approx(5.0)}
    assert lost["phases_left_out"] == {"prefill": 0, "decode": 1}
    with pytest.raises(MeterFailed):
        trace.energy_j(0, int(3e9))  # never bridged past the last reading


CONFIG = {**EXACT, "importance_rate": 0.5, "beta": 0.1, "score_block_tokens": 16}  # a 24-token CPU pool
FAULT_PROMPTS = PROMPTS[:2]  # 57 and 91 tokens: most keys live in the storage pool only
NEW_TOKENS = 6


def _generate(engine):
    return [r.token_ids for r in engine.generate(FAULT_PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])]


@pytest.fixture(scope="module")
def reference(model_dirs, tmp_path_factory):
    """The tokens of a clean HillInfer run scored by the numpy reference."""
    kv = tmp_path_factory.mktemp("kv-reference")
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv, config=CONFIG, policy="hillinfer",
                                scorer=NumpyScorer(), device="cpu") as engine:
        return _generate(engine)


def test_the_engine_is_never_stopped_by_a_lost_meter_and_the_next_measurement_works(model_dirs, kv_path, monkeypatch,
                                                                                   caplog, reference):
    gpu = FakeGpu(lose_after=3)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpu))
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CONFIG, policy="hillinfer",
                                scorer=NumpyScorer(), device="cpu") as engine:
        with caplog.at_level(logging.WARNING), energy.measure_energy("nvml", rate_hz=1000, engine=engine) as m:
            tokens = _generate(engine)
            m.meter._thread.join(timeout=30)  # the GPU is lost on the 4th read, during or after the request
        assert tokens == reference
        lost = m.report.meter_lost
        assert m.report.energy_j is None and lost["error"] == "NVMLError_GpuIsLost: GPU is lost"
        spans = energy.phase_windows(m.events)
        assert all(0 <= lost["phases_left_out"][name] <= len(spans[name]) for name in ("prefill", "decode"))
        assert "was lost" in caplog.text and engine.events._listeners == []
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(FakeGpu()))  # the GPU is back
        with energy.measure_energy("nvml", rate_hz=1000, engine=engine) as m:
            assert _generate(engine) == reference
        assert m.report.meter_lost is None and m.report.energy_j > 0 and m.report.phases["decode"]["tokens"] > 0


def test_a_meter_that_cannot_read_at_all_is_refused_before_the_work_starts(monkeypatch):
    gpu = FakeGpu()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpu))
    gpu.lost = 15
    engine = types.SimpleNamespace(events=EventBus())
    ran = []
    with pytest.raises(MeterUnavailable, match="nvml meter failed its first reading .NVMLError_GpuIsLost: GPU is lost"):
        with energy.measure_energy("nvml", engine=engine):
            ran.append(1)
    assert ran == [] and engine.events._listeners == []


def test_a_failing_nvml_shutdown_does_not_replace_the_report(monkeypatch, caplog):
    gpu = FakeGpu(lose_after=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpu))
    gpu.shutdown_error = 999  # nvml.h lists NVML_ERROR_UNKNOWN among nvmlShutdown's returns
    with caplog.at_level(logging.WARNING), energy.measure_energy("nvml", rate_hz=1000) as m:
        m.meter._thread.join(timeout=30)
    assert m.report.meter_lost["error"] == "NVMLError_GpuIsLost: GPU is lost"
    assert "nvmlShutdown failed (NVMLError_Unknown: Unknown Error)" in caplog.text


def test_energy_command_reports_the_lost_meter_and_the_commands_own_status(tmp_path, monkeypatch, sysfs):
    from edgekv.cli import main

    _rapl(sysfs)
    zone = sysfs / RAPL
    child = [sys.executable, "-c", f"import shutil, time; time.sleep(0.05); shutil.rmtree({str(zone)!r}); "
                                   "time.sleep(0.3); print('child done')"]
    out = tmp_path / "e.json"
    rc = main(["energy", "--meter", "rapl", "--rate-hz", "200", "--json", str(out), "--", *child])
    data = json.loads(out.read_text())
    assert data["returncode"] == 0 and rc != 0  # the command ran to its end; the measurement is incomplete
    assert data["energy_j"] is None and data["meter_lost"]["error"].startswith("FileNotFoundError")
    assert data["meter_lost"]["at_s"] >= data["meter_lost"]["covered_s"]


def test_energy_command_whose_meter_fails_its_first_reading_says_so_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from edgekv.cli import main

    gpu = FakeGpu()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpu))
    gpu.lost = 15
    marker = tmp_path / "ran"
    rc = main(["energy", "--meter", "nvml", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert rc == 2 and not marker.exists()
    assert "edgekv energy: the nvml meter failed its first reading" in capsys.readouterr().err


# ---- the in-storage scorer fails ---------------------------------------------------------------------------------


class FaultyCsim:
    """Stands in for CsimScorer._lib: calls the real csim until ``fault`` is set, then, from call ``faulty_from`` on,
    answers as a failing C function would: an error return, a kernel that stopped half-way or never wrote (rc 0),
    bytes scribbled over the score blocks or the top-k, the pool file gone (the csim's open fails, -ENOENT)."""

    def __init__(self, real):
        self.real, self.calls, self.fault, self.faulty_from = real, 0, None, 0

    def ekv_csim_score_file(self, path, offset, n, heads, dim, positions, query, scale, block, k, scores, topk, read):
        fault = self.fault if self.calls >= self.faulty_from else None
        self.calls += 1

        def real(n_tokens=n):
            return self.real.ekv_csim_score_file(path, offset, n_tokens, heads, dim, positions, query, scale, block, k,
                                                 scores, topk, read)
        if fault == "error return":
            return -errno.ENOMEM  # ekv_csim.cpp: aligned_alloc failed
        if fault == "writes nothing":
            return 0
        if fault == "short block":
            return real(n // 2)
        if fault == "pool gone":
            os.unlink(path.decode())
            return real()
        rc = real()
        if fault == "garbled scores":
            ctypes.memset(scores, 0x7F, n * 8 // 3)
        if fault == "garbled top-k" and topk:
            entries = np.ctypeslib.as_array((ctypes.c_int32 * (2 * k)).from_address(topk))
            entries[0] = entries[2 * k - 2] if k > 1 else -1  # the first entry takes the last one's position
        return rc


def _csim(monkeypatch):
    scorer = CsimScorer()
    faulty = FaultyCsim(scorer._lib)
    monkeypatch.setattr(scorer, "_lib", faulty)
    return scorer, faulty


def _xrt(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyxrt", fake_pyxrt)
    xclbin = tmp_path / "ekv_score.xclbin"
    xclbin.write_bytes(b"xclbin")
    scorer = XrtScorer(xclbin)
    return scorer, scorer.device


def _xrt_fault(dev, fault):
    if fault == "wait throws":
        dev.wait_error = RuntimeError("xrt::run::wait: Input/output error")
    elif fault == "sync fails":
        dev.sync_error = RuntimeError("unable to sync BO: Input/output error")
    elif fault == "error state":
        dev.fail_state = fake_pyxrt.ert_cmd_state.ERT_CMD_STATE_ERROR
    elif fault == "completes unwritten":
        dev.written = 0
    else:
        dev.wait_error = dev.sync_error = dev.fail_state = dev.written = None


SCORER_FAULTS = [("csim", f) for f in ("error return", "short block", "garbled scores", "garbled top-k")] + \
                [("xrt", f) for f in ("wait throws", "sync fails", "error state", "completes unwritten")]
WARNED = {"error return": "OSError", "short block": "ScoreBlockError", "garbled scores": "ScoreBlockError",
          "garbled top-k": "ScoreBlockError", "wait throws": "RuntimeError: xrt::run::wait",
          "sync fails": "RuntimeError: unable to sync BO", "error state": "ERT_CMD_STATE_ERROR",
          "completes unwritten": "ScoreBlockError"}
FAULTY_FROM = 5  # the first calls of the request succeed: the fault hits mid-request


@pytest.mark.parametrize("backend, fault", SCORER_FAULTS, ids=[f"{b}-{f}" for b, f in SCORER_FAULTS])
def test_a_failing_scorer_falls_back_to_the_cpu_and_the_next_request_uses_it_again(model_dirs, kv_path, tmp_path,
                                                                                monkeypatch, caplog, reference,
                                                                                backend, fault):
    scorer, card = _csim(monkeypatch) if backend == "csim" else _xrt(tmp_path, monkeypatch)
    calls = (lambda: card.calls) if backend == "csim" else (lambda: card.runs)
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CONFIG, policy="hillinfer",
                                scorer=scorer, device="cpu") as engine:
        if backend == "csim":
            card.fault, card.faulty_from = fault, FAULTY_FROM
        else:
            card.faulty_from = FAULTY_FROM
            _xrt_fault(card, fault)
        with caplog.at_level(logging.WARNING):
            out = engine.generate(FAULT_PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        assert [r.token_ids for r in out] == reference  # the failed kernel's scores were never used
        assert "failed on layer" in out[0].stats["scorer_fallback"]  # the result says the batch scored on the CPU
        assert calls() >= FAULTY_FROM, "the request ended before the fault could hit"
        warnings = [r.getMessage() for r in caplog.records if "in-storage scorer" in r.getMessage()]
        assert len(warnings) == 1 and WARNED[fault] in warnings[0] and "scored on the CPU" in warnings[0]
        assert files_under(kv_path) == []
        before = calls()
        if backend == "csim":
            card.fault = None
        else:
            _xrt_fault(card, None)
        out = engine.generate(FAULT_PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        assert [r.token_ids for r in out] == reference and out[0].stats["scorer_fallback"] is None  # the next request ...
        assert calls() > before, "the next request did not use the in-storage scorer again"  # ... on the card
        assert files_under(kv_path) == []


def test_a_request_whose_pool_the_cpu_cannot_read_either_fails_clearly(model_dirs, kv_path, monkeypatch, reference):
    scorer, csim = _csim(monkeypatch)
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CONFIG, policy="hillinfer",
                                scorer=scorer, device="cpu") as engine:
        csim.fault, csim.faulty_from = "pool gone", FAULTY_FROM
        with pytest.raises(ScoringError, match=r"on the CPU either .FileNotFoundError.*in-storage scorer csim "
                                               r"\(emulated\) failed .*No such file.*missing or short.*run it again"):
            _generate(engine)
        assert files_under(kv_path) == []
        csim.fault = None
        assert _generate(engine) == reference
        assert files_under(kv_path) == []


@pytest.mark.parametrize("backend", ["csim", "xrt"])
def test_a_kernel_that_completes_without_writing_never_returns_scores(tmp_path, monkeypatch, backend):
    """The outputs hold UNWRITTEN until the kernel writes them: not the previous run's scores (the card's buffers are
    reused), nor whatever memory held (the csim's)."""
    rng = np.random.default_rng(0)
    write_pool(tmp_path / "pool.f16", rng.standard_normal((64, 2, 32)).astype(np.float16))
    pool = KeyPool(tmp_path / "pool.f16", np.arange(64, dtype=np.int32), 2, 32)
    q = rng.standard_normal((2, 32)).astype(np.float32)
    scorer, card = _csim(monkeypatch) if backend == "csim" else _xrt(tmp_path, monkeypatch)
    check_result(scorer.score(pool, q, 1.0, 64, 4), pool, 64, 4)
    if backend == "csim":
        card.fault = "writes nothing"
    else:
        card.written = 0
    with pytest.raises(ScoreBlockError, match="entry 0 holds position -1"):
        check_result(scorer.score(pool, q, 1.0, 64, 4), pool, 64, 4)


def test_the_result_check_refuses_each_kind_of_bad_block(tmp_path):
    rng = np.random.default_rng(1)
    write_pool(tmp_path / "pool.f16", rng.standard_normal((40, 1, 8)).astype(np.float16))
    pool = KeyPool(tmp_path / "pool.f16", rng.permutation(400)[:40].astype(np.int32), 1, 8)
    good = NumpyScorer().score(pool, rng.standard_normal((1, 8)).astype(np.float32), 1.0, 16, 3)
    check_result(good, pool, 16, 3)

    def bad(edit):
        result = type(good)(good.scores.copy(), good.block_topk.copy(), 0, 0)
        edit(result)
        with pytest.raises(ScoreBlockError):
            check_result(result, pool, 16, 3)

    bad(lambda r: r.scores.__setitem__(5, (r.scores[5]["pos"], np.nan)))  # a NaN score
    bad(lambda r: r.scores.__setitem__(5, (r.scores[6]["pos"], 0.0)))  # a position out of place
    bad(lambda r: r.block_topk.__setitem__((0, 0), r.block_topk[1, 0]))  # another block's token
    bad(lambda r: r.block_topk.__setitem__((0, 1), r.block_topk[0, 0]))  # a token twice
    bad(lambda r: r.block_topk.__setitem__((0, 0), r.scores[np.argmin(r.scores["score"][:16])]))  # not the best
    bad(lambda r: r.block_topk.__setitem__((2, 2), (-1, -np.inf)))  # padding where the last block has a token
    bad(lambda r: setattr(r, "scores", r.scores[:-1]))  # short


def test_scorers_that_cannot_start_say_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ there
    with pytest.raises(OSError, match=r"g\+\+ is not installed.*apt install g\+\+.*numpy scorer"):
        CsimScorer()
    monkeypatch.setitem(sys.modules, "pyxrt", None)
    with pytest.raises(OSError, match="pyxrt is not importable.*setup.sh"):
        XrtScorer(tmp_path / "x.xclbin")
    monkeypatch.setitem(sys.modules, "pyxrt", fake_pyxrt)
    with pytest.raises(OSError, match="x.xclbin is missing; build it with make -C fpga"):
        XrtScorer(tmp_path / "x.xclbin")


def test_a_damaged_cached_csim_library_is_rebuilt(tmp_path, monkeypatch, caplog):
    from edgekv.platforms.smartssd import build_csim

    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    path = build_csim()
    path.write_bytes(b"\x7fELF garbage")
    with caplog.at_level(logging.WARNING):
        scorer = CsimScorer()
    assert "does not load" in caplog.text and "rebuilding" in caplog.text
    write_pool(tmp_path / "pool.f16", np.ones((20, 1, 8), np.float16))
    pool = KeyPool(tmp_path / "pool.f16", np.arange(20, dtype=np.int32), 1, 8)
    check_result(scorer.score(pool, np.ones((1, 8), np.float32), 1.0, 16, 2), pool, 16, 2)


CRASH = """
import os, signal, sys
from edgekv.platforms.smartssd import CsimScorer
from edgekv.runtime import Engine

class Crashing:  # the csim library segfaults inside its C function
    def ekv_csim_score_file(self, *args):
        os.kill(os.getpid(), signal.SIGSEGV)

scorer = CsimScorer()
scorer._lib = Crashing()
config = {config!r}
with Engine.from_pretrained({model!r}, kv_path={kv!r}, config=config, policy="hillinfer", scorer=scorer,
                            device="cpu") as e:
    e.generate({prompts!r}, max_new_tokens=2, stop_token_ids=[])
"""


def test_a_csim_crash_ends_its_process_and_the_next_engine_removes_its_files(model_dirs, kv_path, tmp_path, reference):
    script = CRASH.format(config=CONFIG, model=model_dirs["llama"], kv=str(kv_path), prompts=FAULT_PROMPTS)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGSEGV, done.stderr
    left = files_under(kv_path)
    assert any(name.endswith(".f16") for name in left), "the crashed request left no pool files to clean"
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CONFIG, policy="hillinfer",
                                scorer=CsimScorer(), device="cpu") as engine:
        assert _generate(engine) == reference
    assert files_under(kv_path) == []
