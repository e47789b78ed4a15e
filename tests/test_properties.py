"""Property-based checks of what users hand us: any JSON-shaped config is accepted or refused by name, never
crashes with another exception."""
import math
from dataclasses import fields

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from edgekv.runtime.config import ConfigError, RuntimeConfig  # noqa: E402

FIELDS = [f.name for f in fields(RuntimeConfig)]
EDGES = st.sampled_from([float("nan"), float("inf"), -float("inf"), 0, -1, 0.5, 1, 2**63, "", "auto", True])
JSON_VALUES = EDGES | st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                                   | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3), max_leaves=4)


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS + ["bogus"]), JSON_VALUES, max_size=2))
def test_any_json_config_is_valid_or_refused_naming_a_field(raw):
    try:
        config = RuntimeConfig.load(raw)
    except ConfigError as exc:
        assert any(name in str(exc) for name in list(raw) + FIELDS), str(exc)
        return
    for field in FIELDS:  # json.loads takes NaN and Infinity: a number that passed must be a real one
        value = getattr(config, field)
        assert not isinstance(value, float) or math.isfinite(value), (field, value)
        if field.endswith("_path"):
            assert value is None or isinstance(value, str), (field, value)
    for policy in ("kvswap", "token", "flexgen", "hillinfer", "full", "arkv"):
        effective = config.for_policy(policy)
        assert effective.picked_groups >= 1 and (not effective.reuse or effective.C >= effective.picked_groups)
