"""Platform profiles (``profiles/<platform>.yaml``): data, validated once when loaded.

Every error names the file, the field and what to write instead, so a typo in a profile
never reaches the profilers or the runtime.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from edgekv.runtime.config import utf8_text
from edgekv.runtime.slot_memory import SLOT_MEMORIES
from edgekv.runtime.weights import WEIGHT_FORMATS

from .quality import CORRECTIONS, RECORD_DTYPES

log = logging.getLogger(__name__)

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
DISK_TYPES = ("nvme", "emmc", "ufs", "sata", "smartssd", "unknown")
POWER_METERS = ("auto", "rapl", "ina3221", "jtop", "nvml", "xrt", "none")
SCORERS = ("cpu", "smartssd")
MAX_SOLVER_POINTS = 10_000  # deploy solves every (batch, context) pair: more would take hours or exhaust memory


# the perplexity limits a profile sets: field -> what its ratio is to
PPL_LIMITS = {"solver.record_ppl_max": "exact records", "compute.weights_ppl_max": "the model's own weights",
              "compute.dtype_ppl_max": "float32"}


class ProfileError(ValueError):
    """A profile file is missing, malformed or has a bad field; the message names it."""


# field -> (type, required, allowed values or None); nested sections are dicts of the same
SCHEMA = {
    "platform": (str, True, None),
    "description": (str, False, None),
    "compute": {"device": (str, True, DEVICES), "dtype": (str, True, DTYPES), "weights": (list, False, None),
                "weights_ppl_max": (float, False, None), "dtype_ppl_max": (float, False, None)},
    "kv": {"paths": (list, False, None), "path": (str, False, None), "disk_type": (str, True, DISK_TYPES)},
    "memory": {"max_kv_mem_mib": (float, True, None), "max_batch": (int, True, None), "max_context": (int, True, None),
               "slot_memory": (str, False, SLOT_MEMORIES)},
    "model": (str, True, None),
    "solver": {
        "sigma_max": (float, True, None), "g_max": (int, True, None), "mg_const": (int, True, None),
        "exposed_io_share": (float, False, None), "alpha": (float, False, None), "reuse_step": (float, True, None),
        "context_min": (int, True, None), "context_step": (int, True, None),
        "record_dtypes": (list, False, None), "record_ppl_max": (float, False, None),
        "corrections": (list, False, None), "correction_recall": (float, False, None),
        "guess_from_before": (bool, False, None), "prompt_adapter": (bool, False, None),
    },
    "profiling": {"disk_seconds": (float, True, None), "disk_file_mib": (int, True, None)},
    "power_meter": (str, True, POWER_METERS),
    "scorers": (list, True, None),
    "quality_target": (float, False, None),
    "quality_top1_min": (float, False, None),
    "quality_contexts": (list, False, None),
}


@dataclass(frozen=True)
class Profile:
    """One platform's deployment facts; units are in the names."""

    source: Path
    platform: str
    description: str
    device: str
    dtype: str
    kv_paths: tuple[str, ...]
    disk_type: str
    max_kv_mem_mib: float
    max_batch: int
    max_context: int
    model: str
    sigma_max: float
    g_max: int
    mg_const: int
    exposed_io_share: float  # the share of the I/O time that may stay exposed, not hidden behind compute
    reuse_step: float
    context_min: int
    context_step: int
    disk_seconds: float
    disk_file_mib: int
    power_meter: str
    scorers: tuple[str, ...]
    quality_target: float | None = None  # ppl ratio to full the solver must meet (None: KVSwap's M*G = mg_const)
    quality_top1_min: float | None = None  # top-1 agreement with full the solver must meet beside it (None: any)
    quality_contexts: tuple[int, ...] = ()  # where the quality table is measured (default: max_context)
    record_dtypes: tuple[str, ...] = ()  # disk record formats the solver may pick beside exact ones (measured first)
    record_ppl_max: float = 1.01  # without a quality target: the most loss a record format may cost
    corrections: tuple[str, ...] = ("guess", "corrected")  # selections the quality table measures (runtime 'correction')
    correction_recall: float = 1.0  # a corrected deployment's runtime 'correction_recall' (1: every layer, every step)
    guess_from_before: bool = False  # a corrected deployment's runtime 'guess_from_before'
    prompt_adapter: bool = True  # the adapter trial weighs each sequence's own projection (runtime 'prompt_adapter')
    slot_memory: str | None = None  # on a GPU: device slots fed by copies, or mapped host ones (None: the platform's)
    weights: tuple[str, ...] = ()  # weight formats the install step tries, fastest first (install/weights.py)
    weights_ppl_max: float = 1.01  # the most perplexity a weight format may cost against the model's own weights
    dtype_ppl_max: float = 1.01  # on the CPU: the most perplexity ``dtype`` may cost against float32 (install/dtypes.py)

    @property
    def batch_budget_mib(self) -> float:
        """The per-sequence budget B_max / b_max the solver fits (Appendix A.4)."""
        return self.max_kv_mem_mib / self.max_batch


