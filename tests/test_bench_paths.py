"""The bench over several KV paths: which rows, the fields each JSON run gains, the replacement replay and the
dedup savings in the meta, and the Interface command line (edgekv bench --kv-paths ... --path-limit-mib-s X)."""
import json

import numpy as np
import pytest
import torch

from edgekv import bench
from edgekv.cli import main
from edgekv.runtime.events import StepEvent


def tuned(reuse=True, record="auto"):
    """A kvswap row's configuration as policy_configs gives it."""
    return {"max_context": 512, "max_batch": 2, "io_align_bytes": 4096, "io_queue_depth": 32, "G": 4, "M": 8, "C": 12,
            "sigma": 8, "reuse": reuse, "max_kv_mem_mib": 1.0, "kv_record_dtype": record}


@pytest.mark.parametrize("folders, counts", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (8, [1, 2, 4, 8])])
def test_path_counts_take_1_2_4_below_the_folders_and_all_of_them(folders, counts):
    assert bench.path_counts(folders) == counts


def test_path_rows_compare_layouts_then_policies_then_dedup_at_the_largest_n():
    rows = bench.path_rows(tuned(), 4, batch=1)
    assert [label for label, *_ in rows] == [
        "kvswap/1p", "kvswap/1p+cluster", "kvswap/2p", "kvswap/2p+cluster", "kvswap/4p", "kvswap/4p+cluster",
        "kvswap/4p+cluster,lru", "kvswap/4p+cluster,cost", "kvswap-noreuse/4p", "kvswap-noreuse/4p+cluster",
        "kvswap/4p,shared-doc", "kvswap/4p,shared-doc,no-dedup"]
    assert [role for *_, role in rows].count("trace") == 1 and rows[5][3] == "trace"
    for label, n, cfg, role in rows:
        assert {k: cfg[k] for k in ("G", "M", "C", "sigma")} == {"G": 4, "M": 8, "C": 12, "sigma": 8}, label
        assert cfg["clustering"] == ("+cluster" in label) and n == int(label.split("/")[1][0])
    assert [cfg["replacement"] for _, _, cfg, _ in rows[5:8]] == ["fifo", "lru", "cost"]
    dedup = [cfg for *_, cfg, role in rows if role == "dedup"]
    assert [cfg["share_prefix"] for cfg in dedup] == [True, False]
    assert all(cfg["max_batch"] == 2 and cfg["max_kv_mem_mib"] == 2.0 for cfg in dedup)  # batch >= 2, same budget per sequence


def test_path_rows_without_a_reuse_buffer_skip_the_replacement_rows_and_keep_the_record_format():
    labels = [label for label, *_ in bench.path_rows(tuned(reuse=False, record="int8"), 2, batch=2)]
    assert labels == ["kvswap/1p,int8", "kvswap/1p+cluster,int8", "kvswap/2p,int8", "kvswap/2p+cluster,int8",
                      "kvswap/2p,shared-doc,int8", "kvswap/2p,shared-doc,no-dedup,int8"]


def test_clustering_fits_the_same_budget_by_lowering_c_then_m(model_dirs):
    from edgekv.runtime.model import load_model

    model = load_model(model_dirs["llama"], torch.device("cpu"), torch.float32, 576)
    roomy = {**tuned(), "max_kv_mem_mib": 64.0}
    assert bench.fit_for_clustering(model, roomy) == roomy
    tight = bench.fit_for_clustering(model, {**tuned(), "max_kv_mem_mib": 0.12})
    assert tight["C"] < 12 and tight["M"] <= 8 and tight["C"] >= tight["M"]
    with pytest.raises(ValueError, match="raise the budget"):
        bench.fit_for_clustering(model, {**tuned(), "max_kv_mem_mib": 0.001})


def test_shared_doc_prompts_share_the_document_and_differ_in_the_question():
    prompt = list(range(100, 200))
    questions = bench.shared_doc_prompts(prompt, 3, 160, torch.Generator().manual_seed(0))
    assert all(q[:84] == prompt[:84] and len(q) == 100 for q in questions)
    assert len({tuple(q[84:]) for q in questions}) == 3


def test_trace_recorder_keeps_copies_of_the_picks_only():
    recorder = bench.TraceRecorder()
    groups, valid = np.array([[3, 5]]), np.array([[True, False]])
    recorder(StepEvent("groups_selected", 0, {"layer": 1, "groups": groups, "valid": valid}))
    recorder(StepEvent("decode_step_end", 0, {"step": 0, "active": 1}))
    groups[0, 0] = 9  # the engine may reuse its arrays
    assert len(recorder.trace) == 1 and recorder.trace[0][0] == 1 and recorder.trace[0][1].tolist() == [[3, 5]]


