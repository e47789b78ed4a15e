"""Batch invariance at temperature 0: a request's greedy tokens are the same whatever else is in its batch, and
whenever other rows join, finish or are cancelled (bench/batch_invariance.py's trials, a server's continuous
batching without the HTTP side).

The fixed request's prompt is longer than M groups, so its picks are a real selection; the rows beside it are
shorter and longer, so the batch's longest row changes as they come and go (a selection that scored over the
longest row's tokens, or read a freed row's stale keys, changed the fixed request's picks)."""
import random

import pytest

from bench.batch_invariance import first_difference, measure, run_trial
from edgekv.runtime import Engine

# the deployed local configuration's switches on the fixture's scale: a softmax vote over int4 K_lr, int4 records,
# corrected picks guessed from the step before, a layer whose guess holds up probed now and then, each prompt's own
# projection
DEPLOYED_LIKE = {"G": 4, "M": 8, "C": 14, "sigma": 2, "max_context": 256, "max_batch": 4, "score_reduce": "softmax",
                 "klr_dtype": "int4", "kv_record_dtype": "int4", "correction": "corrected", "correction_reads": 3,
                 "correction_recall": 0.85, "guess_from_before": True, "prompt_adapter": True}
KVSWAP_DEFAULTS = {"G": 4, "M": 6, "C": 12, "sigma": 2, "max_context": 256, "max_batch": 4, "sink_tokens": 4,
                   "window_tokens": 8}


@pytest.mark.parametrize("config,trials,backend", [(DEPLOYED_LIKE, 200, None), (KVSWAP_DEFAULTS, 40, None),
                                                   (DEPLOYED_LIKE, 40, "torch"),
                                                   ({**DEPLOYED_LIKE, "correction_overlap": True}, 40, None)],
                         ids=["deployed", "defaults", "deployed-torch", "correction-overlap"])
def test_a_greedy_requests_tokens_are_the_same_beside_any_joins_finishes_and_cancels(model_dirs, kv_path, config,
                                                                                     trials, backend):
    """On the CPU's native kernels (what serves) and on the torch reference (a GPU's path)."""
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu",
                                backend=backend) as engine:
        report = measure(engine, trials, rows=4, context=200, fixed_tokens=70, new_tokens=12, others_tokens=150,
                         progress=False)
    assert report["changed_trials"] == 0, report["changed"][:5]
    assert report["changed_logits_trials"] == 0  # the logits the tokens come from, bit for bit


def test_the_trials_can_tell_a_changed_request(model_dirs, kv_path):
    """The check can fail: a request whose rows beside it change its inputs (here: its prompt's last token) is
    told apart at the token where it first differs."""
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=KVSWAP_DEFAULTS, device="cpu") as engine:
        engine.pin_adapter()
        fixed = list(range(5, 75))
        alone = run_trial(engine, 4, 200, fixed, 12, None, 150)
        beside = run_trial(engine, 4, 200, fixed[:-1] + [fixed[-1] + 1], 12, random.Random(1), 150)
    assert len(alone.tokens) == len(beside.tokens) == 12 and beside.joins > 0 and beside.leaves > 0
    assert first_difference(beside.tokens, alone.tokens) is not None
    assert first_difference(alone.tokens, alone.tokens) is None