def profile_path(platform: str, profiles_dir: Path = PROFILES_DIR) -> Path:
    path = Path(profiles_dir) / f"{platform}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in Path(profiles_dir).glob("*.yaml"))
        raise ProfileError(f"no profile for platform {platform!r} ({path} is missing); known platforms: {known}")
    return path


def load_profile(source: str | Path, profiles_dir: Path = PROFILES_DIR) -> Profile:
    """A platform name (``local``) or a YAML path -> a validated Profile."""
    path = Path(source) if str(source).endswith((".yaml", ".yml")) else profile_path(str(source), profiles_dir)
    if path.is_dir():
        raise ProfileError(f"profile {path} is a folder; pass a platform name or a YAML file")
    if not path.is_file():
        raise ProfileError(f"profile file {path} does not exist; pass a platform name or an existing YAML file")
    text = utf8_text(path.read_bytes(), str(path), "save the profile as UTF-8", ProfileError)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML ({exc}); fix the syntax") from exc
    except (ValueError, RecursionError) as exc:  # an integer of more than 4300 digits, nesting deeper than Python's stack
        raise ProfileError(f"{path}: YAML this loader cannot take ({type(exc).__name__}: {str(exc)[:120]}); "
                           "fix the value") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: the top level must be a mapping of fields, got {type(data).__name__}")
    flat = _check(path, data, SCHEMA, "")
    _check_ranges(path, flat)
    return Profile(
        source=path, platform=flat["platform"], description=flat.get("description", ""),
        device=flat["compute.device"], dtype=flat["compute.dtype"],
        kv_paths=flat["kv.paths"], disk_type=flat["kv.disk_type"],
        max_kv_mem_mib=float(flat["memory.max_kv_mem_mib"]), max_batch=flat["memory.max_batch"],
        max_context=flat["memory.max_context"], model=flat["model"],
        sigma_max=float(flat["solver.sigma_max"]), g_max=flat["solver.g_max"], mg_const=flat["solver.mg_const"],
        exposed_io_share=float(flat["solver.exposed_io_share"]), reuse_step=float(flat["solver.reuse_step"]),
        context_min=flat["solver.context_min"], context_step=flat["solver.context_step"],
        disk_seconds=float(flat["profiling.disk_seconds"]), disk_file_mib=flat["profiling.disk_file_mib"],
        power_meter=flat["power_meter"], scorers=tuple(flat["scorers"]),
        quality_target=flat.get("quality_target"),
        quality_top1_min=flat.get("quality_top1_min"),
        quality_contexts=tuple(flat.get("quality_contexts") or [flat["memory.max_context"]]),
        record_dtypes=tuple(flat.get("solver.record_dtypes") or ()),
        record_ppl_max=float(flat.get("solver.record_ppl_max", 1.01)),
        weights=tuple(flat.get("compute.weights") or ()),
        weights_ppl_max=float(flat.get("compute.weights_ppl_max", 1.01)),
        dtype_ppl_max=float(flat.get("compute.dtype_ppl_max", 1.01)),
        corrections=tuple(flat.get("solver.corrections") or ("guess", "corrected")),
        correction_recall=float(flat.get("solver.correction_recall", 1.0)),
        guess_from_before=flat.get("solver.guess_from_before", False),
        prompt_adapter=flat.get("solver.prompt_adapter", True),
        slot_memory=flat.get("memory.slot_memory"),
    )


