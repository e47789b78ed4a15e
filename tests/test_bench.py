"""The bench command: ratio arithmetic, step timing without warm-up, and a CI-fast end-to-end run."""
import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from edgekv import bench
from edgekv.cli import main


def small_bench(model_dirs, tmp_path, *flags: str) -> int:
    """``edgekv bench`` on the small llama at batch 2, 512 tokens, budget 1/4, two timed steps, plus ``flags``."""
    return main(["bench", "--model", model_dirs["llama"], "--batches", "2", "--contexts", "512", "--budgets", "1/4",
                 "--steps", "2", "--warmup", "1", "--disk-seconds", "0.5", "--kv-path", str(tmp_path), *flags])


def test_ratio_and_effective_bandwidth():
    assert bench.ratio(50.0, 25.0) == 2.0
    assert bench.ratio(None, 25.0) is None and bench.ratio(5.0, 0.0) is None and bench.ratio(5.0, None) is None
    assert bench.effective_bandwidth(3 * 2**20, 0.5) == pytest.approx(6.0)
    assert bench.effective_bandwidth(0, 0.5) is None and bench.effective_bandwidth(10, 0.0) is None


def test_decode_rate_excludes_warmup_steps():
    # steps 0-1 are slow warm-up; steps 2-3 decode 4 and 2 sequences in 10 ms each
    events = [(0, 4, 900_000_000), (1, 4, 500_000_000), (2, 4, 10_000_000), (3, 2, 10_000_000)]
    tok_s, step_ms = bench.decode_rate(events, warmup=2)
    assert tok_s == pytest.approx(6 / 0.02) and step_ms == pytest.approx(10.0)
    with pytest.raises(ValueError, match="no decode steps after 4 warm-up steps"):
        bench.decode_rate(events, warmup=4)


def test_step_timer_pairs_start_and_end_events():
    from edgekv.runtime.events import StepEvent

    timer = bench.StepTimer()
    for kind, step, t in [("decode_step_start", 0, 100), ("groups_selected", 0, 150), ("decode_step_end", 0, 400),
                          ("decode_step_start", 1, 500), ("decode_step_end", 1, 550)]:
        timer(StepEvent(kind, t, {"step": step, "active": 3}))
    assert timer.steps == [(0, 3, 300), (1, 3, 50)]


def test_bench_end_to_end_writes_every_row(model_dirs, tmp_path, capsys):
    from edgekv.evals import harness

    out = tmp_path / "bench.json"
    chosen = {"G": 4, "M": 6, "C": 4, "sigma": 8.0, "reuse": False, "sink_tokens": 4, "window_tokens": 4,
              "klr_dtype": "int8", "max_context": 576}  # as `edgekv eval --json` records a kvswap row chosen by measured quality
    harness.write_json(tmp_path / "eval.json", [harness.Result("single_needle", 512, "kvswap", 0.25, "kvswap@1/4", 1.0,
                                                               4, chosen, 1.0)], {})
    rc = small_bench(model_dirs, tmp_path, "--json", str(out), "--png", str(tmp_path / "bench.png"),
                     "--quality-configs", str(tmp_path / "eval.json"))
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["full", "flexgen", "token", "kvswap-noreuse", "kvswap", "kvswap-noverify",
                                           "kvswap-quality"]
    assert (runs[4]["verify_fraction"], runs[5]["verify_fraction"], runs[0]["verify_fraction"]) == (1.0, 0.0, None)
    assert {k: runs[5][k] for k in "GMC"} == {k: runs[4][k] for k in "GMC"}  # the same row, unchecked
    assert (runs[-1]["G"], runs[-1]["M"], runs[-1]["sink_tokens"], runs[-1]["klr_dtype"]) == (4, 6, 4, "int8")
    keys = {"policy", "budget", "batch", "context", "decode_tok_s", "ratio_to_full", "kv_resident_mib",
            "read_bytes_per_token", "eff_read_bw_mib_s", "eff_bw_vs_profile", "reuse_rate", "io_stall_share"}
    for r in runs:
        assert keys <= set(r) and r["decode_tok_s"] > 0 and (r["batch"], r["context"]) == (2, 512)
        assert r["ratio_to_full"] == pytest.approx(r["decode_tok_s"] / runs[0]["decode_tok_s"], rel=1e-2)
    assert runs[0]["read_bytes_per_token"] == 0 and runs[1]["read_bytes_per_token"] > runs[4]["read_bytes_per_token"]
    # on the CPU nothing crosses a bus and the host waits for no GPU: copies 0 on disk rows, syncs not counted
    assert (runs[4]["copied_bytes_per_step"], runs[4]["copied_vs_read"], runs[0]["copied_bytes_per_step"]) == (0, 0, None)
    assert all(r["host_syncs_per_step"] is None for r in runs)
    # the disk rows leave a core to their reads (none to leave on one core); full computes on every core
    cores = torch.get_num_threads()
    assert runs[0]["decode_threads"] == cores and runs[4]["decode_threads"] == max(1, cores - 1)
    full_mib = runs[0]["kv_resident_mib"]
    assert all(r["kv_resident_mib"] <= full_mib / 4 + 1e-6 for r in runs[2:])  # within the 1/4 budget
    assert "reproduce: edgekv bench" in capsys.readouterr().out
    assert (tmp_path / "bench.png").is_file()


