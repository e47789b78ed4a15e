"""Property-based checks of what users hand us (a runtime config, a platform profile, a deployed config's
solutions, the command line): any input is accepted or refused by name, never crashes with another exception."""
import argparse
import copy
import math

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from edgekv.cli import UsageError, build_parser, parse_args  # noqa: E402
from edgekv.install.profile import PROFILES_DIR, SCHEMA, Profile, ProfileError, load_profile  # noqa: E402
from edgekv.runtime import policies  # noqa: E402
from edgekv.runtime.config import ConfigError, RuntimeConfig  # noqa: E402
from edgekv.runtime.solutions import SolutionTable, load_deployed  # noqa: E402

FIELDS = RuntimeConfig.keys()  # every flat key a config file may hold
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
    flat = config.to_dict()
    for field in FIELDS:  # json.loads takes NaN and Infinity: a number that passed must be a real one
        value = flat[field]
        assert not isinstance(value, float) or math.isfinite(value), (field, value)
        if field.endswith("_path"):
            assert value is None or isinstance(value, str), (field, value)
    for spec in policies.specs():
        effective = spec.effective_config(config)
        assert effective.picked_groups >= 1 and (not effective.reuse or effective.C >= effective.picked_groups)


# ---- the platform profile loader (install/profile.py) --------------------------------------------------------

BASE_PROFILE = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
PROFILE_FIELDS = [(k,) for k in SCHEMA] + [(k, f) for k, v in SCHEMA.items() if isinstance(v, dict) for f in v]
PROFILE_WORDS = [k for k in SCHEMA] + [f for v in SCHEMA.values() if isinstance(v, dict) for f in v]
YAML_VALUES = (EDGES | st.sampled_from([None, [], {}, "\x00", "~", [1, "a"], [None], [[1]], {"a": 1}, 10**40, -0.0])
               | st.integers() | st.floats() | st.text(max_size=5)
               | st.lists(st.integers() | st.text(max_size=3), max_size=3))
YAML_KEYS = st.sampled_from(["x", 1, None, True, 1.5, ""]) | st.text(max_size=4)


def _mutated(mutations) -> dict:
    data = copy.deepcopy(BASE_PROFILE)
    for path, op, value, key in mutations:
        parent = data
        for part in path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict):
            continue
        if op == "set":
            parent[path[-1]] = value
        elif op == "del":
            parent.pop(path[-1], None)
        else:  # a key beside the field, or inside its section
            (parent[path[-1]] if isinstance(parent.get(path[-1]), dict) else parent)[key] = value
    return data


def _check_profile_outcome(path, load):
    try:
        profile = load()
    except ProfileError as exc:
        message = str(exc)
        assert str(path) in message, message
        assert any(w in message for w in PROFILE_WORDS + ["YAML", "UTF-8", "top level", "key "]), message
        return
    assert isinstance(profile, Profile)
    for name, value in vars(profile).items():  # YAML's .nan and .inf pass comparisons: a number that passed is real
        assert not isinstance(value, float) or math.isfinite(value), (name, value)
    assert profile.kv_paths and profile.context_min <= profile.max_context


@settings(max_examples=600, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PROFILE_FIELDS), st.sampled_from(["set", "del", "add"]), YAML_VALUES, YAML_KEYS),
                min_size=1, max_size=3))
def test_any_profile_edit_is_loaded_or_refused_naming_file_and_field(tmp_path_factory, mutations):
    """Fields set to odd values, deleted, or joined by odd keys (numbers, null, booleans: YAML allows them)."""
    path = tmp_path_factory.getbasetemp() / "edited.yaml"
    path.write_text(yaml.safe_dump(_mutated(mutations)))
    _check_profile_outcome(path, lambda: load_profile(path))


@settings(max_examples=800, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode)
       | st.binary(max_size=40).map(lambda tail: (PROFILES_DIR / "local.yaml").read_bytes() + tail))
def test_any_profile_bytes_are_loaded_or_refused_naming_the_file(tmp_path_factory, raw):
    path = tmp_path_factory.getbasetemp() / "raw.yaml"
    path.write_bytes(raw)
    _check_profile_outcome(path, lambda: load_profile(path))


# ---- the deployed config's solutions (runtime/solutions.py) ---------------------------------------------------

SOLUTION_VALUES = st.sampled_from([float("nan"), float("inf"), 0, -1, 0.5, 1, 2, 4, 16, 2**63, 10**400, "", "x", True,
                                   None, [], {}, [1], {"a": 1}]) | st.integers(-5, 10**6)
GOOD_ROW = st.fixed_dictionaries({"batch": st.integers(1, 4), "context": st.integers(1, 4096),
                                  "G": st.sampled_from([1, 4, 16]), "M": st.integers(8, 200), "C": st.integers(200, 400),
                                  "sigma": st.sampled_from([1.0, 8.0, None])})
