"""What several `edgekv` commands share: the usage error, flag helpers, the KV-folder helpers, the help strings, and
`check_common`, the checks that apply to any command."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

KV_PATHS_HELP = ("folders on several disks, comma-separated, instead of --kv-path: the KV records are spread over "
                 "them and read through one queue per disk")
POLICY_HELP = "the KV policy: a name registered in runtime/policies/ (kvswap, full, flexgen, token, hillinfer, arkv)"
PROMPT_HELP = "plain text, or a JSON list of token ids when it starts with '['"
# whole-number flags (by dest): (least, most or None); argparse only checks that they are numbers
WHOLE_FLAGS = {"max_new_tokens": (1, None), "top_k": (0, None), "chunk_tokens": (1, None), "max_context": (2, None),
               "new_tokens": (1, None), "samples": (1, None), "ppl_tokens": (2, None), "group_size": (1, None),
               "steps": (1, None), "warmup": (0, None), "port": (0, 65535), "max_queue": (1, None),
               "max_connections": (1, None),
               "seed": (0, 2**63 - 1)}  # torch's generator takes 64-bit seeds; numpy's none below 0
# number flags (by dest): (low, high, low allowed, high allowed); NaN and infinities are never meant
REAL_FLAGS = {"temperature": (0, math.inf, True, False), "top_p": (0, 1, False, True), "drop_at": (0, 1, False, False),
              "max_mib": (0, math.inf, False, False), "disk_seconds": (0, math.inf, False, False),
              "path_limit_mib_s": (0, math.inf, False, False), "rate_hz": (0, math.inf, False, False),
              "max_body_mib": (0, math.inf, False, False), "store_max_mib": (0, math.inf, False, False),
              "shutdown_grace_s": (0, math.inf, True, False), "header_timeout_s": (0, math.inf, False, False),
              "body_timeout_s": (0, math.inf, False, False)}
# what each command's memory grows with: named when it runs out

class UsageError(ValueError):
    """A flag's value cannot work; the message names the flag and what to pass instead."""


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def kv_paths(args, must_exist: bool = True) -> list[str] | None:
    """--kv-path DIR or --kv-paths DIR1,DIR2,... (not both) -> the KV folders in order, None when neither is given.

    Checked here, not in the engine, so a bad folder is named as the user typed it (the flag, the path)."""
    from edgekv.install.profile import check_kv_paths

    single, several = getattr(args, "kv_path", None), getattr(args, "kv_paths", None)
    if single is not None and several is not None:
        raise UsageError(f"--kv-path {single} and --kv-paths {several} both name the KV folders; pass one of them "
                         "(--kv-paths DIR1,DIR2,... for several disks)")
    if single is None and several is None:
        return None
    which, given = ("--kv-path", [single]) if single is not None else (
        "--kv-paths", [p.strip() for p in several.split(",")])
    try:
        paths = list(check_kv_paths(given, which))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    missing = [user for user, path in zip(given, paths) if not os.path.isdir(path)]
    if must_exist and missing:
        raise UsageError(f"{which}: no folder {', '.join(missing)}; create it on the disk that should hold the "
                         "KV cache")
    return paths


@contextlib.contextmanager
def scratch_kv(paths: list[str] | None):
    """A temporary KV folder under each of the user's KV folders (the system temp dir without any), removed after."""
    with contextlib.ExitStack() as stack:
        yield [Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgekv-kv-", dir=p)))
               for p in paths or [None]]


def store_location(args) -> str:
    """--store (a folder, file:// or http(s):// URL; other schemes refused), else the store folder under the (first)
    KV path: contexts live on the KV disk beside the running KV."""
    from edgekv.runtime.store import store_location as location

    if args.store:
        return str(location(args.store))
    paths = kv_paths(args, must_exist=False)
    if not paths:
        raise ValueError("which context store? pass --kv-path (the store is KV_PATH/contexts) or --store")
    return str(Path(paths[0]) / "contexts")


def parse_budget(text: str) -> float:
    """--budgets: one fraction of the full KV cache; bad input names the flag (a ValueError the CLI reports)."""
    num, _, den = text.partition("/")
    try:
        value = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        value = float("nan")
    if not 0 < value <= 1:
        raise UsageError(f"--budgets: {text!r} must be a fraction in (0, 1], e.g. 1/13")
    return value


