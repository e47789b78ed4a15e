"""The install step's CPU dtype (install/dtypes.py): the profile's dtype is chosen where its perplexity stays within
the limit of float32's and its prefill and decode step are faster; otherwise float32, with the reason in the trial.  The
step's time is set here (the real timing runs in the deploy test and below); the perplexities are the fixture's own."""
import pytest
import torch

from edgekv.install import dtypes
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.devices import DTYPES
from edgekv.runtime.model import load_model

WINDOWS = [[(i * 7 + j) % 250 + 4 for i in range(96)] for j in range(2)]


@pytest.fixture
def loads():
    """A loader of the fixture on the CPU, and the dtypes it was asked for, in order."""
    asked = []

    def load(name):
        asked.append(name)
        return load_model(resolve_checkpoint("fixture"), torch.device("cpu"), DTYPES[name], 128, "native")
    return load, asked


def _steps(monkeypatch, ms_of: dict, prefill_ms_of: dict | None = None):
    """Each dtype's step (and prefill: 100 ms in both unless given)."""
    prefill = prefill_ms_of or {torch.float32: 100.0, torch.bfloat16: 99.0}
    monkeypatch.setattr(dtypes, "timings", lambda model, tokens: (prefill[model.dtype], ms_of[model.dtype]))


def test_a_faster_dtype_within_the_limit_is_chosen_and_both_trials_are_reported(loads, monkeypatch):
    load, asked = loads
    _steps(monkeypatch, {torch.float32: 3.0, torch.bfloat16: 1.5})
    chosen, (base, trial) = dtypes.choose(load, "bfloat16", 1.5, WINDOWS, tokens=64)
    assert chosen == "bfloat16" and asked == ["float32", "bfloat16"]
    assert (base.dtype, base.ppl_ratio, base.top1_agreement, base.step_ms, base.prefill_ms) == \
        ("float32", 1.0, 1.0, 3.0, 100.0)
    assert trial.chosen and (trial.step_ms, trial.prefill_ms) == (1.5, 99.0) and trial.note == ""
    assert 0.9 < trial.ppl_ratio < 1.1 and 0.5 < trial.top1_agreement <= 1  # bf16 rounds the fixture's logits a little


def test_a_dtype_that_is_not_faster_here_keeps_float32_and_says_why(loads, monkeypatch):
    load, _ = loads
    _steps(monkeypatch, {torch.float32: 0.2, torch.bfloat16: 0.3})
    chosen, (_, trial) = dtypes.choose(load, "bfloat16", 1.5, WINDOWS, tokens=64)
    assert chosen == "float32" and not trial.chosen
    assert "its step (0.30 ms) is not faster than float32's (0.20 ms) here" in trial.note


def test_a_dtype_whose_prefill_is_slower_here_keeps_float32_however_fast_its_step(loads, monkeypatch):
    """A CPU without bf16 instructions: bfloat16's decode step may edge out float32's (its cache read natively) while
    every prompt's matmuls run several times slower."""
    load, _ = loads
    _steps(monkeypatch, {torch.float32: 1.61, torch.bfloat16: 1.53}, {torch.float32: 40.0, torch.bfloat16: 310.0})
    chosen, (_, trial) = dtypes.choose(load, "bfloat16", 1.5, WINDOWS, tokens=64)
    assert chosen == "float32" and not trial.chosen
    assert trial.note == "its prefill (310 ms) is not faster than float32's (40 ms) here"


def test_a_dtype_above_the_perplexity_limit_keeps_float32_however_fast(loads, monkeypatch):
    load, _ = loads
    _steps(monkeypatch, {torch.float32: 3.0, torch.bfloat16: 1.0})
    chosen, (_, trial) = dtypes.choose(load, "bfloat16", 0.5, WINDOWS, tokens=64)  # a limit nothing meets
    assert chosen == "float32" and not trial.chosen and trial.note == "ppl ratio above 0.5"



def test_the_timings_are_the_prompts_prefill_and_fulls_real_decode_step_after_it():
    model = load_model(resolve_checkpoint("fixture"), torch.device("cpu"), torch.float32, 512, "native")
    assert all(ms > 0 for ms in dtypes.timings(model, 300, steps=3))
    assert all(ms > 0 for ms in dtypes.timings(model, 300, steps=3))  # the engine and batch were closed: it runs again
