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