def test_a_path_limit_needs_the_paths(tmp_path):
    with pytest.raises(ValueError, match="--kv-paths"):
        bench.run(tmp_path, tmp_path, [1], [512], ["1/4"], 2, 1, 0.5, ["full"], path_limit_mib_s=100.0)


def test_bench_over_two_paths_writes_the_paths_rows_and_the_meta(model_dirs, tmp_path, capsys):
    """The Interface end to end: edgekv bench --kv-paths DIR1,DIR2 --path-limit-mib-s X (the arguments' wiring
    alone: tests/test_kv_paths_install.py)."""
    from edgekv.runtime import RecordLayout
    from edgekv.runtime.model import load_model

    dirs = [tmp_path / "p0", tmp_path / "p1"]
    for d in dirs:
        d.mkdir()
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", model_dirs["llama"], "--batches", "2", "--contexts", "512", "--budgets", "1/4",
                 "--steps", "2", "--warmup", "1", "--disk-seconds", "0.5", "--policies", "full,kvswap", "--quiet",
                 "--kv-paths", f"{dirs[0]},{dirs[1]}", "--path-limit-mib-s", "200", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    runs, meta = data["runs"], data["meta"]
    paths = [r for r in runs if r["policy"].startswith("kvswap/")]
    fitted = meta["paths_configs"]["2x512/1/4"]
    expected = ["kvswap/1p", "kvswap/1p+cluster", "kvswap/2p", "kvswap/2p+cluster"]
    expected += ["kvswap/2p+cluster,lru", "kvswap/2p+cluster,cost"] if fitted["reuse"] else []
    assert [r["policy"] for r in paths] == expected + ["kvswap/2p,shared-doc", "kvswap/2p,shared-doc,no-dedup"]
    assert {r["n_paths"] for r in paths} == {1, 2} and {r["clustering"] for r in paths} == {"on", "off"}
    model = load_model(model_dirs["llama"], torch.device("cpu"), torch.float32, 576)
    stride = RecordLayout(fitted["G"], model.dims.n_kv_heads, model.dims.head_dim, model.dtype, 4096).stride_bytes
    for r in paths:
        assert (r["G"], r["M"], r["C"], r["sigma"]) == (fitted["G"], fitted["M"], fitted["C"], fitted["sigma"])
        assert r["requests_per_step"] > 0 and stride <= r["bytes_per_request"] <= 262144
        assert r["kv_bytes_read"] == sum(r["records_by_path"]) * stride and len(r["records_by_path"]) == r["n_paths"]
        assert r["eff_bw_mib_s"] == r["eff_read_bw_mib_s"] > 0 and r["path_limit_mib_s"] == 200
        assert "paced to 200 MiB/s" in r["reader"] and r["decode_tok_s"] > 0
    one_path = next(r for r in runs if r["policy"] == "kvswap")
    assert (one_path["n_paths"], one_path["clustering"], one_path["path_limit_mib_s"]) == (1, "off", None)
    full = runs[0]
    assert full["n_paths"] is None and full["clustering"] is None and full["requests_per_step"] is None

    rates = meta["replacement_replay"]["2x512/1/4"]
    assert set(rates) == {"fifo", "lru", "cost"} and all(0 <= v <= 1 for v in rates.values())
    if fitted["reuse"]:  # the replay of the trace row's own picks through its own policy gives its hit rate back
        assert rates["fifo"] == pytest.approx(next(r for r in paths if r["policy"] == "kvswap/2p+cluster")["reuse_rate"])
    dedup = meta["dedup"]["2x512/1/4"]
    if fitted["reuse"]:  # a group both questions pick is read once into the shared pool, then hit by both
        assert dedup["bytes_without"] > dedup["bytes_with"] > 0 and dedup["ratio"] > 1
    else:  # without a reuse buffer only picks of one step coincide: never more bytes (tests/test_kv_paths.py: exact)
        assert dedup["bytes_without"] >= dedup["bytes_with"] > 0
    assert (dedup["bytes_with"], dedup["bytes_without"]) == tuple(r["kv_bytes_read"] for r in paths[-2:])
    assert meta["paths"]["n_paths"] == [1, 2] and meta["paths"]["distinct_devices"] == 1
    assert meta["paths"]["path_limit_mib_s"] == 200 and "200 MiB/s" in meta["paths"]["emulation"]

    printed = capsys.readouterr().out
    assert all(column in printed for column in ("paths", "req/step", "KiB/req", "clust"))
    assert "kvswap/2p,shared-doc,no-dedup" in printed and "reuse hit rate, 2x512/1/4" in printed
    assert "dedup, 2x512/1/4: 2 questions of 16 tokens" in printed