def test_a_recorded_configuration_runs_with_the_records_it_chose_unless_a_row_names_others(model_dirs, tmp_path):
    """A deploy chooses its records' format and their padding with the rest (int4 records in 2 KiB, beside a reuse
    buffer): the kvswap-quality row runs them as recorded; a ``--record-dtype`` row of another format replaces them."""
    from edgekv.evals import harness

    chosen = {"G": 4, "M": 6, "C": 8, "sigma": 8.0, "reuse": True, "sink_tokens": 0, "window_tokens": 0,
              "klr_dtype": "int4", "kv_record_dtype": "int4", "io_align_bytes": 2048, "max_context": 576}
    harness.write_json(tmp_path / "eval.json", [harness.Result("single_needle", 512, "kvswap", 0.25, "kvswap@1/4", 1.0,
                                                               4, chosen, 1.0)], {})
    out = tmp_path / "bench.json"
    assert small_bench(model_dirs, tmp_path, "--policies", "full,kvswap-quality", "--record-dtype", "auto,int8",
                       "--quality-configs", str(tmp_path / "eval.json"), "--json", str(out)) == 0
    runs = json.loads(out.read_text())["runs"][1:]
    assert [(r["policy"], r["kv_record_dtype"], r["klr_dtype"], r["C"]) for r in runs] == [
        ("kvswap-quality,int4", "int4", "int4", 8), ("kvswap-quality,int8", "int8", "int4", 8)]


def test_a_row_over_its_budget_fails_before_any_row_runs(model_dirs, tmp_path, capsys):
    from edgekv.evals import harness

    over = {"G": 4, "M": 120, "C": 120, "sigma": 1.0, "reuse": True, "max_context": 576}
    harness.write_json(tmp_path / "eval.json", [harness.Result("single_needle", 512, "kvswap", 0.25, "kvswap@1/4", 1.0,
                                                               4, over, 1.0)], {})
    rc = small_bench(model_dirs, tmp_path, "--policies", "full,kvswap-quality",
                     "--quality-configs", str(tmp_path / "eval.json"))
    out, err = capsys.readouterr()
    assert rc == 2 and "row kvswap-quality at budget 1/4, batch 2, context 512" in err and "max_kv_mem_mib" in err
    assert "tok/s" not in out  # not even full ran