def _check(path: Path, data: dict, schema: dict, prefix: str) -> dict:
    """Type-check ``data`` against ``schema``; returns the fields flattened as 'section.field'."""
    odd = [k for k in data if not isinstance(k, str)]
    if odd:  # YAML keys may be numbers, booleans or null: `1: x`, `yes: x`, `: x`
        raise ProfileError(f"{path}: key {odd[0]!r} in {prefix.rstrip('.') or 'the top level'} is not a field name; "
                           f"fields here are {sorted(schema)}")
    unknown = sorted(set(data) - set(schema))
    if unknown:
        field = prefix + unknown[0]
        raise ProfileError(f"{path}: unknown field '{field}'; fields here are {sorted(schema)} (check the spelling)")
    flat = {}
    for key, spec in schema.items():
        name = prefix + key
        if isinstance(spec, dict):
            if key not in data:
                raise ProfileError(f"{path}: missing section '{name}' (fields {sorted(spec)}); add it")
            if not isinstance(data[key], dict):
                raise ProfileError(f"{path}: '{name}' must be a mapping with fields {sorted(spec)}")
            flat.update(_check(path, data[key], spec, name + "."))
            continue
        kind, required, allowed = spec
        if key not in data:
            if required:
                raise ProfileError(f"{path}: missing required field '{name}' ({kind.__name__}); add it")
            continue
        value = data[key]
        # YAML's true/false are Python bools, which are ints too: a bool is neither a number nor a count here
        ok = isinstance(value, bool) if kind is bool else (
            not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind))
        if not ok:
            raise ProfileError(f"{path}: field '{name}' must be {kind.__name__}, got {value!r}; write e.g. {_example(kind)}")
        if kind is float and not math.isfinite(value):  # YAML's .nan and .inf pass every comparison check below
            raise ProfileError(f"{path}: field '{name}' must be a finite number, got {value!r}; write e.g. {_example(kind)}")
        if allowed is not None and value not in allowed:
            raise ProfileError(f"{path}: field '{name}' is {value!r}; allowed values: {list(allowed)}")
        flat[name] = value
    return flat


def _check_ranges(path: Path, flat: dict) -> None:
    positive = ("memory.max_kv_mem_mib", "memory.max_batch", "memory.max_context", "solver.g_max", "solver.mg_const",
                "solver.context_min", "solver.context_step", "profiling.disk_seconds", "profiling.disk_file_mib")
    for name in positive:
        if flat[name] <= 0:
            raise ProfileError(f"{path}: field '{name}' must be > 0, got {flat[name]!r}")
    if flat["solver.context_min"] > flat["memory.max_context"]:
        raise ProfileError(f"{path}: field 'solver.context_min' ({flat['solver.context_min']}) is above "
                           f"'memory.max_context' ({flat['memory.max_context']}); lower it")
    contexts = (flat["memory.max_context"] - flat["solver.context_min"]) // flat["solver.context_step"] + 2
    if flat["memory.max_batch"] * contexts > MAX_SOLVER_POINTS:
        raise ProfileError(f"{path}: fields 'memory.max_batch' ({flat['memory.max_batch']}) and 'solver.context_step' "
                           f"({flat['solver.context_step']}) make about {flat['memory.max_batch'] * contexts} (batch, "
                           f"context) points to solve, over {MAX_SOLVER_POINTS}; raise context_step or lower max_batch")
    if flat["solver.sigma_max"] < 1:
        raise ProfileError(f"{path}: field 'solver.sigma_max' must be >= 1 (1 = full-rank K), got {flat['solver.sigma_max']!r}")
    for name in ("solver.exposed_io_share", "solver.alpha", "solver.reuse_step"):
        if name in flat and not 0 <= flat[name] < 1:
            raise ProfileError(f"{path}: field '{name}' must be in [0, 1), got {flat[name]!r}")
    _renamed(path, flat, "solver.alpha", "solver.exposed_io_share")
    if ("kv.paths" in flat) == ("kv.path" in flat):
        raise ProfileError(f"{path}: give the KV folders as 'kv.paths' (a list, e.g. [/mnt/nvme0/kv, /mnt/nvme1/kv]) "
                           "or one as 'kv.path', not both or neither")
    field = "kv.paths" if "kv.paths" in flat else "kv.path"
    flat["kv.paths"] = check_kv_paths(flat.pop(field), f"{path}: field '{field}'")
    target = flat.get("quality_target")
    if target is not None and target < 1:
        raise ProfileError(f"{path}: field 'quality_target' is a perplexity ratio to full (>= 1, e.g. 1.05), got {target!r}")
    top1 = flat.get("quality_top1_min")
    if top1 is not None and not 0 < top1 <= 1:
        raise ProfileError(f"{path}: field 'quality_top1_min' is the share of next tokens that must agree with full's "
                           f"(in (0, 1], e.g. 0.9), got {top1!r}")
    if top1 is not None and target is None:
        raise ProfileError(f"{path}: field 'quality_top1_min' needs 'quality_target' beside it (the solver meets both "
                           "on the quality table); set quality_target (e.g. 1.05) or remove quality_top1_min")
    contexts = flat.get("quality_contexts")
    if contexts is not None and (not contexts or not all(isinstance(c, int) and not isinstance(c, bool)
                                                         and 0 < c <= flat["memory.max_context"] for c in contexts)):
        raise ProfileError(f"{path}: field 'quality_contexts' must list contexts in (0, memory.max_context], "
                           f"e.g. [{flat['memory.max_context']}]; got {contexts!r}")
    records = flat.get("solver.record_dtypes") or []
    if any(r not in RECORD_DTYPES for r in records):
        raise ProfileError(f"{path}: field 'solver.record_dtypes' lists disk record formats beside exact ones, some of "
                           f"{list(RECORD_DTYPES)}; got {records!r}")
    corrections = flat.get("solver.corrections")
    if corrections is not None and (not corrections or any(c not in CORRECTIONS for c in corrections)):
        raise ProfileError(f"{path}: field 'solver.corrections' lists the selections the quality table measures, some "
                           f"of {list(CORRECTIONS)} (guess: the layer-ahead picks; corrected: rescored with the layer's "
                           f"own query); got {corrections!r}")
    if not 0 < flat.get("solver.correction_recall", 1.0) <= 1:
        raise ProfileError(f"{path}: field 'solver.correction_recall' is the share of a layer's corrected picks its "
                           f"guess must hold for the layer to go uncorrected a few steps, in (0, 1] (1: always "
                           f"correct), e.g. 0.85; got {flat['solver.correction_recall']!r}")
    formats = flat.get("compute.weights") or []
    if any(w not in WEIGHT_FORMATS[1:] for w in formats):
        raise ProfileError(f"{path}: field 'compute.weights' lists weight formats the install step tries (fastest "
                           f"first), some of {list(WEIGHT_FORMATS[1:])}; got {formats!r}")
    for field, against in PPL_LIMITS.items():
        if flat.get(field, 1.0) < 1:
            raise ProfileError(f"{path}: field '{field}' is a perplexity ratio to {against} (>= 1, e.g. 1.01), "
                               f"got {flat[field]!r}")
    bad = [s for s in flat["scorers"] if s not in SCORERS]
    if bad or not flat["scorers"]:
        raise ProfileError(f"{path}: field 'scorers' must list some of {list(SCORERS)}, got {flat['scorers']!r}")


