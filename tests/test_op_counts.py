"""tests/harness/op_counts.py attributes a decode step's torch calls to the edgekv functions that made them."""
from tests.harness.op_counts import count


def test_a_steps_calls_are_counted_by_their_edgekv_caller():
    one, _ = count("fixture", "full", {}, 256, 1)
    two, _ = count("fixture", "full", {}, 256, 2)
    assert one["runtime/model.py qkv"] > 0 and not any(caller.startswith("/") for caller in one)
    assert sum(two.values()) == 2 * sum(one.values())  # every decode step makes the same calls