def test_llama_cpp_row_only_for_a_gguf_model_with_the_binding(model_dirs, tmp_path, monkeypatch):
    """The row needs the model's GGUF file and llama-cpp-python; otherwise the bench says why there is none."""
    import importlib.util

    from edgekv.runtime import checkpoints

    assert bench.llama_cpp_source(tmp_path, ["full"]) == (None, "not asked for")
    gguf, note = bench.llama_cpp_source(model_dirs["llama"], ["full", "llama.cpp"])
    assert gguf is None and "not a GGUF" in note
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    (tmp_path / checkpoints._CONVERTED_META).write_text(json.dumps({"source": str(source)}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else real(name))
    gguf, note = bench.llama_cpp_source(tmp_path, ["llama.cpp"])
    assert gguf is None and "pip install 'edgekv[llamacpp]'" in note
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else real(name))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # installed, but an import of it fails (a dependency missing)
    gguf, note = bench.llama_cpp_source(tmp_path, ["llama.cpp"])
    assert gguf is None and "does not import" in note and "pip install 'edgekv[llamacpp]'" in note
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    assert bench.llama_cpp_source(tmp_path, ["llama.cpp"])[0] == source


@pytest.fixture
def fake_llama_cpp(monkeypatch, tmp_path):
    """llama-cpp-python's stand-in (tests/fake_llama_cpp) for the bench's import check here and for the llama.cpp
    row's child process; the file it records each instance in (FAKE_LLAMA_CPP_LOG)."""
    folder = str(Path(__file__).parent / "fake_llama_cpp")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_LLAMA_CPP_LOG", str(tmp_path / "llama-cpp.jsonl"))
    monkeypatch.syspath_prepend(folder)
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    yield tmp_path / "llama-cpp.jsonl"
    sys.modules.pop("llama_cpp", None)


def converted_from_gguf(model_dirs, tmp_path) -> Path:
    """The small llama as a folder converted from a GGUF file (what gives the bench its llama.cpp row)."""
    from edgekv.runtime import checkpoints

    model = tmp_path / "converted"
    shutil.copytree(model_dirs["llama"], model)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (model / checkpoints._CONVERTED_META).write_text(json.dumps({"source": str(tmp_path / "m.gguf")}))
    return model


def test_the_llama_cpp_row_decodes_the_gguf_greedily_in_a_process_of_its_own(model_dirs, tmp_path, fake_llama_cpp):
    from edgekv.runtime.model import ModelDims, read_model_config
    from tests.fake_llama_cpp.llama_cpp import next_token

    model, out = converted_from_gguf(model_dirs, tmp_path), tmp_path / "bench.json"
    assert small_bench(model_dirs, tmp_path, "--model", str(model), "--batches", "1", "--policies", "full,llama.cpp",
                       "--json", str(out)) == 0
    meta, (full, llama) = (json.loads(out.read_text())[k] for k in ("meta", "runs"))
    assert "llama_cpp_failed" not in meta and set(llama) == set(full)
    assert (llama["policy"], llama["budget"], llama["batch"], llama["context"]) == ("llama.cpp", None, 1, 512)
    assert llama["decode_tok_s"] > 0 and llama["step_ms"] > 0
    assert llama["ratio_to_full"] == pytest.approx(llama["decode_tok_s"] / full["decode_tok_s"])
    dims = ModelDims.from_config(read_model_config(model))
    assert llama["kv_resident_mib"] * 2**20 == dims.n_layers * 512 * 2 * dims.n_kv_heads * dims.head_dim * 2  # f16
    (called,) = [json.loads(line) for line in fake_llama_cpp.read_text().splitlines()]
    assert called["pid"] != os.getpid() and called["model_path"] == str(tmp_path / "m.gguf")
    threads = torch.get_num_threads()
    assert (called["n_ctx"], called["n_threads"], called["n_threads_batch"], called["verbose"]) == (512, threads,
                                                                                                    threads, False)
    prompt, *steps = called["evals"]
    assert len(prompt) == 512 - 2 - 1 - 8 and [len(s) for s in steps] == [1] * 3  # one warm-up step, two timed
    fed = [prompt[-1]] + [s[0] for s in steps]
    assert all(token == next_token(before) for before, token in zip(fed, fed[1:]))  # each the last one's greedy pick