def record_dtypes(text: str) -> list[str]:
    """--record-dtype: the disk record formats to run, exact records ("auto") always first (the rows they are set beside)."""
    from edgekv.runtime.quant import RECORD_DTYPES

    asked = [r for r in text.split(",") if r]
    bad = [r for r in asked if r not in RECORD_DTYPES]
    if bad:
        raise UsageError(f"--record-dtype {text}: {bad} unknown; give a list of {list(RECORD_DTYPES)}, e.g. int8,int4")
    return list(dict.fromkeys(["auto", *asked]))
def read_prompt(flag: str, source: str, from_file: bool):
    """A prompt as text or token ids: ``source`` itself, or the file it names (``-``: standard input) when
    ``from_file``.  Text that starts with '[' is a JSON list of token ids.  Errors name ``flag`` and the file, so a
    bad prompt is refused before the model loads."""
    from edgekv.runtime.config import utf8_text

    where = f"{flag} {source}"
    if from_file:
        path = Path(source)
        if source == "-":
            raw = sys.stdin.buffer.read()
        elif path.is_dir():
            raise UsageError(f"{where} is a folder; pass the prompt's text file")
        elif not path.is_file():
            raise UsageError(f"{where}: no such file; pass a text file (or a JSON list of token ids)")
        else:
            raw = path.read_bytes()
        text = utf8_text(raw, where, "convert it (iconv -t UTF-8) or pass token ids as a JSON list", UsageError)
        if not text.strip():
            raise UsageError(f"{where} is empty; put the prompt's text (or a JSON list of token ids) in it")
    else:
        text = source
    if not text.lstrip().startswith("["):
        return text
    try:
        ids = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where if from_file else flag} starts with '[' but is not a JSON list of token ids ({exc}); "
                         "write token ids as [1, 20, 30]") from exc
    if not isinstance(ids, list):
        raise UsageError(f"{where if from_file else flag} starts with '[' but holds a JSON {type(ids).__name__}, not a "
                         "list of token ids; write token ids as [1, 20, 30]")
    return ids


def cost_model(path: str):
    """--costs: the chunk cost model JSON ``python -m edgekv.install.chunk_profile`` writes, named when unreadable."""
    from edgekv.runtime.ttft.costs import cost_model_from_json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cost_model_from_json(data.get("predictor", data))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"--costs {path}: not a readable cost model ({type(exc).__name__}: {exc}); write one with "
                         "python -m edgekv.install.chunk_profile --json FILE, or drop --costs") from exc


def whole_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag} {text!r}: give whole numbers >= 1, comma-separated, e.g. 4096,16384")
    return values


def real_list(flag: str, text: str, least: float, example: str, least_ok: bool = False) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and (v > least or least_ok and v == least) for v in values):
        raise UsageError(f"{flag} {text!r}: give {example}")
    return values


def names(flag: str, text: str, known, also: str = "") -> list[str]:
    given = text.split(",")
    bad = [n for n in given if n not in known]
    if bad:
        raise UsageError(f"{flag} {text!r}: {bad} unknown; pick from {list(known)}{' ' + also if also else ''}")
    return given


def _check_numbers(args, command) -> None:
    for dest, (least, most) in WHOLE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and not (least <= value and (most is None or value <= most)):
            bound = f">= {least}" if most is None else f"in [{least}, {most}]"
            raise UsageError(f"{flag(dest)} {value}: must be a whole number {bound}")
    for dest, (low, high, low_ok, high_ok) in REAL_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and not (math.isfinite(value) and (low < value or low_ok and value == low)
                                      and (value < high or high_ok and value == high)):
            span = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if high_ok else ')'}"
            raise UsageError(f"{flag(dest)} {value:g}: must be a number in {span}")
    for dest in ("contexts", "batches"):
        if isinstance(getattr(args, dest, None), str):
            whole_list(flag(dest), getattr(args, dest))


