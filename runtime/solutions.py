"""A deployed config: the runtime parameters plus the solver's solution per (batch, context).

``deploy/<platform>/config.json`` (written by the install step) holds the top-level runtime
fields, metadata the runtime does not need (platform, model, measurements, ...) and
``solutions``.  The runtime takes the solution for the smallest recorded (batch, context)
that covers the request, else the nearest (KVSwap Appendix A.4); each solution carries its
own max_batch/max_context so its memory plan is the one the solver checked.
"""
from __future__ import annotations

from pathlib import Path

from .config import SECTIONS, ConfigError, RuntimeConfig, read_config_file

# written by the install step for people and tools; ignored here
METADATA_KEYS = ("platform", "model", "exposed_io_share", "alpha", "solutions", "measurements", "profile", "created",
                 "edgekv_version", "report", "kv_path", "kv_paths", "device", "dtype", "weights", "scorer_backend")
# a row's own fields over the base config's; io_align_bytes too: a row's records are sized (and its memory solved) at
# its own G's alignment, and the base's (the top row's G) made a smaller G's slots twice the bytes the solver counted;
# prompt_adapter too: its projections are in the memory the solver counted for the row
SOLUTION_KEYS = ("G", "M", "C", "sigma", "reuse", "adapter_path", "sink_tokens", "window_tokens", "klr_dtype",
                 "kv_record_dtype", "io_align_bytes", "prompt_adapter")


class SolutionTable:
    def __init__(self, entries: list[tuple[int, int, RuntimeConfig]]):
        if not entries:
            raise ConfigError("config field 'solutions' is empty; re-run the install step (make deploy)")
        self.entries = sorted(entries, key=lambda e: (e[0], e[1]))

    def pick(self, batch: int, context: int) -> RuntimeConfig:
        """A request beyond every recorded pair (a prompt plus max_new_tokens past max_context) is asked as the
        largest one: the nearest by distance could hold less context than the prompt has."""
        largest_b = max(e[0] for e in self.entries)
        largest_s = max(e[1] for e in self.entries)
        batch, context = min(batch, largest_b), min(context, largest_s)
        covering = [e for e in self.entries if e[0] >= batch and e[1] >= context]
        if covering:
            return min(covering, key=lambda e: (e[1], e[0]))[2]
        return min(self.entries, key=lambda e: abs(e[0] - batch) / largest_b + abs(e[1] - context) / largest_s)[2]

    def __iter__(self):
        return iter(self.entries)


def deployed_compute(source) -> dict:
    """{"device", "dtype", "weights"} the install step measured with, when ``source`` is a deployed config (a dict or
    its JSON file) that records them; {} otherwise (a plain config, a RuntimeConfig, None, an unreadable file)."""
    if isinstance(source, (str, Path)):
        try:
            source = read_config_file(source)
        except (ConfigError, UnicodeDecodeError):
            return {}  # load_deployed names the problem
    if not isinstance(source, dict):
        return {}
    return {k: source[k] for k in ("device", "dtype", "weights") if isinstance(source.get(k), str)}


def load_deployed(source) -> tuple[RuntimeConfig, SolutionTable | None]:
    """A config dict/path/RuntimeConfig -> (base config, solutions or None)."""
    if isinstance(source, (str, Path)):
        try:
            source = read_config_file(source)
        except UnicodeDecodeError as exc:  # a ValueError that names neither the file nor the fix
            raise ConfigError(f"config file {source} is not UTF-8 JSON ({exc}); point to the deployed config.json") from exc
    if not isinstance(source, dict) or "solutions" not in source:
        return RuntimeConfig.load(source), None
    known = set(RuntimeConfig.keys()) | set(SECTIONS)  # flat keys, or nested by section
    base = RuntimeConfig.load({k: v for k, v in source.items() if k in known})
    unknown = sorted(map(str, set(source) - known - set(METADATA_KEYS)))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; known keys: {sorted(known | set(METADATA_KEYS))}")
    rows = source["solutions"]
    if not isinstance(rows, list):
        raise ConfigError(f"config field 'solutions' must be a list of {{batch, context, G, M, C, sigma}} rows, got "
                          f"{type(rows).__name__}; re-run the install step (make deploy)")
    entries = []
    for i, row in enumerate(rows):
        where = f"config field 'solutions[{i}]'"
        if not isinstance(row, dict):
            raise ConfigError(f"{where} must be a mapping with batch, context, G, M, C, sigma, got {row!r:.60}; "
                              "re-run the install step")
        missing = [k for k in ("batch", "context", "G", "M", "C", "sigma") if k not in row]
        if missing:
            raise ConfigError(f"{where} lacks {missing}; re-run the install step")
        for key in ("batch", "context"):  # the budget below multiplies by batch: checked before any arithmetic
            if isinstance(row[key], bool) or not isinstance(row[key], int) or not 1 <= row[key] < 2**63:
                raise ConfigError(f"{where}.{key} must be a positive 64-bit integer, got {row[key]!r:.40}; "
                                  "re-run the install step")
        override = {k: row[k] for k in SOLUTION_KEYS if k in row}
        budget = base.max_kv_mem_mib and base.max_kv_mem_mib * row["batch"] / base.max_batch  # B_max / b_max each
        try:
            cfg = RuntimeConfig.load({**base.to_dict(), **override, "max_batch": row["batch"], "max_context": row["context"],
                                      "max_kv_mem_mib": budget})
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        entries.append((row["batch"], row["context"], cfg))
    if entries and not any(b >= base.max_batch and c >= base.max_context for b, c, _ in entries):
        raise ConfigError(f"config field 'solutions' has no row for batch {base.max_batch} at context {base.max_context} "
                          "(the largest request 'max_batch' and 'max_context' allow; a longer prompt than a row holds "
                          "cannot run with it); re-run the install step or lower max_batch/max_context")
    return base, SolutionTable(entries)
