"""Runtime configuration: the parameters the install step solves for, validated at the edge.

A config is data: a dict or a JSON file of flat keys (``{"G": 4, "reader_backend": "auto", ...}``, what every
deploy writes), or the same keys nested by section (``{"G": 4, "io": {"reader_backend": "auto"}}``).  In Python
it is the core geometry and budget plus one section per consumer, each section owned by the code that reads
it: ``io`` (the disk store and the KV reader), ``predictor`` (the selector), ``placement`` (several KV paths,
shared prefixes), ``integrity`` (record checksums), ``hillinfer``, ``arkv`` and ``prefill``.  Every field
declares its check beside it (``setting``); a bad value is a ConfigError naming the field, so the engine can
trust what it receives.  A key's name is the same in the file, in its section and in every error.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .quant import QUANT_DTYPES, RECORD_DTYPES
from .reader import READER_BACKENDS
from .choices import CORRECTIONS, KLR_FORMATS, SCORE_REDUCES, SELECTOR_NAMES
from .slot_memory import SLOT_MEMORIES
from .slots import REPLACEMENTS as REPLACEMENT_POLICIES

READER_CHOICES = ("auto", *READER_BACKENDS)
REPLACEMENTS = tuple(REPLACEMENT_POLICIES)


def picked_groups(M: int, G: int, sink_tokens: int, window_tokens: int) -> int:
    """M less the groups that sinks and the window (each rounded up to whole groups) always hold."""
    return M - -(-sink_tokens // G) - -(-window_tokens // G)


class ConfigError(ValueError):
    """A config field is missing, unknown or out of range; the message names it."""


def utf8_text(raw: bytes, where: str, fix: str, error: type[Exception] = ValueError) -> str:
    """``raw`` as UTF-8; otherwise ``error`` naming ``where``, the first bad byte and its offset, and ``fix``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); {fix}") from exc


def cpu_pool_tokens(beta: float, max_context: int) -> int:
    """HillInfer's CPU pool: M_c = beta / (1 + beta) of the context (Eq. 1: M_c / M_s ~ f_cpu / f_ssd)."""
    return max(1, math.ceil(beta / (1 + beta) * max_context))


def read_config_file(source: str | Path) -> dict:
    path = Path(source)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; pass the path of a JSON config (e.g. deploy/<platform>/config.json)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a dict or the path of a JSON config")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid JSON text: {exc}") from exc


# ---- the checks a field declares ----------------------------------------------------------------------------


def _refuse(name: str, wants: str, value) -> ConfigError:
    return ConfigError(f"config field '{name}' must be {wants}, got {value!r:.60}")


