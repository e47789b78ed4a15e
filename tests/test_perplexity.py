"""Perplexity mode: windows that never overlap calibration, metrics that mean what they say, the JSON interface."""
import json
import math
from dataclasses import replace

import pytest
import torch

from edgekv.cli import main
from edgekv.evals import perplexity
from edgekv.evals.tasks import HAYSTACK_TEXT
from tests.conftest import save_text_model

CONTEXT, CONTINUATION = 160, 24


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("ppl") / "m")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(HAYSTACK_TEXT * 12)
    return path


def test_split_keeps_calibration_apart_from_the_windows():
    ids = list(range(1000))
    split = perplexity.split_text(ids, context=300, calibration_tokens=100, windows=5)
    assert split.calibration == list(range(100))
    assert [w[0] for w in split.windows] == [100, 400, 700] and all(len(w) == 300 for w in split.windows)
    with pytest.raises(ValueError, match="needs at least 1100"):
        perplexity.split_text(ids[:1000], context=1000, calibration_tokens=100, windows=1)


def test_compare_scores_the_targets_and_the_reference():
    reference = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]]]).log()
    targets = torch.tensor([[0, 2]])
    ppl, agree, kl = perplexity.compare(reference, reference, targets)
    assert ppl == pytest.approx(math.exp(-(math.log(0.7) + math.log(0.1)) / 2))
    assert agree == 1.0 and kl == pytest.approx(0.0, abs=1e-7)
    other = torch.tensor([[[0.2, 0.7, 0.1], [0.1, 0.8, 0.1]]]).log()
    _, agree, kl = perplexity.compare(other, reference, targets)
    expected_kl = (0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)) / 2
    assert agree == 0.5 and kl == pytest.approx(expected_kl, rel=1e-5)


def test_full_perplexity_equals_the_hf_forward_pass(text_model, text_file, tmp_path):
    """The decode path's perplexity of `full` is the model's own: the same number HF computes in one forward pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(text_model)(text_file.read_text())["input_ids"]
    results = perplexity.evaluate_ppl(text_model, tmp_path, [], [CONTEXT], ids, windows=2, continuation=CONTINUATION,
                                      quiet=True)
    windows = perplexity.split_text(ids, CONTEXT, CONTEXT, 2).windows
    hf = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor(windows)).logits.log_softmax(-1)
    # positions CONTEXT-CONTINUATION+1 .. CONTEXT-1 are predicted from the tokens before them
    span = slice(CONTEXT - CONTINUATION, CONTEXT - 1)
    targets = torch.tensor(windows)[:, span.start + 1 : span.stop + 1]
    nll = -logits[:, span].gather(-1, targets[..., None]).mean()
    assert results[0].policy == "full" and results[0].tokens == 2 * (CONTINUATION - 1)
    assert results[0].ppl == pytest.approx(math.exp(float(nll)), rel=1e-4)


def test_eval_ppl_over_several_contexts_calibrates_once_and_scores_each(text_model, text_file, tmp_path):
    """The interface's `--contexts 8192,16384,32768` form, small: one calibration span (the shortest context's), then
    each context its own windows after it, every row at its context against that context's full."""
    out = tmp_path / "ppl.json"
    rc = main(["eval", "--model", text_model, "--ppl", str(text_file), "--contexts", f"{CONTEXT},{2 * CONTEXT}",
               "--budgets", "1/4", "--policies", "full,kvswap", "--samples", "2", "--ppl-tokens", str(CONTINUATION),
               "--json", str(out), "--quiet"])
    assert rc == 0
    rows = json.loads(out.read_text())["ppl"]
    assert [(r["context"], r["variant"]) for r in rows] == [(c, v) for c in (CONTEXT, 2 * CONTEXT)
                                                            for v in ("full", "kvswap@1/4")]
    assert rows[0]["windows"] == 2 and all(r["tokens"] == r["windows"] * (CONTINUATION - 1) for r in rows)
    assert [r["ratio_to_full"] for r in rows[::2]] == [1.0, 1.0] and rows[1]["ppl"] != rows[3]["ppl"]
    assert [r["config"]["max_context"] >= r["context"] for r in rows[1::2]] == [True, True]


def test_eval_ppl_command_writes_the_interface_json(text_model, text_file, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    rc = main(["eval", "--model", text_model, "--ppl", str(text_file), "--contexts", str(CONTEXT), "--budgets", "1/4",
               "--policies", "full,kvswap,token,flexgen", "--samples", "2", "--ppl-tokens", str(CONTINUATION),
               "--json", str(out), "--quiet"])
    assert rc == 0
    assert "kvswap@1/4" in capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(out.read_text())["ppl"]}
    assert set(rows) == {"full", "kvswap@1/4", "token@1/4", "flexgen"}
    for row in rows.values():
        assert {"policy", "budget", "context", "ppl", "ratio_to_full", "top1_agreement"} <= set(row)
        assert row["context"] == CONTEXT and row["ppl"] > 0
    assert rows["full"]["ratio_to_full"] == 1.0 and rows["full"]["top1_agreement"] == 1.0
    # flexgen reads every group: the same predictions as full
    assert rows["flexgen"]["top1_agreement"] == 1.0
    assert rows["flexgen"]["ratio_to_full"] == pytest.approx(1.0, abs=1e-4)
    assert rows["kvswap@1/4"]["budget"] == 0.25 and rows["kvswap@1/4"]["kl_full_policy"] >= 0