def _renamed(path: Path, flat: dict, old: str, new: str) -> None:
    """A field under its old name is taken, with a warning naming the new one; the new name is required."""
    if old in flat:
        if new in flat and flat[new] != flat[old]:
            raise ProfileError(f"{path}: fields '{old}' ({flat[old]!r}) and '{new}' ({flat[new]!r}) are one field under "
                               f"its old and new name; keep '{new}'")
        log.warning("%s: field '%s' is now '%s'; rename it (the old name is still read)", path, old, new)
        flat.setdefault(new, flat.pop(old))
    if new not in flat:
        raise ProfileError(f"{path}: missing required field '{new}' (float); add it")


def check_kv_paths(paths, where: str) -> tuple[str, ...]:
    """The KV folders (``~`` expanded, order kept: the first also holds the context store), or ProfileError
    naming ``where`` (a profile field or a command-line flag).  The same folder twice would count one disk's
    bandwidth twice in the plan, so duplicates are refused; folders need not exist yet (deploy creates them)."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    if not isinstance(paths, (list, tuple)) or not paths:
        raise ProfileError(f"{where} must name at least one folder, e.g. [/mnt/nvme/edgekv]; got {paths!r}")
    paths = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in paths]
    folders = []
    for i, p in enumerate(paths):
        if not isinstance(p, str) or not p.strip() or "\0" in p:  # no file name holds a NUL byte
            raise ProfileError(f"{where} entry {i} must be a folder path, got {p!r}")
        folders.append(os.path.expanduser(p))
        if os.path.exists(folders[-1]) and not os.path.isdir(folders[-1]):
            raise ProfileError(f"{where} entry {i}: {p} exists and is not a folder; name a folder for the KV files")
    real = [os.path.realpath(p) for p in folders]
    for i, r in enumerate(real):
        if r in real[:i]:
            raise ProfileError(f"{where} names one folder twice ({paths[real.index(r)]} and {paths[i]}); "
                               "list each KV folder once")
    return tuple(folders)


def _example(kind) -> str:
    return {str: "a string", int: "4", float: "0.1", list: "[a, b]", bool: "true"}[kind]