def _number(value) -> bool:
    """A number a float holds (an integer of 400 digits does not: the budget arithmetic would overflow)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


class Whole:
    """An integer >= ``least`` (and <= ``most``)."""

    def __init__(self, least: int = 1, most: int | None = None, note: str = ""):
        self.least, self.most, self.note = least, most, note

    def __call__(self, name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < self.least or \
                (self.most is not None and value > self.most):
            wants = (f"in [{self.least}, {self.most}]" if self.most is not None else
                     "a positive integer" if self.least == 1 else f"an integer >= {self.least}")
            raise _refuse(name, wants + self.note, value)


class Real:
    """A finite number in an interval; ``wants`` says it in words."""

    def __init__(self, low: float, high: float = math.inf, low_open: bool = True, high_open: bool = True,
                 wants: str = ""):
        self.low, self.high, self.low_open, self.high_open, self.wants = low, high, low_open, high_open, wants

    def __call__(self, name, value):
        if not _number(value) or not ((self.low < value or not self.low_open and value == self.low)
                                      and (value < self.high or not self.high_open and value == self.high)):
            raise _refuse(name, self.wants, value)


class OneOf:
    """One of the names a registry holds (``choices``: a tuple, or a function giving one)."""

    def __init__(self, choices):
        self.choices = choices

    def __call__(self, name, value):
        choices = tuple(self.choices() if callable(self.choices) else self.choices)
        if not isinstance(value, str) or value not in choices:
            raise _refuse(name, f"one of {choices}", value)


class Flag:
    def __call__(self, name, value):
        if not isinstance(value, bool):
            raise _refuse(name, "true or false", value)


class Text:
    """A string (a path), or null when ``optional``."""

    def __init__(self, optional: bool = True):
        self.optional = optional

    def __call__(self, name, value):
        if not (isinstance(value, str) or (value is None and self.optional)):
            raise _refuse(name, "a string" + (" or null" if self.optional else ""), value)


class PowerOfTwo:
    def __init__(self, least: int):
        self.least = least

    def __call__(self, name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < self.least or value & (value - 1):
            raise _refuse(name, f"a power of two >= {self.least}", value)


class Optional:
    """None, or what ``check`` accepts."""

    def __init__(self, check):
        self.check = check

    def __call__(self, name, value):
        if value is not None:
            self.check(name, value)


def setting(default, check, doc: str = ""):
    """A config field: its default, its check (run by ``RuntimeConfig.validated``) and what it means."""
    return field(default=default, metadata={"check": check, "doc": doc})


class Section:
    """A group of fields one consumer reads; its checks run field by field, then ``check_together``."""

    def check_together(self) -> None:
        """Checks across the section's fields (override)."""

    def validated(self):
        """Every field's own check (a nested section checks its own), then the checks across fields."""
        for f in fields(self):
            value = getattr(self, f.name)
            if "section" in f.metadata:
                if not isinstance(value, SECTIONS[f.name]):
                    raise ConfigError(f"config section '{f.name}' must be a mapping of its fields, got {value!r:.60}")
                value.validated()
                continue
            if isinstance(value, float) and not math.isfinite(value):  # json.loads takes NaN and Infinity
                raise ConfigError(f"config field '{f.name}' must be a finite number, got {value!r}")
            f.metadata["check"](f.name, value)
        self.check_together()
        return self


# ---- the sections, each beside the code that reads it -------------------------------------------------------


@dataclass(frozen=True)
class IOConfig(Section):
    """The disk store and the KV reader (runtime/disk_store.py, runtime/reader.py): how records are read."""

    reader_backend: str = setting("auto", OneOf(READER_CHOICES), "the KV reader: io_uring, a pthread pool, python")
    io_align_bytes: int = setting(4096, PowerOfTwo(512), "records are padded to this (O_DIRECT's alignment)")
    io_queue_depth: int = setting(64, Whole(1), "reads in flight per KV path")
    max_request_bytes: int = setting(262144, Whole(1), "adjacent records of one file are read as one request")
    io_gap_bytes: int = setting(0, Whole(0), "records of one file at most this far apart are read as one request "
                                "too, the gap dropped: what a request more costs in bytes (the install step measures it)")
    read_deadline_s: float = setting(60.0, Real(0, wants="a number of seconds > 0"),
                                     "a read not done by then fails its request (a hung device)")
    kv_record_dtype: str = setting("auto", OneOf(RECORD_DTYPES), "the records' format (runtime/quant.py)")
    slot_memory: str = setting("device", OneOf(SLOT_MEMORIES), "on a GPU, where read records wait for attention: "
                               "device memory, misses copied over (device), or pinned host memory the GPU reads in "
                               "place, no copy (mapped: a unified-memory Jetson); one host memory on the CPU")
    decode_cpu_threads: int | None = setting(None, Optional(Whole(1)), "threads torch computes a CPU decode step "
                                             "with; none: all, but one core left to the KV reads of a disk policy")

    def check_together(self):
        if self.max_request_bytes < self.io_align_bytes:
            raise _refuse("max_request_bytes", f"an integer >= io_align_bytes ({self.io_align_bytes})",
                          self.max_request_bytes)