def test_a_llama_cpp_row_killed_by_a_signal_names_it_and_the_fix_and_the_other_rows_are_written(
        model_dirs, tmp_path, fake_llama_cpp, monkeypatch, capsys):
    """The wheel's AMX matmul killed the bench with SIGSEGV on a VM that lists AMX: now its process dies alone, the
    row says so with the fix, and every other row is measured and written (JSON and PNG)."""
    monkeypatch.setenv("FAKE_LLAMA_CPP_CRASH", "SIGSEGV")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert small_bench(model_dirs, tmp_path, "--model", str(converted_from_gguf(model_dirs, tmp_path)), "--batches",
                       "1", "--policies", "full,kvswap,llama.cpp", "--json", str(out), "--png", str(png)) == 0
    meta, runs = (json.loads(out.read_text())[k] for k in ("meta", "runs"))
    assert [r["policy"] for r in runs] == ["full", "kvswap"] and all(r["decode_tok_s"] > 0 for r in runs)
    why = meta["llama_cpp_failed"]["1x512"]
    assert why == f"killed by SIGSEGV; {bench.LLAMA_CPP_CRASH_FIX}"
    assert "without AMX" in why and "-mno-amx-tile" in why and "pip install --force-reinstall" in why
    assert f"llama.cpp at 1x512: {why}" in capsys.readouterr().out and png.is_file()
    assert not fake_llama_cpp.exists()  # it died in the prompt's eval, before close


def test_a_llama_cpp_row_whose_process_fails_names_its_last_error(tmp_path, fake_llama_cpp):
    with pytest.raises(bench.LlamaCppFailed, match="exited with status 1: ValueError: Model path does not exist"):
        bench.llama_cpp_run(tmp_path / "gone.gguf", None, [5, 6], 64, 2, 1)


def test_a_llama_cpp_row_killed_by_another_signal_names_its_last_words_not_the_amx_fix(tmp_path, fake_llama_cpp,
                                                                                      monkeypatch):
    """SIGABRT (a ggml assert) or SIGKILL (out of memory) is not the AMX fault: the row names the signal and what the
    process wrote last, without the AMX rebuild."""
    (tmp_path / "m.gguf").touch()
    monkeypatch.setenv("FAKE_LLAMA_CPP_CRASH", "SIGABRT")
    with pytest.raises(bench.LlamaCppFailed) as failed:
        bench.llama_cpp_run(tmp_path / "m.gguf", None, [5, 6], 64, 2, 1)
    assert str(failed.value) == "killed by SIGABRT: GGML_ASSERT failed before SIGABRT"


def test_a_llama_cpp_row_whose_process_hangs_is_stopped_and_named(tmp_path, fake_llama_cpp, monkeypatch):
    (tmp_path / "m.gguf").touch()
    monkeypatch.setenv("FAKE_LLAMA_CPP_HANG", "1")
    monkeypatch.setattr(bench, "LLAMA_CPP_BASE_S", 3.0)
    monkeypatch.setattr(bench, "LLAMA_CPP_S_PER_TOKEN", 0.0)
    with pytest.raises(bench.LlamaCppFailed, match="no step times within 3 s: the process was stopped"):
        bench.llama_cpp_run(tmp_path / "m.gguf", None, [5, 6], 64, 2, 1)


