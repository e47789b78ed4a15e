"""The quality harness end to end on small checkpoints (random weights: accuracy is not the point here)."""
import json

import pytest
import torch

from edgekv.cli import main
from edgekv.evals import harness
from edgekv.evals.tasks import TASKS, TextFormat, make_instance
from edgekv.runtime.memory import MIB
from edgekv.runtime.model import ModelDims
from tests.conftest import save_model, save_text_model, word_tokenizer


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("text") / "m")


@pytest.mark.parametrize("budget", [1 / 13, 1 / 34])
@pytest.mark.parametrize("policy", ["kvswap", "token"])
def test_budget_config_fits_the_budget(budget, policy):
    dims = ModelDims(n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, vocab=256)
    config = harness.budget_config(harness.Variant(policy, budget), 4096, dims, torch.float32, max_batch=2)
    full_mib = 2 * 4 * (4096 + 64) * 2 * 2 * 64 * 4 / MIB
    assert config["max_kv_mem_mib"] == pytest.approx(budget * full_mib)
    assert config["M"] >= 1 and (config["G"] == 1) == (policy == "token")


def test_budget_too_small_for_one_group_is_an_error():
    dims = ModelDims(n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, vocab=256)
    with pytest.raises(ValueError, match="no room for one group"):
        harness.budget_config(harness.Variant("kvswap", 1 / 5000), 256, dims, torch.float32, max_batch=1)


def test_a_budget_the_sliding_window_rings_fill_is_refused_naming_them():
    """Gemma 3 270M's shape: 15 of 18 layers keep 512-token rings, 5 % of the whole KV at 8K, more than 1/34."""
    dims = ModelDims(n_layers=18, hidden=640, n_heads=4, n_kv_heads=1, head_dim=256, vocab=1024,
                     layer_windows=tuple(0 if layer % 6 == 5 else 512 for layer in range(18)))
    with pytest.raises(ValueError, match=r"rings alone take 15\.\d MiB of its 8\.\d MiB a sequence"):
        harness.budget_config(harness.Variant("token", 1 / 34), 8192, dims, torch.float32, max_batch=1)
    assert harness.budget_config(harness.Variant("token", 1 / 13), 8192, dims, torch.float32, max_batch=1)["M"] >= 1


def test_text_tasks_from_a_tokenizer_are_recoverable():
    fmt = TextFormat(word_tokenizer())
    for task in TASKS:
        inst = make_instance(task, 400, __import__("numpy").random.default_rng(0), fmt=fmt)
        assert len(inst.context) == 400
        for i, answer in zip(inst.answer_at, inst.answers):
            assert answer in inst.context  # every answer is written somewhere in the context


