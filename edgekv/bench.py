"""`edgekv bench`: every policy side by side, one model, one prompt set, one run.

Rows per (batch, context): ``full`` (all KV in memory), ``flexgen`` (the whole layer read from
disk each step, unconstrained), and at each budget (a fraction of the full cache for the batch)
``token`` (G=1, no reuse), ``kvswap-noreuse`` and ``kvswap`` as the install step's solver tunes it
for this machine (disk profile, block compute profile of this model), and ``arkv`` (in memory: the
budget holds original and quantized tokens, the rest evicted).  ``kvswap-ram`` (asked for by name) is
``kvswap``'s twin with its KV folder in RAM (tmpfs): the same step with every read already in memory, one of
the two limits ``kvswap``'s overlap is measured against (the other: its bytes at the disk's rate).  Honesty rules:
- every prompt is prefilled once and replayed into each policy (same K/V, same disk writes),
  so only decode is compared and only decode is timed;
- decode time comes from the engine's step events; the first ``warmup`` steps are excluded;
- KV reads are O_DIRECT where the filesystem allows (reported per row), so the page cache
  does not serve them;
- the achieved read rate (bytes read / time inside reads) is set beside the profiled
  random-read bandwidth at the same block size and queue depth.

With several KV folders (``kv_paths``) each budget also gets the ``kvswap/Np`` rows: the tuned
``kvswap`` configuration over N paths, clustering off and on (``+cluster``), the reuse buffer's
other replacement policies, and a batch of questions over one shared document read with and
without prefix dedup.  One real disk emulates N devices: every path is its own read queue behind a
virtual link of ``path_limit_mib_s`` (runtime/reader.py PacedReader), N = 1 included, so the rows
compare like with like; the meta says how, and whether the real disk can carry N links at once.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from edgekv.install import disk as diskprof
from edgekv.install import solver, tables
from edgekv.install.compute import profile_compute
from edgekv.evals.harness import recorded_configs
from edgekv.evals.progress import Progress
from edgekv.install.iomodel import gap_bytes, io_model
from edgekv.runtime import Engine, RecordLayout, RuntimeConfig
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.checkpoints import gguf_source
from edgekv.runtime import policies as registry
from edgekv.runtime.config import REPLACEMENTS
from edgekv.runtime.engine import preflight
from edgekv.runtime.model import DecoderModel
from edgekv.runtime.prompt_cache import PromptKVCache
from edgekv.runtime.reader import open_reader
from edgekv.runtime.slots import replay_hit_rate

QUEUE_DEPTH = 32
PATH_COUNTS = (1, 2, 4)  # KV paths per kvswap/Np row, up to the folders given (all of them included)
PROMPT_SOURCES = ("random", "tasks")
QUESTION_TOKENS = 16  # each question's own tail after the shared document (the dedup pair)


@dataclass
class Run:
    policy: str
    budget: str | None
    batch: int
    context: int
    decode_tok_s: float
    ratio_to_full: float | None
    kv_resident_mib: float
    read_bytes_per_token: float
    eff_read_bw_mib_s: float | None
    eff_bw_vs_profile: float | None
    reuse_rate: float
    io_stall_share: float
    step_ms: float
    layer_ms: dict | None = None  # per layer and decode step: select (predict + slots), io_stall, correct, compute (the rest)
    G: int | None = None
    M: int | None = None
    C: int | None = None
    sigma: float | None = None
    o_direct: bool | None = None
    sink_tokens: int | None = None
    window_tokens: int | None = None
    klr_dtype: str | None = None  # the K_lr rows' format (int8 halves their bytes at the same sigma)
    kv_record_dtype: str | None = None  # the disk records' format (the disk rows)
    n_paths: int | None = None  # KV paths the records are spread over (None: nothing is read from disk)
    eff_bw_mib_s: float | None = None  # all paths together: bytes read / time the I/O thread spent in reads
    requests_per_step: float | None = None  # read requests per decode step: the whole batch, every layer
    bytes_per_request: float | None = None  # what coalescing adjacent records achieved (wanted bytes)
    io_gap_bytes: int | None = None  # records at most this far apart were read as one request (the disk rows)
    gap_records_per_step: float | None = None  # records read only to bridge those gaps, per decode step
    clustering: str | None = None  # "on"/"off": groups laid out by co-activation or striped in token order
    replacement: str | None = None  # the reuse buffer's policy (kvswap rows)
    share_prefix: bool | None = None  # prompt groups shared by several sequences read once
    path_limit_mib_s: float | None = None  # each path's emulated read limit (paced rows only)
    records_by_path: list | None = None  # records read from each path: how evenly the layout spreads the load
    reader: str | None = None  # the KV reader, emulation included
    decode_threads: int | None = None  # torch's threads in the row's decode steps (a disk policy leaves its reads one)
    kv_bytes_read: int | None = None  # every sequence's reads of the row together
    verify_fraction: float | None = None  # the share of records read whose checksum was checked (disk rows)
    correction: str | None = None  # guess (the layer-ahead picks) or corrected (rescored with the layer's own query)
    correction_records_per_step: float | None = None  # records a correction read per decode step, the whole batch
    guess_recall: float | None = None  # the share of the corrected picks the layer-ahead guess had
    host_syncs_per_step: float | None = None  # on a GPU: the host waited for it this often a decode step (SyncCounter)
    copied_bytes_per_step: float | None = None  # records copied host -> device a decode step, the whole batch
    copied_vs_read: float | None = None  # bytes copied to the device / bytes read from disk (hits never cross: <= 1)
    # kvswap beside its limits (with a kvswap-ram row): the step with every read in memory, its bytes per step at
    # the disk's rate (fio's, else the reader's: meta's disk reference), and max(both) / step_ms (1: at the limit)
    in_memory_step_ms: float | None = None
    disk_bound_ms: float | None = None
    overlap_efficiency: float | None = None
    # full in the memory this row holds: the largest batch at this context, or else the longest context at batch 1
    full_fit_batch: int | None = None
    full_fit_context: int | None = None


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return value / reference


def decode_rate(step_events: list[tuple[int, int, int]], warmup: int) -> tuple[float, float]:
    """(tokens/s, ms per step) over steps >= warmup; events are (step, active sequences, duration ns)."""
    kept = [(active, ns) for step, active, ns in step_events if step >= warmup]
    if not kept:
        raise ValueError(f"no decode steps after {warmup} warm-up steps; raise --steps")
    tokens = sum(a for a, _ in kept)
    seconds = sum(ns for _, ns in kept) / 1e9
    return tokens / seconds, seconds / len(kept) * 1e3


def effective_bandwidth(bytes_read: int, read_s: float) -> float | None:
    return bytes_read / read_s / 2**20 if read_s > 0 and bytes_read > 0 else None


class SyncCounter:
    """Host syncs per decode step on a GPU (torch's sync debug mode), counted over the warm-up steps after the first
    (allocations and first touches) so that no timed step pays for the warnings; None on the CPU or with fewer than
    two warm-up steps."""

    def __init__(self, device: torch.device, warmup: int):
        self.on = device.type == "cuda" and warmup >= 2
        self.warmup = warmup
        self._caught: list | None = None
        self._scope = None

    def __enter__(self):
        if self.on:
            self._scope = warnings.catch_warnings(record=True)
            self._caught = self._scope.__enter__()
            warnings.simplefilter("always")
        return self

    def __call__(self, event) -> None:
        if self.on and event.kind == "decode_step_start" and event.info["step"] in (1, self.warmup):
            torch.cuda.set_sync_debug_mode("warn" if event.info["step"] == 1 else "default")

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._scope.__exit__(*exc)

    @property
    def per_step(self) -> float | None:
        if not self.on:
            return None
        return sum("synchroniz" in str(w.message) for w in self._caught) / (self.warmup - 1)


class StepTimer:
    """Subscribes to the engine's step events and keeps (step, active, duration) per decode step."""

    def __init__(self):
        self.steps: list[tuple[int, int, int]] = []
        self._start: dict[int, int] = {}

    def __call__(self, event) -> None:
        if event.kind == "decode_step_start":
            self._start[event.info["step"]] = event.t_ns
        elif event.kind == "decode_step_end":
            step = event.info["step"]
            self.steps.append((step, event.info["active"], event.t_ns - self._start.pop(step)))


@dataclass(frozen=True)
class Row:
    """A bench row: the registered policy it runs, and how it departs from that policy's own budget fit."""

    name: str
    policy: str
    reuse: bool | None = None  # False: the tuned G refitted without a reuse buffer (what reuse buys)
    overrides: tuple = ()  # (field, value) set on the fitted configuration (e.g. what checksums cost)
    chosen: bool = False  # the configurations an eval chose by measured quality (--quality-configs), when given
    kv_in_memory: bool = False  # its KV folder in RAM (tmpfs): every read already in memory


TUNED_ROW = "kvswap"  # the solver's tuned row: the rows over several KV paths and the step-time plot follow it
IN_MEMORY_ROW = "kvswap-ram"  # the tuned row's twin with every read in memory
RAM_FOLDER = Path("/dev/shm")  # tmpfs on Linux: a KV folder whose reads are memory copies
# the table's rows in order; a registered policy no row names runs as a row of its own name
ROWS = (Row("full", "full"), Row("flexgen", "flexgen"), Row("token", "token"),
        Row("kvswap-noreuse", "kvswap", reuse=False), Row("kvswap", "kvswap"),
        Row(IN_MEMORY_ROW, "kvswap", kv_in_memory=True),
        Row("kvswap-mapped", "kvswap", overrides=(("slot_memory", "mapped"),)),
        Row("kvswap-corrected", "kvswap", overrides=(("correction", "corrected"),)),
        Row("kvswap-corrected-overlap", "kvswap", overrides=(("correction", "corrected"), ("correction_overlap", True))),
        Row("kvswap-noverify", "kvswap", overrides=(("verify_fraction", 0.0),)), Row("arkv", "arkv"),
        Row("kvswap-quality", "kvswap", chosen=True),
        Row("kvswap-quality-corrected", "kvswap", overrides=(("correction", "corrected"),), chosen=True))
_log = logging.getLogger(__name__)
# what a bench point finds beyond its rows, per key ("<batch>x<context>", or a budget's), gathered into the meta
FOUND = ("paths_configs", "replacement_replay", "dedup", "llama_cpp_failed")
LLAMA_CPP_ROW = "llama.cpp"  # the GGUF file under llama.cpp (llama_cpp_run), not a policy
# what a crash of the llama.cpp row's process names as its fix (seen: SIGSEGV in ggml's AMX matmul on a VM that lists
# AMX but faults in it)
LLAMA_CPP_CRASH_FIX = ("on a CPU that lists AMX but faults in it, build llama-cpp-python without AMX: "
                       "CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
                       "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" "
                       "pip install --force-reinstall --no-deps llama-cpp-python")
LLAMA_CPP_BASE_S, LLAMA_CPP_S_PER_TOKEN = 120.0, 0.05  # the row's process is stopped after base + this a token


def rows() -> list[Row]:
    named = {r.policy for r in ROWS if not r.overrides and r.reuse is None and not r.chosen}
    return list(ROWS) + [Row(name, name) for name in registry.names() if name not in named]


def row_names() -> tuple[str, ...]:
    return tuple(r.name for r in rows()) + (LLAMA_CPP_ROW,)


def row_named(name: str) -> Row | None:
    return next((r for r in rows() if r.name == name.split("/")[0].split(",")[0]), None)


def row_policy(name: str) -> str:
    """The registered policy behind a row (a row over several KV paths, e.g. kvswap/2p+cluster, runs kvswap)."""
    row = row_named(name)
    return row.policy if row is not None else name.split("/")[0].split(",")[0]


class SolverFit(registry.BudgetFit):
    """A budget per sequence as the install step's solver fits it on this machine: ``tuned`` by its disk and
    compute profiles, ``fixed`` the largest (sigma, M, C) at a given G."""

    def __init__(self, model: DecoderModel, batch: int, context: int, per_seq_bytes: float, budget_mib: float,
                 limits: solver.Limits, t_io, compute_profile, reuse_table: dict | None):
        self.model, self.batch, self.context, self.per_seq, self.limits = model, batch, context, per_seq_bytes, limits
        self.t_io, self.compute_profile, self.reuse_table = t_io, compute_profile, reuse_table
        super().__init__(budget_mib, limits.g_max)
        self._tuned = None

    def tuned(self) -> dict | None:
        if self._tuned is None:
            self._tuned = solver.solve(self.batch, self.context, self.per_seq, self.model.dims, self.model.dtype,
                                       self.limits, self.t_io, self.compute_profile.t_model_ms,
                                       lambda G, C, picked: tables.reuse_rate(self.reuse_table or {}, G, C, picked))
        return self.geometry(self._tuned)

    def fixed(self, G: int, reuse: bool) -> dict | None:
        fit = solver.fit_memory(self.per_seq, self.model.dims, self.model.dtype, self.limits, self.context, G,
                                reuse=reuse)
        return self.geometry(fit, reuse)


def policy_configs(model: DecoderModel, batch: int, context: int, budgets: list[str], limits: solver.Limits,
                   disk_profile, compute_profile, reuse_table: dict | None = None, chosen: dict | None = None,
                   record_dtypes=("auto",)) -> list[tuple[str, str | None, dict]]:
    """(row name, budget label, runtime config) for every row of one (batch, context): the rows of policies not
    sized by a budget once, then each budget's rows, every policy asked for its geometry (``budget_geometry``)
    from the solver's fit; ``kvswap-quality`` rows run the configurations of ``chosen``
    (edgekv.evals.harness.recorded_configs) at this batch.  Each row of a disk policy comes once per
    ``kv_record_dtype`` of ``record_dtypes``, same configuration."""
    dims = model.dims
    base = {"max_context": context, "max_batch": batch, "io_align_bytes": limits.io_align_bytes,
            "io_queue_depth": QUEUE_DEPTH, "G": 4, "M": 1, "C": 1, "sigma": 8}
    unbudgeted = registry.BudgetFit(largest_group_tokens=limits.g_max)
    out = [(r.name, None, {**base, **registry.get(r.policy).budget_geometry(unbudgeted), **dict(r.overrides)})
           for r in rows() if not registry.get(r.policy).budgeted]
    full_bytes = kv_bytes(model, 1, context)
    t_io = io_model(disk_profile, dims, model.dtype, limits.io_align_bytes, QUEUE_DEPTH, compute_profile.h2d_gib_s)
    for label in budgets:
        num, _, den = label.partition("/")
        per_seq = float(num) / float(den) * full_bytes
        budget_mib = per_seq * batch / 2**20
        fit = SolverFit(model, batch, context, per_seq, budget_mib, limits, t_io, compute_profile, reuse_table)
        for r in rows():
            spec = registry.get(r.policy)
            if not spec.budgeted:
                continue
            if r.chosen:
                geometry = chosen.get((context, label)) if chosen else None
            elif r.reuse is False:
                tuned = fit.tuned()
                geometry = fit.fixed(tuned["G"], reuse=False) if tuned else None
            else:
                geometry = spec.budget_geometry(fit)
            if geometry is not None:
                out.append((r.name, label, {**base, **geometry, **dict(r.overrides), "max_kv_mem_mib": budget_mib}))
    def with_records(cfg: dict, record: str) -> dict:
        """``cfg`` with its records in ``record`` ("auto": the format a recorded configuration chose, else exact) and
        the gap the install step would set from the disk for them (install/iomodel.gap_bytes)."""
        record = cfg.get("kv_record_dtype", "auto") if record == "auto" else record
        stride = RecordLayout(cfg["G"], dims.n_kv_heads, dims.head_dim, model.dtype, cfg["io_align_bytes"],
                              record).stride_bytes
        return {"io_gap_bytes": gap_bytes(disk_profile, stride, QUEUE_DEPTH), **cfg, "kv_record_dtype": record}

    configs = []
    for name, label, cfg in out:
        if not registry.get(row_policy(name)).on_disk:
            configs.append((name, label, {**cfg, "kv_record_dtype": "auto"}))
            continue
        configs += [(name, label, with_records(cfg, record)) for record in record_dtypes]
    return configs


class TraceRecorder:
    """Keeps a row's picks ("groups_selected" events) as (layer, groups, valid), copied: replayed through fresh
    reuse buffers (runtime.slots.replay_hit_rate), every replacement policy meets the same picks."""

    def __init__(self):
        self.trace: list[tuple[int, np.ndarray, np.ndarray]] = []

    def __call__(self, event) -> None:
        if event.kind == "groups_selected":
            self.trace.append((event.info["layer"], np.array(event.info["groups"]), np.array(event.info["valid"])))


class RowRunner:
    """Runs the rows of one (batch, context): a fresh engine per row, fed the prompts' KV from one cache (each
    prompt computed once), only decode timed."""

    def __init__(self, model: DecoderModel, context: int, steps: int, warmup: int, limits: solver.Limits, disk_profile,
                 on_event=None):
        self.model, self.context, self.steps, self.warmup, self.limits = model, context, steps, warmup, limits
        self.disk_profile = disk_profile
        self.on_event = on_event
        self.cache = PromptKVCache()

    def __call__(self, name: str, label: str, budget: str | None, cfg: dict, kv, prompts: list[list[int]],
                 paths: tuple[int, float | None, float | None] | None = None, listener=None) -> Run:
        """``kv``: a folder or a list of them; ``paths`` (N, MiB/s per path, IOPS per path): read through an
        emulated reader of N paced paths instead of the engine's own; ``listener`` also hears the events."""
        config = RuntimeConfig.load(cfg)
        reader = None
        if paths is not None:
            n, limit_mib_s, limit_iops = paths
            reader = open_reader(config.io.reader_backend, config.io.io_queue_depth, n_paths=n, limit_mib_s=limit_mib_s,
                                 limit_iops=limit_iops)
        try:
            engine = Engine(self.model, config, row_policy(name), kv, reader=reader)
        except BaseException:
            if reader is not None:
                reader.close()
            raise
        timer = StepTimer()
        with engine, SyncCounter(self.model.device, self.warmup) as syncs:
            engine.prompt_cache = self.cache
            for subscriber in (timer, syncs, self.on_event, listener):
                if subscriber is not None:
                    engine.events.subscribe(subscriber)
            out = engine.generate(prompts, max_new_tokens=self.steps + self.warmup + 1, stop_token_ids=[])
        return self.row(name, label, budget, config, [r.stats for r in out], timer,
                        paths[1] if paths is not None else None, syncs.per_step)

    def row(self, name: str, label: str, budget: str | None, config: RuntimeConfig, s: list[dict], timer: StepTimer,
            path_limit_mib_s: float | None, host_syncs_per_step: float | None = None) -> Run:
        dims = self.model.dims
        rate, step_ms = decode_rate(timer.steps, self.warmup)
        decoded = sum(x["generated_tokens"] - 1 for x in s)
        read = sum(x["kv_bytes_read"] for x in s)
        requests = s[0]["kv_read_requests"]  # the batch's, in every sequence's stats
        eff = effective_bandwidth(read, s[0]["io_read_s"])
        spec = registry.get(row_policy(name))
        on_disk, predicts, selects = spec.on_disk, spec.predicts, spec.selects and spec.predicts
        stride = RecordLayout(config.G, dims.n_kv_heads, dims.head_dim, self.model.dtype, self.limits.io_align_bytes,
                              config.io.kv_record_dtype).stride_bytes
        from_disk = on_disk and not row_named(name).kv_in_memory
        profile_bw = self.disk_profile.read_mib_s(stride, QUEUE_DEPTH, source="fio") if from_disk else None
        per_layer = 1e3 / (len(timer.steps) * dims.n_layers)  # whole run (warm-up included), ms per layer-step
        parts = {"select": s[0]["select_s"] * per_layer, "io_stall": s[0]["io_stall_s"] * per_layer,
                 "correct": s[0]["correction_s"] * per_layer}
        parts["compute"] = max(0.0, s[0]["decode_s"] * per_layer - sum(parts.values()))
        return Run(
            label, budget, len(s), self.context, rate, None, s[0]["kv_resident_bytes"] / 2**20, read / decoded,
            eff, ratio(eff, profile_bw), float(np.mean([x["reuse_rate"] for x in s])), s[0]["io_stall_share"], step_ms,
            parts, G=config.G if on_disk else None, M=config.M if selects else None, C=config.C if spec.tunable else None,
            sigma=config.sigma if selects else None, o_direct=s[0]["o_direct"],
            sink_tokens=config.sink_tokens if selects else None, window_tokens=config.window_tokens if selects else None,
            klr_dtype=config.predictor.klr_dtype if predicts else None,
            kv_record_dtype=config.io.kv_record_dtype if on_disk else None,
            n_paths=s[0]["n_paths"] if on_disk else None, eff_bw_mib_s=eff,
            requests_per_step=requests / len(timer.steps) if on_disk else None,
            bytes_per_request=read / requests if requests else None,
            io_gap_bytes=config.io.io_gap_bytes if on_disk else None,
            gap_records_per_step=s[0]["kv_gap_records_read"] / len(timer.steps) if on_disk else None,
            clustering=("on" if config.placement.clustering else "off") if on_disk else None,
            replacement=config.replacement if selects and config.reuse else None,
            share_prefix=config.placement.share_prefix if on_disk else None, path_limit_mib_s=path_limit_mib_s,
            records_by_path=s[0]["kv_records_by_path"] if on_disk else None, reader=s[0]["reader"],
            decode_threads=s[0]["decode_threads"] if self.model.device.type == "cpu" else None, kv_bytes_read=read,
            verify_fraction=s[0]["kv_records_verified"] / max(1, s[0]["kv_records_read"]) if on_disk else None,
            correction=config.predictor.correction if selects else None,
            correction_records_per_step=sum(x["kv_correction_records"] for x in s) / len(timer.steps) if selects else None,
            guess_recall=s[0]["guess_recall"], host_syncs_per_step=host_syncs_per_step,
            copied_bytes_per_step=s[0]["kv_bytes_copied"] / len(timer.steps) if on_disk else None,
            copied_vs_read=s[0]["kv_bytes_copied"] / read if on_disk and read else None)


def path_counts(n_folders: int) -> list[int]:
    """The N of the kvswap/Np rows: 1, 2, 4 below the folders given, and all of them."""
    return sorted({n for n in PATH_COUNTS if n < n_folders} | {n_folders})


def fit_for_clustering(model: DecoderModel, kvswap: dict) -> dict:
    """The tuned kvswap configuration with C, then M, lowered just enough that clustering's placement tables fit
    the same budget (often nothing is lowered).  Every kvswap/Np row runs it, clustering on or off, so the
    layout is all that differs between them."""
    from edgekv.runtime.memory import plan_memory

    dims = model.dims
    itemsize = torch.empty(0, dtype=model.dtype).element_size()

    def need_mib(cfg: dict) -> float:
        config = RuntimeConfig.load({**cfg, "clustering": True})
        rank = LowRankAdapter.rank_for(dims.n_kv_heads, dims.head_dim, config.sigma)
        stride = RecordLayout(config.G, dims.n_kv_heads, dims.head_dim, model.dtype, config.io.io_align_bytes,
                              config.io.kv_record_dtype).stride_bytes
        return plan_memory("kvswap", config, dims, itemsize, rank, stride).total_bytes / 2**20

    cfg = dict(kvswap)
    while need_mib(cfg) > cfg["max_kv_mem_mib"]:
        picked = RuntimeConfig.load(cfg).picked_groups
        if cfg["reuse"] and cfg["C"] > picked:
            cfg["C"] -= 1
        elif picked > 1:
            cfg["M"] -= 1
            cfg["C"] = min(cfg["C"], picked - 1) if cfg["reuse"] else cfg["C"]
        else:
            raise ValueError(f"clustering's placement tables do not fit budget {cfg['max_kv_mem_mib']:g} MiB "
                             "beside one selected group: raise the budget")
    return cfg


def path_rows(kvswap: dict, n_folders: int, batch: int) -> list[tuple[str, int, dict, str | None]]:
    """(label, N, config, role) of the rows over several KV paths at one budget, all at the tuned ``kvswap``
    configuration: N paths with clustering off and on; at the largest N clustered, the other replacement policies
    (when there is a reuse buffer), its fifo row's picks being the "trace" they are all replayed on, and the same
    without reuse, clustering off and on; and the
    "dedup" pair: at least two questions over one document, ``share_prefix`` on and off, the same budget per
    sequence."""
    counts = path_counts(n_folders)
    top = counts[-1]
    record = "" if kvswap["kv_record_dtype"] == "auto" else f",{kvswap['kv_record_dtype']}"
    rows = [(f"kvswap/{n}p{'+cluster' if on else ''}{record}", n, {**kvswap, "clustering": on, "replacement": "fifo"},
             "trace" if on and n == top else None) for n in counts for on in (False, True)]
    if kvswap["reuse"]:
        rows += [(f"kvswap/{top}p+cluster,{r}{record}", top, {**kvswap, "clustering": True, "replacement": r}, None)
                 for r in REPLACEMENTS if r != "fifo"]
        # without reuse every pick is read each step: the stable picks clustering lays out next to each other
        rows += [(f"kvswap-noreuse/{top}p{'+cluster' if on else ''}{record}", top,
                  {**kvswap, "reuse": False, "clustering": on, "replacement": "fifo"}, None) for on in (False, True)]
    dedup_batch = max(2, batch)
    shared = {**kvswap, "clustering": False, "replacement": "fifo", "max_batch": dedup_batch,
              "max_kv_mem_mib": kvswap["max_kv_mem_mib"] * dedup_batch / batch}
    rows += [(f"kvswap/{top}p,shared-doc{'' if on else ',no-dedup'}{record}", top, {**shared, "share_prefix": on}, "dedup")
             for on in (True, False)]
    return rows


def shared_doc_prompts(prompt: list[int], batch: int, vocab: int, generator: torch.Generator) -> list[list[int]]:
    """``batch`` questions over one document (``prompt`` less its last QUESTION_TOKENS), each its own tail."""
    doc = prompt[: len(prompt) - QUESTION_TOKENS]
    return [doc + torch.randint(4, vocab, (QUESTION_TOKENS,), generator=generator).tolist() for _ in range(batch)]


def random_prompts(vocab: int, batch: int, prompt_len: int, generator: torch.Generator) -> list[list[int]]:
    """Uniform random tokens, a little shorter for each later sequence (ragged lengths)."""
    return [torch.randint(4, vocab, (prompt_len - 4 * i,), generator=generator).tolist() for i in range(batch)]


def task_prompts(model_dir: Path, batch: int, prompt_len: int, generator: torch.Generator) -> list[list[int]]:
    """The eval's retrieval tasks (needles in a haystack, in the model's own text format): text whose attention
    has structure, where random tokens have little (what co-activation clustering and reuse feed on)."""
    from edgekv.evals.harness import task_format
    from edgekv.evals.tasks import TASKS, make_instance

    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))
    fmt = task_format(model_dir)
    return [make_instance(TASKS[i % len(TASKS)], prompt_len - 4 * i, rng, fmt=fmt).context for i in range(batch)]