def _check_names(args, command) -> None:
    if getattr(args, "budgets", None) is not None:
        for budget in args.budgets.split(","):
            parse_budget(budget)
    if getattr(args, "record_dtype", None) is not None:
        record_dtypes(args.record_dtype)
    if getattr(args, "link_mib_s", None) is not None:
        real_list("--link-mib-s", args.link_mib_s, 0, "positive rates, e.g. 50,100,200,400")
    if getattr(args, "recall_sigmas", None) is not None:
        real_list("--recall-sigmas", args.recall_sigmas, 1, "sigmas >= 1, e.g. 2,4,8,16", least_ok=True)
    if getattr(args, "policies", None) is not None:
        from edgekv.runtime.policies import names as policy_names

        names("--policies", args.policies, getattr(command, "policy_names", policy_names)())
    if getattr(args, "policy", None) is not None:
        from edgekv.runtime.policies import names as policy_names

        names("--policy", args.policy, policy_names())
    if getattr(args, "tasks", None) not in (None, "all"):
        from edgekv.evals.tasks import TASKS

        names("--tasks", args.tasks, TASKS, "or all")


def _check_paths(args, command) -> None:
    if getattr(args, "store", None) is not None:
        from edgekv.runtime.store import store_location as location

        try:
            location(args.store)
        except ValueError as exc:
            raise UsageError(f"--store: {exc}") from exc
    for dest in ("costs", "adapter", "configs_from", "quality_configs", "calibration", "text"):
        value = getattr(args, dest, None)
        if value is not None and not (dest == "text" and value == "builtin") and not Path(value).is_file():
            raise UsageError(f"{flag(dest)} {value}: no such file{' (or builtin)' if dest == 'text' else ''}")
    for dest in ("configs_from", "quality_configs"):
        if getattr(args, dest, None) is not None:
            from edgekv.evals.harness import recorded_configs

            try:
                recorded_configs(getattr(args, dest))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UsageError(f"{flag(dest)} {getattr(args, dest)}: not the JSON of an `edgekv eval --json` run "
                                 f"({type(exc).__name__}: {exc}); pass that file") from exc
    for dest in ("json", "png", "csv", "niah"):  # checked now: a long run must not fail at its last line
        value = getattr(args, dest, None)
        if isinstance(value, str):
            out = Path(value)
            if out.is_dir() or not value.strip():
                raise UsageError(f"{flag(dest)} {value!r}: name a file to write, not a folder")
            if not out.parent.is_dir():
                raise UsageError(f"{flag(dest)} {value}: no folder {out.parent}; create it or write elsewhere")
    folders = getattr(command, "KV_FOLDERS", None)
    if folders is not None:
        kv_paths(args, must_exist=folders == "existing")


_STAGES = {"numbers": _check_numbers, "names": _check_names, "paths": _check_paths}


def add_compute_flags(parser) -> None:
    """--device and --dtype: what a command computes in (default: the deployed config's, else $EDGEKV_DEVICE or
    the GPU, and its dtype: bf16 where the GPU has it natively, else fp16; fp32 on the CPU)."""
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: the deployed config's, else $EDGEKV_DEVICE, "
                                         "else the GPU when there is one)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        help="the model's and the KV's dtype (default: the deployed config's on its device, else "
                             "float32 on the CPU, bfloat16 on a GPU that has it natively, else float16)")


def add_weights_flag(parser, where: str) -> None:
    """--weights: the linear layers' format (runtime/weights.py WEIGHT_FORMATS); ``where``: the command's use of it."""
    from edgekv.runtime.weights import WEIGHT_FORMATS

    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                        help=f"the linear layers' format on the CPU (int8: PyTorch's dynamic int8 linear, float32; "
                             f"int4: 4-bit weight-only in groups of 32 where a layer keeps a GGUF Q4 grid, int8 "
                             f"weight-only elsewhere, float32 or bfloat16; default: the deployed config's, else as "
                             f"loaded; {where})")


def check_common(args, command) -> None:
    """The checks any command's flags get, in the order that decides which error wins when several are bad: the
    "numbers" (whole and real flags, the --contexts/--batches lists), the "names" (budgets, record formats, rates,
    sigmas, policies, tasks), then the "paths" (store, input files, outputs, KV folders).  The command module's own
    ``check`` runs right after the stage its ``CHECK_AFTER`` names ("paths" when it names none); its
    ``policy_names()`` says what --policies may list (default: the registered policies), its ``KV_FOLDERS`` whether
    its KV folders must exist ("existing") or are created ("created")."""
    after = getattr(command, "CHECK_AFTER", "paths")
    for name, stage in _STAGES.items():
        stage(args, command)
        if name == after and hasattr(command, "check"):
            command.check(args)