@dataclass(frozen=True)
class PredictorConfig(Section):
    """The selector (runtime/selector.py): how the next layer's groups are picked."""

    selector: str = setting("lowrank", OneOf(SELECTOR_NAMES),
                            "lowrank (KVSwap's predictor), random (a floor), oracle (a ceiling)")
    score_reduce: str = setting("sum", OneOf(SCORE_REDUCES), "heads' scores: logits summed, or one softmax vote each")
    adapter_path: str | None = setting(None, Text(), "a calibrated low-rank adapter (safetensors)")
    prompt_adapter: bool = setting(False, Flag(), "each sequence predicts through a projection fitted on its own "
                                   "prompt's keys (an SVD a layer as the prompt is stored; a prompt too short for a "
                                   "stable fit takes the shared adapter); its projections count in its memory")
    klr_dtype: str = setting("bfloat16", OneOf(KLR_FORMATS),
                             "K_lr rows' format (int8: half the bytes, int4 a quarter)")
    correction: str = setting("guess", OneOf(CORRECTIONS), "guess: the layer-ahead picks as they are; corrected: "
                              "rescored with the layer's own query, the groups the guess missed read before attention")
    correction_reads: int | None = setting(None, Optional(Whole(1)), "corrected: at most this many extra reads per "
                                           "sequence, layer and step (None: as many as the corrected picks need)")
    correction_overlap: bool = setting(False, Flag(), "corrected: attention over the picks already in memory runs "
                                       "while the correction's reads land, merged with theirs by log-sum-exp (the "
                                       "same attention up to float rounding; off: one attention, bit for bit the "
                                       "oracle's when uncapped)")
    guess_from_before: bool = setting(False, Flag(), "corrected: a layer that corrects every step guesses with its "
                                      "own corrected picks of the step before where those held more of its picks "
                                      "than the layer-ahead prediction did (no scoring a layer ahead, fewer extra "
                                      "reads)")
    correction_recall: float = setting(1.0, Real(0, 1, high_open=False, wants="in (0, 1]"),
                                       "corrected: a layer whose guess held at least this share of its corrected "
                                       "picks goes uncorrected for a few steps, then is measured again (1: every "
                                       "layer corrects every step)")


@dataclass(frozen=True)
class PlacementConfig(Section):
    """Several KV paths and shared prefixes (runtime/cluster.py, runtime/placement.py, runtime/disk_store.py)."""

    clustering: bool = setting(False, Flag(), "lay groups out by co-activation instead of striping them")
    cluster_queries: int = setting(32, Whole(1), "the prompt's last queries whose picks cluster the groups")
    recluster_steps: int = setting(8, Whole(0, note=" (0: never)"), "decode steps before clustering again")
    cluster_radius: float = setting(0.3, Real(0, 1, high_open=False, wants="in (0, 1] (a Jaccard distance)"),
                                    "a cluster's radius (Jaccard distance)")
    replica_share: float = setting(0.05, Real(0, 1, False, False, "in [0, 1]"),
                                   "at most this share of a layer's groups (the hottest) get a second copy")
    share_prefix: bool = setting(True, Flag(), "sequences sharing whole prompt groups read (and write) them once")


@dataclass(frozen=True)
class IntegrityConfig(Section):
    """Record checksums (runtime/checksum.py, the disk store's verified reads)."""

    verify_fraction: float = setting(1.0, Real(0, 1, False, False, "in [0, 1] (1: verify every KV record read, "
                                                                    "0: none)"),
                                     "the share of records read whose checksum is verified")


@dataclass(frozen=True)
class HillInferConfig(Section):
    """The hillinfer policy (runtime/hillinfer.py)."""

    importance_rate: float = setting(0.2, Real(0, 1, high_open=False, wants="in (0, 1]"),
                                     "the share of tokens selected (and kept recent in the CPU pool)")
    beta: float = setting(1.0, Real(0, wants="> 0"), "CPU / storage pool size ratio ~ f_cpu / f_ssd (Eq. 1)")
    score_block_tokens: int = setting(1024, Whole(1, 1024, " (the kernel's block)"), "tokens per in-storage block")


@dataclass(frozen=True)
class ArkvConfig(Section):
    """The arkv policy (runtime/arkv.py) under ``max_kv_mem_mib``."""

    arkv_quant: str = setting("auto", OneOf(("auto", *QUANT_DTYPES)),
                              "the quantized state's format (auto: int8 while a copy of every token fits, else int4)")
    arkv_gamma: float = setting(263.81, Real(0, low_open=False, wants="a number >= 0"),
                                "the weight of attention variance in a token's score (Eq. 9; the paper's tuned value)")
    arkv_window_tokens: int = setting(32, Whole(1, note=""),
                                      "the observation window of prompt queries, and the newest tokens kept original")
    arkv_slack: float = setting(0.75, Real(0, 1, wants="in (0, 1) (the paper uses 0.75)"),
                                "the share of the cache a tailor keeps (the rest fills between tailors)")