ODD_ROW = st.dictionaries(st.sampled_from(["batch", "context", "G", "M", "C", "sigma", "reuse", "kv_record_dtype", "bogus"]),
                          SOLUTION_VALUES, max_size=8)
SOLUTION_WORDS = FIELDS + ["solutions", "batch", "context", "config"]


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.sampled_from(["max_batch", "max_context", "max_kv_mem_mib", "G", "M", "platform", "bogus"]),
                       SOLUTION_VALUES, max_size=3),
       st.lists(GOOD_ROW | ODD_ROW | SOLUTION_VALUES, max_size=4) | SOLUTION_VALUES,
       st.integers(1, 4), st.integers(1, 8192))
def test_any_solutions_are_loaded_or_refused_and_every_request_gets_a_covering_row(top, rows, batch, context):
    """A loaded table answers every request max_batch/max_context allow with a row that holds it: the nearest
    row by distance once held fewer tokens than the prompt (a RuntimeError deep in the KV policy)."""
    try:
        base, table = load_deployed({**top, "solutions": rows})
    except ConfigError as exc:
        assert any(word in str(exc) for word in SOLUTION_WORDS), str(exc)
        return
    assert isinstance(table, SolutionTable)
    b, s = min(batch, base.max_batch), min(context, base.max_context)
    cfg = table.pick(b, s)
    assert cfg.max_batch >= b and cfg.max_context >= s, (b, s, cfg.max_batch, cfg.max_context)
    beyond = table.pick(base.max_batch + batch, base.max_context + context)  # past every row: the largest
    assert beyond.max_context >= base.max_context


# ---- the command line (edgekv/cli.py), parsing and checks only: no model is loaded ---------------------------

CLI_ODD = st.sampled_from(["", " ", "-1", "0", "1", "2", "nan", "NaN", "inf", "-inf", "1e400", "1.5", "9" * 30,
                           "abc", "1/0", "1/13", ",", "4096,", ",4096", "1,2,3", "all", "full,kvswap", "kvswap,bogus",
                           "int8", "builtin", "[1, 2", "[1.5]", "[]", "[1, 20, 30]", "{}", "-", "~"]) | st.text(
    st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=6)
CLI_PATHS = ["missing.txt", "folder", "empty.txt", "latin1.txt", "ids.json", "text.txt", "folder/../missing/x.json"]


def _subcommand_flags():
    """{command words: [(flag, takes a value)]} from the parser itself, so a new flag is fuzzed too."""
    out = {}

    def walk(parser, words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            for name, sub in action.choices.items():
                walk(sub, words + (name,))
        if words and not subs and len(parser._actions) > 1:  # build-native takes no flags
            out[words] = [(a.option_strings[-1], a.nargs != 0) for a in parser._actions
                          if a.option_strings and a.option_strings[-1] not in ("--help", "-h")]

    walk(build_parser(), ())
    return out


SUBCOMMANDS = _subcommand_flags()
REQUIRED = {("generate",): ["--model", "fixture"], ("context", "save"): ["--model", "fixture"]}


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "folder").mkdir()
    (root / "empty.txt").write_bytes(b"")
    (root / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (root / "ids.json").write_text("[1, 20, 30]")
    (root / "text.txt").write_text("some text")
    return root


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(SUBCOMMANDS)), st.data())
def test_any_argv_is_accepted_or_refused_naming_a_flag(cli_files, capsys, command, data):
    """Negative, NaN, huge and empty values, odd lists, missing files, folders where files belong, non-UTF-8 and
    empty prompt files, for 1-4 flags of one command at a time."""
    flags = SUBCOMMANDS[command]
    chosen = data.draw(st.lists(st.sampled_from(flags), max_size=4, unique=True))
    argv = list(command) + REQUIRED.get(command, [])
    if command == ("context", "save"):
        argv += ["name", str(cli_files / data.draw(st.sampled_from(CLI_PATHS)))]
    for flag, takes_value in chosen:
        if not takes_value:
            argv.append(flag)
            continue
        value = data.draw(CLI_ODD | st.sampled_from(CLI_PATHS).map(lambda p: str(cli_files / p)))
        if flag == "--prompt-file" and value == "-":  # standard input is pytest's here
            value = str(cli_files / "ids.json")
        argv.append(f"{flag}={value}")  # --flag=VALUE: a value starting with '-' stays a value
    known = [f for f, _ in flags] + ["FILE", "--prompt"]
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: a value it cannot parse, a choice it does not offer
        err = capsys.readouterr().err
        assert exc.code == 2 and ("argument --" in err or "arguments are required" in err), err
        return
    except UsageError as exc:
        assert any(flag in str(exc) for flag in known), str(exc)
        return
    for name, value in vars(args).items():
        assert not isinstance(value, float) or math.isfinite(value), (name, value)
    for prompt in getattr(args, "prompt", None) or []:
        assert isinstance(prompt, (str, list)), prompt