def bench_point(model: DecoderModel, kv_path: Path, batch: int, context: int, budgets: list[str], steps: int,
                warmup: int, limits: solver.Limits, disk_profile, compute_profile, policies, reuse_table=None,
                log=print, gguf: Path | None = None, on_event=None, chosen: dict | None = None,
                record_dtypes=("auto",), kv_paths: list[Path] | None = None, path_limit_mib_s: float | None = None,
                path_limit_iops: float | None = None, make_prompts=None, on_row=None) -> tuple[list[Run], dict]:
    """Every row at one (batch, context), and what the rows over ``kv_paths`` found per budget ("replacement_replay":
    each policy's hit rate on one trace; "dedup": the shared document's bytes with and without dedup).  With
    ``gguf`` (the model's source file, llama-cpp-python importable) also the llama.cpp row at batch 1, or where its
    process failed, why ("llama_cpp_failed": the signal and the fix).
    ``make_prompts(batch, prompt_len, generator)``: the prompts (default: random tokens, ``random_prompts``).
    ``on_row(rows)``: called with the point's rows so far after each (their ratios to full come at the point's end)."""
    g = torch.Generator().manual_seed(batch * 100003 + context)
    vocab = model.dims.vocab
    prompt_len = context - steps - warmup - 8
    prompts = (make_prompts or partial(random_prompts, vocab))(batch, prompt_len, g)
    measure = RowRunner(model, context, steps, warmup, limits, disk_profile, on_event)
    configs = policy_configs(model, batch, context, budgets, limits, disk_profile, compute_profile, reuse_table, chosen,
                             record_dtypes)
    for name, budget, cfg in configs:  # every row's memory first: an over-budget row fails now, not after the rest
        if name in policies:
            if row_named(name).kv_in_memory:
                in_memory_folder(kv_bytes(model, batch, context)).cleanup()
            try:
                preflight(row_policy(name), RuntimeConfig.load(cfg), model.dims, model.dtype, None, kv_path)
            except ValueError as exc:
                raise ValueError(f"row {name} at budget {budget}, batch {batch}, context {context}: {exc}") from exc
    runs: list[Run] = []

    def keep(run: Run) -> Run:
        runs.append(run)
        log(f"  {run.policy:20s} {run.budget or '':5s} {run.decode_tok_s:9.1f} tok/s  step {run.step_ms:7.2f} ms")
        if on_row is not None:
            on_row(runs)
        return run

    for name, budget, cfg in configs:
        if name in policies:
            label = name if cfg["kv_record_dtype"] == "auto" else f"{name},{cfg['kv_record_dtype']}"
            if row_named(name).kv_in_memory:
                with in_memory_folder(kv_bytes(model, batch, context)) as ram:
                    keep(measure(name, label, budget, cfg, ram, prompts))
            else:
                keep(measure(name, label, budget, cfg, kv_path, prompts))
    found = {name: {} for name in FOUND}
    questions = shared_doc_prompts(prompts[0], max(2, batch), vocab, g) if kv_paths else []
    for budget in budgets if kv_paths else []:
        kvswap = next((cfg for name, b, cfg in configs if name == TUNED_ROW and b == budget), None)
        if kvswap is None:
            log(f"  no kvswap configuration fits budget {budget}: no rows over several KV paths")
            continue
        key = f"{batch}x{context}/{budget}"
        fitted = fit_for_clustering(model, kvswap)
        found["paths_configs"][key] = {k: fitted[k] for k in ("G", "M", "C", "sigma", "reuse")} | {
            "lowered_from_kvswap_row": {k: kvswap[k] for k in ("M", "C") if kvswap[k] != fitted[k]}}
        recorder, dedup = TraceRecorder(), {}
        for label, n, cfg, role in path_rows(fitted, len(kv_paths), batch):
            run = keep(measure("kvswap", label, budget, cfg, kv_paths[:n], questions if role == "dedup" else prompts,
                               (n, path_limit_mib_s, path_limit_iops), recorder if role == "trace" else None))
            if role == "dedup":
                dedup["bytes_with" if cfg["share_prefix"] else "bytes_without"] = run.kv_bytes_read
        max_groups = -(-context // fitted["G"])
        for capacity in (fitted["C"], 2 * fitted["C"]):  # at C = M every policy must evict all it did not pick
            found["replacement_replay"][key if capacity == fitted["C"] else f"{key},C={capacity}"] = {
                r: replay_hit_rate(recorder.trace, model.dims.n_layers, batch, capacity, max_groups, r)
                for r in REPLACEMENTS}
        found["dedup"][key] = {"batch": len(questions), "document_tokens": len(questions[0]) - QUESTION_TOKENS,
                               "question_tokens": QUESTION_TOKENS, **dedup,
                               "ratio": ratio(dedup["bytes_without"], dedup["bytes_with"])}
    if gguf is not None and batch == 1:
        try:
            keep(llama_cpp_run(gguf, model.dims, prompts[0], context, steps, warmup))
        except LlamaCppFailed as exc:
            log(f"  {LLAMA_CPP_ROW}: {exc}")
            found["llama_cpp_failed"][f"{batch}x{context}"] = str(exc)
    references = {r.name for r in rows() if registry.get(r.policy).reference}
    full_rate = next((r.decode_tok_s for r in runs if r.policy in references), None)
    for run in runs:
        run.ratio_to_full = ratio(run.decode_tok_s, full_rate)
    set_limits(runs, model, disk_profile, limits.io_align_bytes)
    return runs, found


def kv_bytes(model: DecoderModel, batch: int, context: int) -> int:
    """The whole KV cache of ``batch`` sequences of ``context`` tokens in the model's dtype (what full holds)."""
    d = model.dims
    return batch * context * d.n_layers * 2 * d.n_kv_heads * d.head_dim * model.dtype.itemsize


def in_memory_folder(needed_bytes: int):
    """A temporary KV folder in RAM (``RAM_FOLDER``) with room for ``needed_bytes``, or an error naming what lacks."""
    import shutil
    import tempfile

    if not RAM_FOLDER.is_dir() or not os.access(RAM_FOLDER, os.W_OK):
        raise ValueError(f"the {IN_MEMORY_ROW} row keeps its KV in {RAM_FOLDER} (tmpfs), which this machine lacks "
                         f"or may not write: leave {IN_MEMORY_ROW} out of --policies")
    free = shutil.disk_usage(RAM_FOLDER).free
    if free < needed_bytes * 1.05:  # records are padded to the I/O alignment
        raise ValueError(f"the {IN_MEMORY_ROW} row needs {needed_bytes * 1.05 / 2**30:.1f} GiB in {RAM_FOLDER} for its "
                         f"KV, {free / 2**30:.1f} GiB are free: enlarge it (mount -o remount,size=...) or leave "
                         f"{IN_MEMORY_ROW} out of --policies")
    return tempfile.TemporaryDirectory(prefix="edgekv-ram-", dir=RAM_FOLDER)


def set_limits(runs: list[Run], model: DecoderModel, disk_profile, align_bytes: int) -> None:
    """Each budgeted kvswap row beside its limits: its ``kvswap-ram`` twin's step (every read in memory) and its
    bytes per step at the disk's rate at its record size (the issue's overlap target: step <= 1.25 x the larger);
    and how much batch or context full would hold in the memory the row holds."""
    dims = model.dims
    full_token_bytes = kv_bytes(model, 1, 1)
    twins = {(r.budget, r.policy.replace(IN_MEMORY_ROW, TUNED_ROW, 1)): r for r in runs
             if r.policy.split(",")[0] == IN_MEMORY_ROW}
    for run in runs:
        if run.budget is None or run.policy.split(",")[0] not in (TUNED_ROW, IN_MEMORY_ROW):
            continue
        resident = run.kv_resident_mib * 2**20
        run.full_fit_batch = int(resident // (full_token_bytes * run.context))
        run.full_fit_context = run.context if run.full_fit_batch else int(resident // full_token_bytes)
        twin = twins.get((run.budget, run.policy))
        if twin is None or run.G is None:
            continue
        stride = RecordLayout(run.G, dims.n_kv_heads, dims.head_dim, model.dtype, align_bytes,
                              run.kv_record_dtype or "auto").stride_bytes
        rate_mib_s = disk_profile.read_mib_s(stride, QUEUE_DEPTH, source="disk")
        run.in_memory_step_ms = twin.step_ms
        run.disk_bound_ms = run.read_bytes_per_token * run.batch / (rate_mib_s * 2**20) * 1e3
        run.overlap_efficiency = max(run.in_memory_step_ms, run.disk_bound_ms) / run.step_ms


class LlamaCppFailed(RuntimeError):
    """The llama.cpp row's process ended without its step times: a crash (the signal) or an error (its last line)."""


def llama_cpp_run(gguf: Path, dims, prompt: list[int], context: int, steps: int, warmup: int) -> Run:
    """llama.cpp on the same GGUF at batch 1 (its own quantized weights, the whole f16 KV in memory, as many
    threads as torch uses): the reference a user would otherwise pick.  It runs in a child process
    (edgekv/llama_cpp_row.py), so that a crash in the wheel's native code ends this row only (``LlamaCppFailed``).
    Decode steps are timed one by one around ``eval`` of the greedy token, the first ``warmup`` excluded, like the
    engine's step events."""
    import signal
    import subprocess
    import sys

    request = {"gguf": str(gguf), "prompt": prompt, "context": context, "steps": warmup + steps,
               "threads": torch.get_num_threads()}
    # a child that hangs (a stuck thread pool) ends its row too: far longer than a 2-core CPU's prefill and steps take
    timeout_s = LLAMA_CPP_BASE_S + LLAMA_CPP_S_PER_TOKEN * (len(prompt) + warmup + steps)
    try:
        done = subprocess.run([sys.executable, "-m", "edgekv.llama_cpp_row"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LlamaCppFailed(f"no step times within {timeout_s:.0f} s: the process was stopped") from None
    if done.stderr.strip():
        _log.debug("llama.cpp row's stderr:\n%s", done.stderr)
    last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        if name in ("SIGSEGV", "SIGILL"):  # the wheel's native code: the AMX fault seen, or an instruction it lacks
            raise LlamaCppFailed(f"killed by {name}; {LLAMA_CPP_CRASH_FIX}")
        raise LlamaCppFailed(f"killed by {name}: {last}")
    if done.returncode > 0:
        raise LlamaCppFailed(f"exited with status {done.returncode}: {last}")
    try:
        step_ns = json.loads(done.stdout.strip().splitlines()[-1])["step_ns"]
    except (IndexError, KeyError, json.JSONDecodeError):
        raise LlamaCppFailed(f"no step times on its stdout ({done.stdout.strip()[-200:]!r}): {last}") from None
    rate, step_ms = decode_rate([(i, 1, ns) for i, ns in enumerate(step_ns)], warmup)
    kv_f16_bytes = dims.n_layers * context * 2 * dims.n_kv_heads * dims.head_dim * 2  # llama.cpp's default f16 cache
    return Run(LLAMA_CPP_ROW, None, 1, context, rate, None, kv_f16_bytes / 2**20, 0.0, None, None, 0.0, 0.0, step_ms)


def table(runs: list[Run]) -> str:
    width = max([20] + [len(r.policy) for r in runs])
    head = (f"{'batch':>5} {'ctx':>6} {'policy':{width}} {'budget':>6} {'tok/s':>8} {'x full':>7} {'KV MiB':>7} "
            f"{'KiB/tok':>8} {'eff MiB/s':>9} {'vs disk':>7} {'reuse':>5} {'stall':>5} {'G':>3} {'M':>4} {'C':>4} "
            f"{'sigma':>5} {'paths':>5} {'req/step':>8} {'KiB/req':>7} {'clust':>5} {'fix/step':>8} {'recall':>6} "
            f"{'overlap':>7} {'syncs':>5} {'copied':>6}")
    lines = [head]
    for r in runs:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        kib_per_request = r.bytes_per_request / 1024 if r.bytes_per_request is not None else None
        lines.append(f"{r.batch:>5} {r.context:>6} {r.policy:{width}} {r.budget or '-':>6} {r.decode_tok_s:8.1f} "
                     f"{f(r.ratio_to_full, '.2f'):>7} {r.kv_resident_mib:7.1f} {r.read_bytes_per_token / 1024:8.1f} "
                     f"{f(r.eff_read_bw_mib_s, '.0f'):>9} {f(r.eff_bw_vs_profile, '.2f'):>7} {r.reuse_rate:5.2f} "
                     f"{r.io_stall_share:5.2f} {f(r.G, 'd'):>3} {f(r.M, 'd'):>4} {f(r.C, 'd'):>4} {f(r.sigma, 'g'):>5} "
                     f"{f(r.n_paths, 'd'):>5} {f(r.requests_per_step, '.1f'):>8} {f(kib_per_request, '.1f'):>7} "
                     f"{r.clustering or '-':>5} {f(r.correction_records_per_step, '.1f'):>8} "
                     f"{f(r.guess_recall, '.3f'):>6} {f(r.overlap_efficiency, '.2f'):>7} "
                     f"{f(r.host_syncs_per_step, '.1f'):>5} {f(r.copied_vs_read, '.2f'):>6}")
    return "\n".join(lines)


def notes(meta: dict) -> str:
    """What the rows over several KV paths found beyond the table: how devices were emulated, each replacement
    policy's hit rate on one trace, and the bytes prefix dedup saved."""
    if "paths" not in meta:
        return ""
    lines = [f"KV paths: {meta['paths']['emulation']}"]
    lines += [f"reuse hit rate, {key} ({meta['paths']['replay']}): "
              + ", ".join(f"{name} {rate:.3f}" for name, rate in rates.items())
              for key, rates in meta["replacement_replay"].items()]
    lines += [f"dedup, {key}: {d['batch']} questions of {d['question_tokens']} tokens over one {d['document_tokens']}-token "
              f"document read {d['bytes_with'] / 2**20:.1f} MiB with dedup, {d['bytes_without'] / 2**20:.1f} MiB without "
              f"(x{d['ratio']:.2f})" if d["ratio"] is not None else f"dedup, {key}: nothing read"
              for key, d in meta["dedup"].items()]
    return "\n".join(lines)


def plot(runs: list[Run], png: Path) -> None:
    """Throughput vs batch per policy (KVSwap Tab. 4), kvswap step time vs context, and the per-layer
    latency breakdown of each row at the largest context and batch (Fig. 13a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    context = max(r.context for r in runs)
    for i, key in enumerate(dict.fromkeys((r.policy, r.budget) for r in runs)):
        rows = sorted((r for r in runs if (r.policy, r.budget) == key and r.context == context), key=lambda r: r.batch)
        if rows:
            ax1.plot([r.batch for r in rows], [r.decode_tok_s for r in rows], "-o", color=f"C{i % 10}",
                     label=key[0] + (f" {key[1]}" if key[1] else ""))
        rows = sorted((r for r in runs if (r.policy, r.budget) == key), key=lambda r: r.context)
        if key[0] == TUNED_ROW and len({r.context for r in rows}) > 1:
            for b in sorted({r.batch for r in rows}):
                sub = [r for r in rows if r.batch == b]
                ax2.plot([r.context for r in sub], [r.step_ms for r in sub], "-o", label=f"kvswap {key[1]} b={b}")
    batch = max(r.batch for r in runs if r.context == context)
    last = [r for r in runs if r.context == context and r.batch == batch and r.layer_ms]
    bottom = np.zeros(len(last))
    for part, color in (("compute", "C0"), ("select", "C1"), ("io_stall", "C3"), ("correct", "C2")):
        values = np.array([r.layer_ms.get(part, 0.0) for r in last])
        ax3.bar(range(len(last)), values, bottom=bottom, color=color, label=part)
        bottom += values
    ax3.set_xticks(range(len(last)), [r.policy + (f"\n{r.budget}" if r.budget else "") for r in last], fontsize=7,
                   rotation=30)
    ax1.set(xlabel="batch", ylabel="decode tokens/s", title=f"context {context}")
    ax2.set(xlabel="context (tokens)", ylabel="ms per decode step", title="kvswap step time vs context")
    ax3.set(ylabel="ms per layer per step", title=f"latency per layer, batch {batch}, context {context}")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if not ax2.lines:
        ax2.text(0.5, 0.5, "one context: run with several --contexts", ha="center", va="center", transform=ax2.transAxes)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run(model_dir: Path, kv_path: Path, batches: list[int], contexts: list[int], budgets: list[str], steps: int,
        warmup: int, disk_seconds: float, policies: list[str], log=print, quiet: bool = False,
        chosen_from: str | None = None, record_dtypes=("auto",), kv_paths: list[Path] | None = None,
        path_limit_mib_s: float | None = None, path_limit_iops: float | None = None,
        prompt_source: str = "random", device: str | None = None, dtype: str | None = None, on_point=None,
        weights: str | None = None, on_row=None) -> tuple[list[Run], dict]:
    """Every point's rows; ``kv_paths`` adds the kvswap/Np rows, each path paced to ``path_limit_mib_s`` and
    ``path_limit_iops`` (None: unlimited) to emulate that many devices, while ``kv_path`` holds the other rows.
    ``prompt_source``: "random" tokens or the eval's "tasks" (``task_prompts``).  ``device``/``dtype``: what the
    rows compute in (default: $EDGEKV_DEVICE or the GPU, and its dtype; runtime/devices.py).  ``on_point(runs)``:
    called with every row so far after each point (a caller keeps what finished if a later point is cut off);
    ``on_row(runs)`` likewise after each row (a point's rows before its end lack their ratio to full)."""
    if prompt_source not in PROMPT_SOURCES:
        raise ValueError(f"prompt_source must be one of {PROMPT_SOURCES}, got {prompt_source!r}")
    from edgekv.runtime.devices import resolve_compute
    from edgekv.runtime.model import load_model

    if not kv_paths and (path_limit_mib_s is not None or path_limit_iops is not None):
        raise ValueError("a per-path read limit paces the rows over several KV paths: give the folders too "
                         "(--kv-paths DIR1,DIR2,...)")
    kv_path.mkdir(parents=True, exist_ok=True)
    model = load_model(model_dir, *resolve_compute(device, dtype, model_dir), max(contexts) + 64, weights or "native")
    limits = solver.Limits()
    log(f"disk profile of {kv_path} ({disk_seconds:g} s, fio beside our reader)")
    disk_profile = diskprof.profile_disk(kv_path, disk_seconds, 256, block_sizes=(4096, 16384, 65536, 262144),
                                         queue_depths=(QUEUE_DEPTH,))
    ranks = sorted({LowRankAdapter.rank_for(model.dims.n_kv_heads, model.dims.head_dim, s) for s in solver.SIGMAS})
    compute_profile = profile_compute(model, {}, sorted(set(batches)), sorted(set(contexts)), ranks, limits.mg_const)
    reuse_table, source = cached_reuse_table(model_dir)
    log(f"reuse rate for the solver: {source}")
    gguf, llama_note = llama_cpp_source(model_dir, policies)
    log(f"llama.cpp row: {llama_note}")
    points = [(c, b) for c in contexts for b in batches]
    runs, found = [], {name: {} for name in FOUND}
    with Progress(len(points), "bench points", quiet) as progress:
        for context, batch in points:
            with progress.cell(f"batch {batch}, context {context}") as on_event:
                rows, point = bench_point(model, kv_path, batch, context, budgets, steps, warmup, limits, disk_profile,
                                          compute_profile, policies, reuse_table, progress.write, gguf, on_event,
                                          recorded_configs(chosen_from) if chosen_from else {}, record_dtypes,
                                          kv_paths, path_limit_mib_s, path_limit_iops,
                                          partial(task_prompts, model_dir) if prompt_source == "tasks" else None,
                                          None if on_row is None else (lambda rows: on_row(runs + rows)))
            runs += rows
            for name, by_key in point.items():
                found[name].update(by_key)
            if on_point is not None:
                on_point(runs)
    meta = {"model": str(model_dir), "steps": steps, "warmup_steps": warmup, "queue_depth": QUEUE_DEPTH,
            "prompts": prompt_source,
            "disk": {"reference": disk_profile.reference, "reader": disk_profile.reader, "o_direct": disk_profile.o_direct,
                     "points": [asdict(p) for p in disk_profile.points]},
            "threads": torch.get_num_threads(), "reuse_table": source, "llama_cpp": llama_note,
            "quality_configs_from": chosen_from, "record_dtypes": list(record_dtypes),
            "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."), "weights": model.weights,
            "synthetic_weights": model.synthetic}  # random weights in a real shape: timings and memory only
    failed = found.pop("llama_cpp_failed")
    if failed:  # per "{batch}x{context}": why that point has no llama.cpp row (the signal and the fix)
        meta["llama_cpp_failed"] = failed
    if kv_paths:
        meta["paths"] = emulation(kv_paths, path_limit_mib_s, path_limit_iops, disk_profile, runs)
        meta.update(found)
    return runs, meta


def emulation(kv_paths: list[Path], limit_mib_s: float | None, limit_iops: float | None, disk_profile,
              runs: list[Run]) -> dict:
    """How the kvswap/Np rows emulate N devices here, and whether the real disk can carry N links at once (if not,
    the largest N is capped by the disk, not by the emulated devices)."""
    devices = len({os.stat(p).st_dev for p in kv_paths})
    counts = path_counts(len(kv_paths))
    largest_request = RuntimeConfig().io.max_request_bytes
    real_mib_s = disk_profile.read_mib_s(largest_request, QUEUE_DEPTH, source="disk")
    limits = " and ".join(f"{v:g} {unit}" for v, unit in ((limit_mib_s, "MiB/s"), (limit_iops, "IOPS")) if v is not None)
    shared = f"{len(kv_paths)} KV folder(s) on {devices} real device(s), each KV path its own read queue (MultiPathReader)"
    if limits:
        how = (f"{shared} behind a virtual link of {limits} (PacedReader, a token bucket: a read returns once its link "
               f"has carried its bytes and requests, the real read overlapping that time), so N paths carry at most "
               f"N x {limits}; N = 1 is paced too")
    else:
        how = f"{shared}, unpaced: the N queues share the real device(s), so rows differ only in queues, layout and requests"
    if limit_mib_s is not None and counts[-1] * limit_mib_s > real_mib_s:
        how += (f"; the real disk gives {real_mib_s:.0f} MiB/s at {largest_request // 1024} KiB, less than "
                f"{counts[-1]} x {limit_mib_s:g}: the largest N is capped by the disk")
    return {"kv_paths": [str(p) for p in kv_paths], "n_paths": counts, "path_limit_mib_s": limit_mib_s,
            "path_limit_iops": limit_iops, "distinct_devices": devices,
            "real_disk_mib_s": real_mib_s, "real_disk_block_bytes": largest_request,
            "readers": sorted({r.reader for r in runs if r.policy.startswith("kvswap/") and r.reader}),
            "emulation": how,
            "replay": "the largest N clustered fifo row's picks replayed through a fresh reuse buffer of C slots per "
                      "layer for each policy (cost without the prompt's prior); a configuration without a reuse buffer "
                      "has C = M: what such a buffer would hit, beyond its budget"}


def llama_cpp_source(model_dir: Path, policies: list[str]) -> tuple[Path | None, str]:
    """The GGUF for the llama.cpp row when that row is asked for and can run, and what the row will be."""
    import importlib.util

    if "llama.cpp" not in policies:
        return None, "not asked for"
    gguf = gguf_source(model_dir)
    if gguf is None:
        return None, "none: the model is not a GGUF file"
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "none: llama-cpp-python is not installed (pip install 'edgekv[llamacpp]')"
    try:  # its own dependencies load here: one missing is named now, not in a traceback after the other rows ran
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return None, (f"none: llama-cpp-python is installed but does not import ({exc}); install it with its "
                      "dependencies: pip install 'edgekv[llamacpp]'")
    return gguf, f"{gguf.name} at batch 1 (llama-cpp-python runs one sequence; f16 KV in memory)"


def cached_reuse_table(model_dir: Path) -> tuple[dict | None, str]:
    """The install step's reuse lookup table for this model when `make deploy` has built it."""
    from edgekv.runtime.checkpoints import cache_root, checkpoint_fingerprint

    path = cache_root() / "tables" / checkpoint_fingerprint(Path(model_dir)) / "tables.json"
    if not path.is_file():
        return None, "none cached (run make deploy for this model); the solver assumes no reuse"
    return tables.load_tables(path)[0], str(path)


def write_json(path: Path, runs: list[Run], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))