@dataclass(frozen=True)
class PrefillConfig(Section):
    """Prefill with a stored context (runtime/ttft/)."""

    ttft_costs_path: str | None = setting(None, Text(), "the install step's chunk compute predictor (JSON)")


SECTIONS = {"io": IOConfig, "predictor": PredictorConfig, "placement": PlacementConfig, "integrity": IntegrityConfig,
            "hillinfer": HillInferConfig, "arkv": ArkvConfig, "prefill": PrefillConfig}


def _section(name: str):
    return field(default_factory=SECTIONS[name], metadata={"section": True})


@dataclass(frozen=True)
class RuntimeConfig(Section):
    """The core geometry and budget every policy shares, and one section per consumer; units are in the names.

    ``G`` tokens per group (one disk record), ``M`` groups attended per layer and step (sinks and window
    included), ``sigma`` K compression ratio (H_kv*d / rank), ``C`` reuse-buffer slots per layer
    (``replacement``: fifo as KVSwap, lru, or cost as Swarm).  ``max_kv_mem_mib`` is the KV memory budget for ``max_batch`` sequences of ``max_context`` tokens
    (None: no limit, resident bytes are still reported).  ``sink_tokens`` S (the first tokens) and
    ``window_tokens`` W (the newest) are always attended and held in memory, rounded up to whole groups; they
    count in M, so the predictor picks ``picked_groups`` = M - ceil(S/G) - ceil(W/G) groups among the rest.
    """

    G: int = setting(4, Whole(1), "tokens per group: one disk record")
    M: int = setting(100, Whole(1), "groups attended per layer and step, sinks and window included")
    sigma: float | None = setting(8.0, Optional(Real(1, low_open=False, wants="a number >= 1")),
                                  "K compression ratio H_kv*d / rank (None: the adapter file's)")
    C: int = setting(200, Whole(1), "reuse-buffer slots per layer")
    max_kv_mem_mib: float | None = setting(None, Optional(Real(0, wants="a positive number")),
                                           "the KV memory budget of max_batch sequences")
    max_batch: int = setting(4, Whole(1), "sequences per batch")
    max_context: int = setting(32768, Whole(1), "tokens per sequence, prompt and generated")
    reuse: bool = setting(True, Flag(), "keep a reuse buffer of C slots per layer")
    rolling_buffer: bool = setting(True, Flag(), "attend to the group being filled from memory")
    sink_tokens: int = setting(0, Whole(0), "the first tokens, always attended")
    window_tokens: int = setting(0, Whole(0), "the newest tokens, always attended")
    replacement: str = setting("fifo", OneOf(REPLACEMENTS), "which resident a miss evicts from the reuse buffer")
    io: IOConfig = _section("io")
    predictor: PredictorConfig = _section("predictor")
    placement: PlacementConfig = _section("placement")
    integrity: IntegrityConfig = _section("integrity")
    hillinfer: HillInferConfig = _section("hillinfer")
    arkv: ArkvConfig = _section("arkv")
    prefill: PrefillConfig = _section("prefill")

    # ---- data in and out ------------------------------------------------------------------------------------

    @classmethod
    def keys(cls) -> list[str]:
        """Every key a config file may hold (flat: the core's and every section's)."""
        return [f.name for f in fields(cls) if "section" not in f.metadata] + \
            [f.name for section in SECTIONS.values() for f in fields(section)]

    @classmethod
    def defaults(cls) -> dict:
        return cls().to_dict()

    @classmethod
    def load(cls, source: "RuntimeConfig | dict | str | Path | None") -> "RuntimeConfig":
        """Build a config from a dict (flat or nested by section), a JSON file path, an existing config or None."""
        if source is None:
            return cls().validated()
        if isinstance(source, RuntimeConfig):
            return source.validated()
        if isinstance(source, (str, Path)):
            source = read_config_file(source)
        if not isinstance(source, dict):
            raise ConfigError(f"config must be a dict or a JSON path, got {type(source).__name__}")
        return cls.from_flat(_flatten(source)).validated()

    @classmethod
    def from_flat(cls, flat: dict) -> "RuntimeConfig":
        """A config from flat keys, unchecked (``validated`` checks it); an unknown key is refused by name."""
        known = cls.keys()
        unknown = sorted(set(flat) - set(known))
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        sections = {name: kind(**{f.name: flat[f.name] for f in fields(kind) if f.name in flat})
                    for name, kind in SECTIONS.items()}
        core = {f.name: flat[f.name] for f in fields(cls) if "section" not in f.metadata and f.name in flat}
        return cls(**core, **sections)

    def to_dict(self) -> dict:
        """Flat keys, as config files hold them."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if "section" not in f.metadata}
        for name in SECTIONS:
            section = getattr(self, name)
            out.update({f.name: getattr(section, f.name) for f in fields(section)})
        return out

    def with_fields(self, **flat) -> "RuntimeConfig":
        """A copy with flat keys changed, whatever section each lives in (unchecked, like ``replace``)."""
        return RuntimeConfig.from_flat({**self.to_dict(), **flat})

    # ---- checks ---------------------------------------------------------------------------------------------

    def check_together(self) -> None:
        if self.sigma is None and self.predictor.adapter_path is None:
            raise ConfigError("config field 'sigma' is required when no 'adapter_path' is given")
        if self.picked_groups < 1:
            raise ConfigError(
                f"config fields 'sink_tokens' ({self.sink_tokens}) and 'window_tokens' ({self.window_tokens}) take "
                f"{self.sink_groups + self.window_groups} groups of G={self.G}, leaving none of 'M' ({self.M}) for the "
                "predictor; raise M or lower them"
            )
        if self.reuse and self.C < self.picked_groups:
            raise ConfigError(
                f"config field 'C' ({self.C}) must be >= the groups picked per step ({self.picked_groups}: 'M' less the "
                "sink and window groups): one step's picks must fit the reuse buffer together; raise C or set reuse=false"
            )

    # ---- derived ----------------------------------------------------------------------------------------------

    @property
    def sink_groups(self) -> int:
        return -(-self.sink_tokens // self.G)

    @property
    def window_groups(self) -> int:
        return -(-self.window_tokens // self.G)

    @property
    def picked_groups(self) -> int:
        """Groups the predictor chooses per layer and step: M less the always-attended sink and window groups."""
        return picked_groups(self.M, self.G, self.sink_tokens, self.window_tokens)

    @property
    def correction_slots(self) -> int:
        """Extra reads a correction may make per sequence, layer and step (0: guess only)."""
        if self.predictor.correction == "guess":
            return 0
        return min(self.picked_groups, self.predictor.correction_reads or self.picked_groups)

    @property
    def max_groups(self) -> int:
        """Groups ``max_context`` tokens have."""
        return -(-self.max_context // self.G)

    def within_context(self) -> "RuntimeConfig":
        """M and C capped at the groups ``max_context`` tokens have: picks or slots beyond them would be memory
        allocated (and counted against the budget) that nothing can fill."""
        fixed = self.sink_groups + self.window_groups
        picked = min(self.picked_groups, max(1, self.max_groups - fixed))
        C = min(self.C, max(picked, self.max_groups))
        if (picked + fixed, C) == (self.M, self.C):
            return self
        return replace(self, M=picked + fixed, C=C)


def _flatten(source: dict) -> dict:
    """Flat keys from a dict whose sections may be nested (``{"io": {"reader_backend": ...}}``); a key given both
    flat and in its section is refused by name."""
    flat = {k: v for k, v in source.items() if k not in SECTIONS}
    for name in SECTIONS:
        if name not in source:
            continue
        nested = source[name]
        if not isinstance(nested, dict):
            raise ConfigError(f"config section '{name}' must be a mapping of its fields, got {nested!r:.60}")
        own = {f.name for f in fields(SECTIONS[name])}
        stray = sorted(set(nested) - own)
        if stray:
            raise ConfigError(f"config section '{name}' has no field(s) {stray}; its fields: {sorted(own)}")
        twice = sorted(set(nested) & set(flat))
        if twice:
            raise ConfigError(f"config field(s) {twice} given both flat and in section '{name}'; give each once")
        flat.update(nested)
    return flat