def test_eval_command_writes_the_table_and_json(text_model, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", text_model, "--policies", "full,kvswap,token,flexgen", "--budgets", "1/4",
               "--contexts", "384", "--tasks", "single_needle,multiquery", "--samples", "2", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "single_needle" in printed and "kvswap@1/4" in printed
    data = json.loads(out.read_text())
    cells = {(r["task"], r["policy"], r["budget"]) for r in data["results"]}
    assert ("multiquery", "kvswap", 0.25) in cells and ("single_needle", "full", None) in cells
    assert set(data["relative"]) == {"full", "kvswap@1/4", "token@1/4", "flexgen"}
    assert all(0 <= r["accuracy"] <= 1 and r["context"] == 384 for r in data["results"])


def test_niah_grid_and_plot(text_model, tmp_path):
    grid = harness.niah_grid(text_model, tmp_path, harness.Variant("full"), [256, 384], [0.0, 0.5, 1.0], 1, 0)
    assert grid.shape == (2, 3) and ((grid >= 0) & (grid <= 1)).all()
    harness.plot_niah(tmp_path / "niah.png", grid, [256, 384], [0.0, 0.5, 1.0], "full")
    assert (tmp_path / "niah.png").stat().st_size > 1000


def test_model_without_tokenizer_or_fixture_vocab_is_refused(model_dirs):
    with pytest.raises(ValueError, match="no tokenizer"):
        harness.task_format(model_dirs["llama"])


def test_quality_rule_takes_the_least_measured_loss_under_the_budget_and_caches_it(model_dirs, tmp_path, monkeypatch):
    """Least loss as ``harness.least_loss`` defines it: top-1 agreement first, within its error the lowest ppl ratio."""
    from edgekv.evals import scoring
    from edgekv.install import quality, solver
    from edgekv.runtime.model import load_model

    monkeypatch.setattr(quality, "MG_SHARES", (0.2,))  # two families: with and without sinks and window
    model = load_model(model_dirs["llama"], torch.device("cpu"), torch.float32, 512 + 64)
    adapters = harness.Adapters(model, [[1 + i % 150 for i in range(200)]])
    chooser = harness.QualityChooser(model, model_dirs["llama"], tmp_path, adapters, quiet=True, cache_dir=tmp_path)
    monkeypatch.setattr(scoring, "calibration_windows", lambda d, c, n: ([[3 + (7 * i) % 150 for i in range(c)]] * n, "ids"))
    variant = harness.Variant("kvswap", 1 / 4, rule="quality")
    budget = harness.budget_config(harness.Variant("kvswap", 1 / 4), 512, model.dims, torch.float32, 2)["max_kv_mem_mib"]
    config = harness.budget_config(variant, 512, model.dims, torch.float32, 2, chooser=chooser)
    measured = next(iter(chooser.cache.values()))["points"]
    assert {(p["sink_tokens"], p["window_tokens"]) for p in measured} <= set(quality.SINK_WINDOW + quality.NARROW_WINDOWS)
    assert {p["mg_tokens"] for p in measured} == {quality.share_tokens(s, 512, config["G"]) for s in (0.15, 0.2)}
    key_dims = model.dims.n_kv_heads * model.dims.head_dim  # each corrected family also at its largest int4 rank
    assert any(p["klr_dtype"] == "int4" and p["sigma"] not in solver.SIGMAS and p["correction"] == "corrected"
               and key_dims / p["sigma"] == round(key_dims / p["sigma"]) for p in measured)
    best = harness.least_loss(measured, quality.WINDOWS * (quality.continuation(512) - 1))
    assert (config["M"] * config["G"], config["sigma"], config["sink_tokens"]) == (
        best["mg_tokens"], best["sigma"], best["sink_tokens"])
    assert config["max_kv_mem_mib"] == pytest.approx(budget)  # the same budget as KVSwap's rule gets
    assert config["calibration_ppl_ratio"] == best["ppl_ratio"]
    monkeypatch.setattr(scoring, "ConfigScorer", None)  # a second choice is read from the cache, not measured
    again = harness.QualityChooser(model, model_dirs["llama"], tmp_path, adapters, quiet=True, cache_dir=tmp_path)
    assert harness.budget_config(variant, 512, model.dims, torch.float32, 2, chooser=again) == config
    with pytest.raises(ValueError, match="QualityChooser"):
        harness.budget_config(variant, 512, model.dims, torch.float32, 2)


def test_quality_cache_is_per_point_and_reads_the_per_grid_cache_before_it(tmp_path):
    """A point's measure does not depend on the budget it is a candidate under: the cache the eval kept per (budget,
    grid) merges into one table per (policy, context, adapters), each point once."""
    point = {"G": 4, "mg_tokens": 408, "sigma": 8.0, "sink_tokens": 4, "window_tokens": 64, "klr_dtype": "int8",
             "correction": "corrected", "ppl_ratio": 1.1, "top1_agreement": 0.9}
    other = {**point, "window_tokens": 0, "sink_tokens": 0}
    old = {"kvswap context=8192 G=4 budget=111 adapters=abc grid=g1": {"source": "text", "measured": [point]},
           "kvswap context=8192 G=4 budget=222 adapters=abc grid=g2": {"source": "text", "measured": [point, other]},
           "kvswap context=4096 G=4 budget=333 adapters=abc grid=g3": {"source": "text", "measured": [point]}}
    merged = harness._per_point(old)
    assert sorted(merged) == ["kvswap context=4096 adapters=abc", "kvswap context=8192 adapters=abc"]
    assert merged["kvswap context=8192 adapters=abc"]["points"] == [point, other]
    assert harness._per_point(merged) == merged  # the new form reads back as itself
    theirs = {"kvswap context=8192 adapters=abc": {"points": [{**point, "ppl_ratio": 9.0}, {**other, "sigma": 4.0}]},
              "kvswap context=2048 adapters=abc": {"points": [point]}}  # another eval of the model wrote meanwhile
    both = harness._per_point(theirs, into=merged)
    assert both is merged and both["kvswap context=2048 adapters=abc"]["points"] == [point]
    assert both["kvswap context=8192 adapters=abc"]["points"] == [point, other, {**other, "sigma": 4.0}]  # ours kept


def test_least_loss_is_the_lowest_ppl_among_the_top1_agreements_that_tie_with_the_best():
    """SmolLM2's calibration rows (ppl ratio, top-1) over 254 tokens.  8K, 1/13: the lowest ppl agrees least with full
    and loses.  4K, 1/34: 0.890 and 0.870 tie within two standard errors (0.039), so the lower ppl wins."""
    at_8k = [{"ppl_ratio": 0.928, "top1_agreement": 0.898}, {"ppl_ratio": 0.96, "top1_agreement": 0.957},
             {"ppl_ratio": 0.961, "top1_agreement": 0.953}]
    assert harness.least_loss(at_8k, 254) is at_8k[1]
    at_4k = [{"ppl_ratio": 1.108, "top1_agreement": 0.890}, {"ppl_ratio": 1.077, "top1_agreement": 0.870},
             {"ppl_ratio": 1.05, "top1_agreement": 0.80}]
    assert harness.least_loss(at_4k, 254) is at_4k[1]
    assert harness.least_loss(at_4k, 100_000) is at_4k[0]  # measured on many tokens, 2 points are no tie


def test_configs_from_an_earlier_eval_are_run_as_recorded(model_dirs, tmp_path):
    from edgekv.runtime.model import load_model

    model = load_model(model_dirs["llama"], torch.device("cpu"), torch.float32, 512 + 64)
    recorded = {"G": 4, "M": 20, "C": 3, "sigma": 16.0, "reuse": False, "sink_tokens": 4, "window_tokens": 64,
                "klr_dtype": "int8", "score_reduce": "sum", "io_align_bytes": 512, "max_batch": 4}
    rows = [{"policy": "kvswap", "budget": 1 / 4, "variant": "kvswap@1/4", "context": 512, "config": recorded},
            {"policy": "kvswap", "budget": 1 / 4, "variant": "kvswap@1/4,sigma=1", "context": 512, "config": {"G": 16}}]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"ppl": rows}))
    chooser = harness.quality_chooser(model, model_dirs["llama"], tmp_path, None, [harness.Variant("kvswap", 1 / 4, rule="quality")],
                                      True, configs_from=path)
    variant = harness.Variant("kvswap", 1 / 4, rule="quality")
    config = harness.budget_config(variant, 512, model.dims, torch.float32, 2, chooser=chooser)
    assert {k: config[k] for k in recorded if k != "max_batch"} == {k: v for k, v in recorded.items() if k != "max_batch"}
    assert config["max_batch"] == 2  # the run's own batch, not the recorded one
    with pytest.raises(ValueError, match="no kvswap row at context 1024, budget 1/4"):
        harness.budget_config(variant, 1024, model.dims, torch.float32, 2, chooser=chooser)
    recorded["kv_record_dtype"] = "int4"  # a deploy's choice of records comes with it; a row naming a format replaces it
    path.write_text(json.dumps({"ppl": rows}))
    chooser = harness.RecordedChooser(path)
    assert harness.budget_config(variant, 512, model.dims, torch.float32, 2, chooser=chooser)["kv_record_dtype"] == "int4"
    int8 = harness.Variant("kvswap", 1 / 4, rule="quality", record_dtype="int8")
    assert harness.budget_config(int8, 512, model.dims, torch.float32, 2, chooser=chooser)["kv_record_dtype"] == "int8"


def test_a_task_eval_refuses_a_recorded_row_over_its_budget_before_scoring_any(tmp_path, monkeypatch):
    from edgekv.runtime.checkpoints import resolve_checkpoint

    scored = []
    monkeypatch.setattr(harness, "_score", lambda *a, **k: scored.append(a))
    over = {"G": 4, "M": 120, "C": 120, "sigma": 1.0, "reuse": True, "sink_tokens": 0, "window_tokens": 0}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"results": [{"task": "single_needle", "policy": "kvswap", "budget": 1 / 8,
                                             "variant": "kvswap@1/8", "context": 512, "config": over}]}))
    variants = [harness.Variant("full"), harness.Variant("kvswap", 1 / 8, rule="quality")]
    with pytest.raises(ValueError, match="row kvswap@1/8 at context 512: .*max_kv_mem_mib"):
        harness.evaluate(resolve_checkpoint("fixture"), tmp_path, variants, [512], ["single_needle"], 1, 0,
                         max_batch=2, configs_from=path, quiet=True, device="cpu")
    assert not scored
