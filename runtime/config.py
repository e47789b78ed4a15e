"""Runtime configuration: the parameters the install step solves for, validated at the edge.

A config is data (a dict or a JSON file).  Every field is checked here once, with an
error that names the field, so the engine can trust what it receives.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .quant import QUANT_DTYPES, RECORD_DTYPES

READER_BACKENDS = ("auto", "io_uring", "pthread", "python")
SELECTORS = ("lowrank", "random", "oracle")
SCORE_REDUCES = ("sum", "softmax")
KLR_DTYPES = ("bfloat16", "float16", "float32", "int8")
REPLACEMENTS = ("fifo", "lru", "cost")
BOOL_FIELDS = ("reuse", "rolling_buffer", "clustering", "share_prefix")


def picked_groups(M: int, G: int, sink_tokens: int, window_tokens: int) -> int:
    """M less the groups that sinks and the window (each rounded up to whole groups) always hold."""
    return M - -(-sink_tokens // G) - -(-window_tokens // G)


class ConfigError(ValueError):
    """A config field is missing, unknown or out of range; the message names it."""


def _finite_positive(value) -> bool:
    """A number a float holds (an integer of 400 digits does not: the budget arithmetic would overflow), above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:
        return False


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


@dataclass(frozen=True)
class RuntimeConfig:
    """What the runtime needs to know; units are in the names.

    ``G`` tokens per group (one disk record), ``M`` groups selected per layer and step,
    ``sigma`` K compression ratio (H_kv*d / rank), ``C`` reuse-buffer slots per layer.
    ``max_kv_mem_mib`` is the KV memory budget for ``max_batch`` sequences of
    ``max_context`` tokens (None: no limit, resident bytes are still reported).
    ``selector`` "random" replaces the predictor by uniform picks (a quality floor for ablations);
    "oracle" scores with the layer's own query at attention time instead of predicting it a layer
    ahead (a quality ceiling: with sigma=1 and score_reduce "softmax" it is top-k by true attention).
    ``sink_tokens`` S (the first tokens) and ``window_tokens`` W (the newest) are always attended
    and held in memory, rounded up to whole groups; they count in M, so the predictor picks
    ``picked_groups`` = M - ceil(S/G) - ceil(W/G) groups among the rest (attention sinks and a
    local window: what a sparse selection must never drop).
    ``kv_record_dtype`` the disk records' format (runtime/quant.py): "auto" the model's dtype (exact),
    "fp16", or "int8"/"int4" codes with float16 scales: smaller reads and reuse slots for a measured
    loss; the sinks, the window and a context store keep model precision.
    ``arkv_*``: the arkv policy (runtime/arkv.py) under ``max_kv_mem_mib``: ``arkv_quant`` the quantized
    state's format ("auto": int8 while a copy of every token fits in it, else int4), ``arkv_gamma`` the weight of attention variance in a token's score (Eq. 9),
    ``arkv_window_tokens`` W, both the observation window of prompt queries and the newest tokens always
    kept original, ``arkv_slack`` alpha, the share of the cache a tailor keeps (the rest fills between tailors).
    Several KV paths (Swarm; runtime/cluster.py, runtime/placement.py): ``clustering`` places each layer's groups
    by co-activation (the picks of the prompt's last ``cluster_queries`` queries; Jaccard distance, clusters of
    radius ``cluster_radius``) instead of striping them in token order; at most ``replica_share`` of a layer's
    groups (the hottest) get a second copy on another path.  After ``recluster_steps`` decode steps (0: never)
    each layer's picked groups are clustered again on the decode steps' own picks and written once more in
    that order (what later steps repeat is what decoding picked, not what the prompt's window did).  ``replacement`` the reuse buffer's policy: "fifo"
    (KVSwap), "lru", or "cost" (Swarm's cost-aware: activation frequency times the cost of reading again).
    Adjacent records of one file are read as one request of at most ``max_request_bytes``.  ``share_prefix``:
    sequences of a batch whose prompts share whole groups read (and write) those groups once.
    ``verify_fraction`` the share of KV records read whose checksum is verified (runtime/checksum.py): 1 every
    one, 0 none (both logged when below 1); a record that fails twice is never attended.  A KV read not done
    within ``read_deadline_s`` fails its request (a hung device) instead of blocking it for good.
    """

    G: int = 4
    M: int = 100
    sigma: float | None = 8.0
    C: int = 200
    max_kv_mem_mib: float | None = None
    max_batch: int = 4
    max_context: int = 32768
    reuse: bool = True
    rolling_buffer: bool = True
    sink_tokens: int = 0
    window_tokens: int = 0
    selector: str = "lowrank"
    score_reduce: str = "sum"
    adapter_path: str | None = None
    klr_dtype: str = "bfloat16"
    reader_backend: str = "auto"
    io_align_bytes: int = 4096
    io_queue_depth: int = 64
    kv_record_dtype: str = "auto"
    importance_rate: float = 0.2  # hillinfer alpha: the share of tokens selected (and kept recent in the CPU pool)
    beta: float = 1.0  # hillinfer: CPU / storage pool size ratio, ~ f_cpu / f_ssd (HillInfer Eq. 1)
    score_block_tokens: int = 1024  # hillinfer: tokens per in-storage score block
    arkv_quant: str = "auto"
    arkv_gamma: float = 263.81  # the paper's tuned gamma
    arkv_window_tokens: int = 32
    arkv_slack: float = 0.75
    ttft_costs_path: str | None = None  # the install step's chunk compute predictor (JSON) for load-or-compute plans
    clustering: bool = False
    cluster_queries: int = 32
    recluster_steps: int = 8
    cluster_radius: float = 0.3
    replica_share: float = 0.05
    replacement: str = "fifo"
    max_request_bytes: int = 262144
    share_prefix: bool = True
    verify_fraction: float = 1.0
    read_deadline_s: float = 60.0

    @classmethod
    def load(cls, source: "RuntimeConfig | dict | str | Path | None") -> "RuntimeConfig":
        """Build a config from a dict, a JSON file path, an existing config or None (defaults)."""
        if source is None:
            return cls().validated()
        if isinstance(source, RuntimeConfig):
            return source.validated()
        if isinstance(source, (str, Path)):
            source = read_config_file(source)
        if not isinstance(source, dict):
            raise ConfigError(f"config must be a dict or a JSON path, got {type(source).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(source) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**source).validated()

    def validated(self) -> "RuntimeConfig":
        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")

        for f in fields(self):  # json.loads takes NaN and Infinity; no field means anything by them
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"config field '{f.name}' must be a finite number, got {value!r}")
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field '{name}' must be true or false, got {getattr(self, name)!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("str", "str | None") and not (isinstance(value, str) or (value is None and "None" in f.type)):
                raise ConfigError(f"config field '{f.name}' must be a string{' or null' if 'None' in f.type else ''}, "
                                  f"got {value!r}")
        for name in ("G", "M", "C", "max_batch", "max_context", "io_queue_depth"):
            positive_int(name)
        if self.sigma is None and self.adapter_path is None:
            raise ConfigError("config field 'sigma' is required when no 'adapter_path' is given")
        if self.sigma is not None and (not isinstance(self.sigma, (int, float)) or self.sigma < 1):
            raise ConfigError(f"config field 'sigma' must be a number >= 1, got {self.sigma!r}")
        if self.max_kv_mem_mib is not None and not _finite_positive(self.max_kv_mem_mib):
            raise ConfigError(f"config field 'max_kv_mem_mib' must be a positive number, got {self.max_kv_mem_mib!r:.60}")
        for name in ("sink_tokens", "window_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"config field '{name}' must be an integer >= 0, got {value!r}")
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
        if self.reader_backend not in READER_BACKENDS:
            raise ConfigError(f"config field 'reader_backend' must be one of {READER_BACKENDS}, got {self.reader_backend!r}")
        if self.kv_record_dtype not in RECORD_DTYPES:
            raise ConfigError(f"config field 'kv_record_dtype' must be one of {RECORD_DTYPES}, got {self.kv_record_dtype!r}")
        if self.selector not in SELECTORS:
            raise ConfigError(f"config field 'selector' must be one of {SELECTORS}, got {self.selector!r}")
        if self.score_reduce not in SCORE_REDUCES:
            raise ConfigError(f"config field 'score_reduce' must be one of {SCORE_REDUCES}, got {self.score_reduce!r}")
        if self.klr_dtype not in KLR_DTYPES:
            raise ConfigError(f"config field 'klr_dtype' must be one of {KLR_DTYPES}, got {self.klr_dtype!r}")
        if not (isinstance(self.importance_rate, (int, float)) and 0 < self.importance_rate <= 1):
            raise ConfigError(f"config field 'importance_rate' must be in (0, 1], got {self.importance_rate!r}")
        if not (isinstance(self.beta, (int, float)) and self.beta > 0):
            raise ConfigError(f"config field 'beta' must be > 0, got {self.beta!r}")
        if not (isinstance(self.score_block_tokens, int) and 1 <= self.score_block_tokens <= 1024):
            raise ConfigError(f"config field 'score_block_tokens' must be in [1, 1024] (the kernel's block), got {self.score_block_tokens!r}")
        if self.arkv_quant not in ("auto", *QUANT_DTYPES):
            raise ConfigError(f"config field 'arkv_quant' must be one of {('auto', *QUANT_DTYPES)}, got {self.arkv_quant!r}")
        if isinstance(self.arkv_gamma, bool) or not isinstance(self.arkv_gamma, (int, float)) or not self.arkv_gamma >= 0:
            raise ConfigError(f"config field 'arkv_gamma' must be a number >= 0, got {self.arkv_gamma!r}")
        if isinstance(self.arkv_window_tokens, bool) or not isinstance(self.arkv_window_tokens, int) \
                or self.arkv_window_tokens < 1:
            raise ConfigError(f"config field 'arkv_window_tokens' must be an integer >= 1, got {self.arkv_window_tokens!r}")
        if isinstance(self.arkv_slack, bool) or not isinstance(self.arkv_slack, (int, float)) or not 0 < self.arkv_slack < 1:
            raise ConfigError(f"config field 'arkv_slack' must be in (0, 1) (the paper uses 0.75), got {self.arkv_slack!r}")
        positive_int("cluster_queries")
        if isinstance(self.recluster_steps, bool) or not isinstance(self.recluster_steps, int) or self.recluster_steps < 0:
            raise ConfigError(f"config field 'recluster_steps' must be an integer >= 0 (0: never), got {self.recluster_steps!r}")
        if isinstance(self.cluster_radius, bool) or not isinstance(self.cluster_radius, (int, float)) \
                or not 0 < self.cluster_radius <= 1:
            raise ConfigError(f"config field 'cluster_radius' must be in (0, 1] (a Jaccard distance), got {self.cluster_radius!r}")
        if isinstance(self.replica_share, bool) or not isinstance(self.replica_share, (int, float)) \
                or not 0 <= self.replica_share <= 1:
            raise ConfigError(f"config field 'replica_share' must be in [0, 1], got {self.replica_share!r}")
        if self.replacement not in REPLACEMENTS:
            raise ConfigError(f"config field 'replacement' must be one of {REPLACEMENTS}, got {self.replacement!r}")
        if isinstance(self.verify_fraction, bool) or not isinstance(self.verify_fraction, (int, float)) \
                or not 0 <= self.verify_fraction <= 1:
            raise ConfigError(f"config field 'verify_fraction' must be in [0, 1] (1: verify every KV record read, "
                              f"0: none), got {self.verify_fraction!r}")
        if isinstance(self.read_deadline_s, bool) or not isinstance(self.read_deadline_s, (int, float)) \
                or not self.read_deadline_s > 0:
            raise ConfigError(f"config field 'read_deadline_s' must be a number of seconds > 0, got {self.read_deadline_s!r}")
        align = self.io_align_bytes
        if not isinstance(align, int) or align < 512 or align & (align - 1):
            raise ConfigError(f"config field 'io_align_bytes' must be a power of two >= 512, got {align!r}")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) \
                or self.max_request_bytes < align:
            raise ConfigError(f"config field 'max_request_bytes' must be an integer >= io_align_bytes ({align}), "
                              f"got {self.max_request_bytes!r}")
        return self

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

    def within_context(self) -> "RuntimeConfig":
        """M and C capped at the groups ``max_context`` tokens have: picks or slots beyond them would be memory
        allocated (and counted against the budget) that nothing can fill."""
        fixed = self.sink_groups + self.window_groups
        picked = min(self.picked_groups, max(1, -(-self.max_context // self.G) - fixed))
        C = min(self.C, max(picked, -(-self.max_context // self.G)))
        if (picked + fixed, C) == (self.M, self.C):
            return self
        return RuntimeConfig(**{**asdict(self), "M": picked + fixed, "C": C})

    def to_dict(self) -> dict:
        return asdict(self)
