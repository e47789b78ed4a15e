"""The install step's weight format (install/weights.py): the first candidate within the perplexity limit of the
model's own weights is chosen; one the device cannot run is named, not chosen; one above the limit is not chosen."""
import torch

from edgekv.install import weights
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.model import load_model

WINDOWS = [[(i * 7 + j) % 250 + 4 for i in range(96)] for j in range(2)]


def _loader(dtype=torch.float32):
    return lambda w: load_model(resolve_checkpoint("fixture"), torch.device("cpu"), dtype, 128, w)


def test_the_first_candidate_within_the_limit_is_chosen_and_every_trial_is_reported():
    load = _loader()
    chosen, trials = weights.choose(load("native"), load, ["int8", "int4"], 100.0, WINDOWS)
    assert chosen == "int8" and [t.chosen for t in trials] == [True, False]
    assert all(t.ppl_ratio > 0 and 0 < t.top1_agreement <= 1 for t in trials)  # the later one is measured too


def test_a_candidate_above_the_limit_is_not_chosen():
    load = _loader()
    chosen, (trial,) = weights.choose(load("native"), load, ["int8"], 0.5, WINDOWS)  # a limit nothing meets
    assert trial.ppl_ratio > 0.5 and chosen == "native" and not trial.chosen and "above 0.5" in trial.note


def test_its_own_weights_are_within_any_limit():
    load = _loader()
    native = load("native")
    chosen, (trial,) = weights.choose(native, lambda w: native, ["int4"], 1.0, WINDOWS)  # the same model: ratio 1
    assert (chosen, trial.ppl_ratio, trial.top1_agreement) == ("int4", 1.0, 1.0)


def test_a_format_this_dtype_cannot_run_is_named_and_not_chosen():
    load = _loader(torch.bfloat16)
    chosen, (trial,) = weights.choose(load("native"), load, ["int8"], 100.0, WINDOWS)
    assert chosen == "native" and trial.ppl_ratio is None and "runs on the CPU in float32" in trial.note
