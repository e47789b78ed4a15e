"""The task generator: deterministic for a seed, and every answer recoverable from its context."""
import numpy as np
import pytest

from edgekv.evals.tasks import KEYS, QUERY, TASKS, make_instance, make_set


def solve(inst):
    """An exact solver that only reads the context: the token after each queried key's needle."""
    following = {}
    for start, length in inst.needles:
        tokens = inst.context[start : start + length]
        for a, b in zip(tokens, tokens[1:]):
            assert a not in following, "a key or chained value must occur once per context"
            following[a] = b
    stream = inst.forced
    return [following[stream[i - 1]] for i in inst.answer_at]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("context", [64, 500, 4096])
def test_answers_are_recoverable_from_the_context(task, context):
    rng = np.random.default_rng(3)
    for _ in range(5):
        inst = make_instance(task, context, rng)
        assert len(inst.context) == context
        assert solve(inst) == inst.answers
        assert inst.score([0] * (max(inst.answer_at) + 1)) is False
        predictions = [0] * (max(inst.answer_at) + 1)
        for i, a in zip(inst.answer_at, inst.answers):
            predictions[i] = a
        assert inst.score(predictions)


def test_same_seed_same_instances_and_seeds_differ():
    a = make_set(TASKS, 256, 3, seed=11)
    b = make_set(TASKS, 256, 3, seed=11)
    c = make_set(TASKS, 256, 3, seed=12)
    assert [(i.context, i.forced, i.answers) for i in a] == [(i.context, i.forced, i.answers) for i in b]
    assert [i.context for i in a] != [i.context for i in c]


def test_depth_pins_the_first_needle():
    rng = np.random.default_rng(0)
    for depth in (0.0, 0.5, 1.0):
        inst = make_instance("single_needle", 1000, rng, depth=depth)
        assert abs(inst.depth - depth) < 0.01
        start, _ = inst.needles[0]
        assert inst.context[start] in KEYS and inst.forced[:2] == [QUERY, inst.context[start]]


def test_training_sequence_labels_are_the_answers():
    inst = make_instance("multiquery", 128, np.random.default_rng(1))
    tokens, label_pos = inst.training_sequence()
    assert [tokens[p + 1] for p in label_pos] == inst.answers