def test_the_in_memory_twin_sets_kvswaps_overlap_against_its_limits(model_dirs, tmp_path):
    out = tmp_path / "bench.json"
    rc = small_bench(model_dirs, tmp_path, "--policies", "full,kvswap,kvswap-ram", "--json", str(out))
    assert rc == 0
    meta, runs = (json.loads(out.read_text())[k] for k in ("meta", "runs"))
    full, kvswap, ram = runs
    assert ram["policy"] == "kvswap-ram" and {k: ram[k] for k in "GMC"} == {k: kvswap[k] for k in "GMC"}
    assert ram["eff_bw_vs_profile"] is None  # its reads are memory copies (tmpfs), not the disk
    assert kvswap["in_memory_step_ms"] == ram["step_ms"] and kvswap["disk_bound_ms"] > 0
    assert kvswap["overlap_efficiency"] == pytest.approx(
        max(kvswap["in_memory_step_ms"], kvswap["disk_bound_ms"]) / kvswap["step_ms"])
    assert ram["overlap_efficiency"] is None and full["overlap_efficiency"] is None
    per_token = full["kv_resident_mib"] * 2**20 / (2 * 512)  # full holds the context for each of the 2 rows
    assert kvswap["full_fit_batch"] == 0  # a quarter of a batch of 2 holds no whole sequence of 512
    assert kvswap["full_fit_context"] == int(kvswap["kv_resident_mib"] * 2**20 // per_token)


def test_the_in_memory_twin_needs_a_tmpfs_and_says_so_before_any_row(model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "RAM_FOLDER", tmp_path / "no-shm")
    rc = small_bench(model_dirs, tmp_path, "--policies", "full,kvswap-ram")
    out, err = capsys.readouterr()
    assert rc == 2 and "kvswap-ram" in err and "no-shm" in err and "tok/s" not in out


def test_each_finished_point_reaches_the_caller_before_the_next_runs(model_dirs, tmp_path):
    """make gpu-check writes its JSON after every point: a run cut off at a time limit keeps what finished."""
    seen = []
    runs, _ = bench.run(Path(model_dirs["llama"]), tmp_path, [1, 2], [256], ["1/4"], 2, 1, 0.5, ["full"],
                        log=lambda *a: None, quiet=True, device="cpu",
                        on_point=lambda so_far: seen.append([(r.batch, r.policy) for r in so_far]))
    assert seen == [[(1, "full")], [(1, "full"), (2, "full")]] and len(runs) == 2


def test_each_finished_row_reaches_the_caller_before_the_next_runs(model_dirs, tmp_path):
    """A lent GPU's call that ran out of time lost a point's finished rows (32K, batch 8: full and kvswap had
    printed): make gpu-check now writes its JSON after every row."""
    seen = []
    runs, _ = bench.run(Path(model_dirs["llama"]), tmp_path, [1, 2], [256], ["1/4"], 2, 1, 0.5, ["full", "kvswap"],
                        log=lambda *a: None, quiet=True, device="cpu",
                        on_row=lambda so_far: seen.append([(r.batch, r.policy) for r in so_far]))
    assert seen == [[(1, "full")], [(1, "full"), (1, "kvswap")], [(1, "full"), (1, "kvswap"), (2, "full")],
                    [(1, "full"), (1, "kvswap"), (2, "full"), (2, "kvswap")]] and len(runs) == 4


def test_the_tuned_row_has_a_corrected_twin_in_the_same_memory(model_dirs, tmp_path):
    out = tmp_path / "bench.json"
    rc = small_bench(model_dirs, tmp_path, "--policies", "kvswap,kvswap-corrected", "--json", str(out))
    assert rc == 0
    guess, corrected = json.loads(out.read_text())["runs"]
    assert (guess["correction"], corrected["correction"]) == ("guess", "corrected")
    assert {k: corrected[k] for k in ("G", "M", "C", "sigma")} == {k: guess[k] for k in ("G", "M", "C", "sigma")}
    assert corrected["kv_resident_mib"] == guess["kv_resident_mib"] and corrected["guess_recall"] is not None


def test_the_policies_bench_alternates_them_at_any_batch(capsys):
    """``python -m bench.policies_ab`` on the fixture: each policy timed in every round on its own prefilled batch,
    the first the base."""
    import re

    from bench.policies_ab import main as policies_ab

    policies_ab(["--model", "fixture", "--context", "200", "--batch", "2", "--kvswap", "G=4,M=6,C=8,sigma=2",
                 "--extra", '{"reuse": true}', "--rounds", "2", "--steps", "2"])
    rows = re.findall(r"^batch 2 (full|kvswap): median ([\d.]+) ms a step \(([\d., ]+)\); ([\d.]+) x the tok/s of "
                      r"full$", capsys.readouterr().out, re.M)
    assert [row[0] for row in rows] == ["full", "kvswap"] and float(rows[0][3]) == 1.0
    assert all(float(row[1]) > 0 and len(row[2].split(", ")) == 2 for row in rows)