def test_ppl_errors_name_the_fix(text_model, tmp_path, capsys):
    assert main(["eval", "--model", text_model, "--ppl", str(tmp_path / "absent.txt"), "--contexts", "128"]) == 2
    assert "pass a text file or 'builtin'" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("The grass is green.")
    assert main(["eval", "--model", text_model, "--ppl", str(short), "--contexts", "128", "--quiet"]) == 2
    assert "--ppl-tokens 256 must be in [2, 128)" in capsys.readouterr().err
    assert main(["eval", "--model", text_model, "--ppl", str(short), "--contexts", "128", "--ppl-tokens", "16",
                 "--quiet"]) == 2
    assert "pass a longer text" in capsys.readouterr().err


@pytest.mark.skipif(not perplexity.LICENSES.is_dir(), reason="no /usr/share/common-licenses on this machine")
def test_builtin_text_is_real_english_prose():
    text, source = perplexity.load_text("builtin")
    assert len(text) > 150_000 and "GNU General Public License" in text and "builtin" in source


def test_a_model_without_tokenizer_reads_the_text_as_bytes(model_dirs, text_file, tmp_path):
    """The fixture has no tokenizer but 256 ids: --ppl runs on the text's bytes and says so."""
    out = tmp_path / "ppl.json"
    assert main(["eval", "--model", "fixture", "--ppl", str(text_file), "--contexts", "512", "--budgets", "1/4",
                 "--policies", "full,kvswap", "--samples", "1", "--ppl-tokens", "16", "--json", str(out), "--quiet",
                 "--rule", "mg_const"]) == 0  # the rule is not what this test is about
    data = json.loads(out.read_text())
    assert "UTF-8 bytes" in data["meta"]["tokens"] and [r["variant"] for r in data["ppl"]] == ["full", "kvswap@1/4"]
    with pytest.raises(ValueError, match="no tokenizer and 160 < 256"):
        perplexity.tokenize(model_dirs["llama"], "text")


def test_the_gap_to_the_oracle_is_split_into_the_guess_and_the_low_rank_keys():
    def row(variant, ratio, top1, correction="guess"):
        return perplexity.PplResult("kvswap", 1 / 13, 8192, variant, 15.0 * ratio, ratio, top1, 0.0, 100, 2,
                                    {"correction": correction}, 1.0)

    results = [perplexity.PplResult("full", None, 8192, "full", 15.0, 1.0, 1.0, 0.0, 100, 2, {}, 1.0),
               row("kvswap@1/13", 1.03, 0.91), row("kvswap@1/13,oracle", 1.005, 0.98),
               row("kvswap@1/13,corrected", 1.01, 0.95, "corrected"), row("kvswap@1/13,sigma=1", 1.02, 0.94)]
    [line] = perplexity.oracle_gap(results)
    assert "the layer-ahead guess costs +0.020 ppl x, -0.040 top-1" in line
    assert "the low-rank keys +0.005 ppl x, -0.030 top-1" in line
    assert "correcting only where" not in line
    assert perplexity.oracle_gap(results[:2]) == []  # no loss stages measured: nothing to say
    skipping = row("kvswap@1/13,corrected,recall=0.85", 1.012, 0.945, "corrected")
    [line] = perplexity.oracle_gap(results + [replace(skipping, corrected_layer_share=0.25)])
    assert "correcting only where the guess falls short (corrected,recall=0.85, 0.25 of the layer-steps) +0.002 ppl " \
           "x, -0.005 top-1" in line


def test_a_recorded_row_over_its_budget_is_refused_before_any_row_runs(text_model, text_file, tmp_path, capsys,
                                                                        monkeypatch):
    """An eval of rows read from an earlier run checks every row's memory first: a row over its budget fails at
    once, named, instead of after the rows before it ran (their results lost with the run)."""
    runs = []
    monkeypatch.setattr(perplexity, "run_windows", lambda *a, **k: runs.append(a) or (_ for _ in ()).throw(AssertionError))
    over = {"G": 4, "M": 40, "C": 40, "sigma": 1.0, "reuse": True, "sink_tokens": 0, "window_tokens": 0}
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"ppl": [{"policy": "kvswap", "budget": 1 / 8, "variant": "kvswap@1/8",
                                            "context": CONTEXT, "config": over}]}))
    rc = main(["eval", "--model", text_model, "--ppl", str(text_file), "--contexts", str(CONTEXT), "--budgets", "1/8",
               "--policies", "full,kvswap", "--samples", "2", "--ppl-tokens", str(CONTINUATION), "--rule", "quality",
               "--configs-from", str(configs), "--quiet"])
    assert rc == 2 and not runs
    err = capsys.readouterr().err
    assert "row kvswap@1/8 at context 160" in err and "max_kv_mem_mib" in err
