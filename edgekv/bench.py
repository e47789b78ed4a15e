"""`edgekv bench`: every policy side by side, one model, one prompt set, one run.

Rows per (batch, context): ``full`` (all KV in memory), ``flexgen`` (the whole layer read from
disk each step, unconstrained), and at each budget (a fraction of the full cache for the batch)
``token`` (G=1, no reuse), ``kvswap-noreuse`` and ``kvswap`` as the install step's solver tunes it
for this machine (disk profile, block compute profile of this model), and ``arkv`` (in memory: the
budget holds original and quantized tokens, the rest evicted).  Honesty rules:
- every prompt is prefilled once and replayed into each policy (same K/V, same disk writes),
  so only decode is compared and only decode is timed;
- decode time comes from the engine's step events; the first ``warmup`` steps are excluded;
- KV reads are O_DIRECT where the filesystem allows (reported per row), so the page cache
  does not serve them;
- the achieved read rate (bytes read / time inside reads) is set beside the profiled
  random-read bandwidth at the same block size and queue depth.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from edgekv.install import disk as diskprof
from edgekv.install import solver, tables
from edgekv.install.compute import profile_compute
from edgekv.evals.harness import recorded_configs
from edgekv.evals.progress import Progress
from edgekv.install.iomodel import io_model
from edgekv.runtime import Engine, RecordLayout, RuntimeConfig
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.checkpoints import gguf_source
from edgekv.runtime.config import IN_MEMORY_POLICIES
from edgekv.runtime.model import DecoderModel
from edgekv.runtime.prompt_cache import PromptKVCache

QUEUE_DEPTH = 32
DISK_ROWS = ("kvswap", "token", "flexgen")  # the rows that read records from disk (repeated per --record-dtype)


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
    layer_ms: dict | None = None  # per layer and decode step: select (predict + slots), io_stall, compute (the rest)
    G: int | None = None
    M: int | None = None
    C: int | None = None
    sigma: float | None = None
    o_direct: bool | None = None
    sink_tokens: int | None = None
    window_tokens: int | None = None
    klr_dtype: str | None = None  # the K_lr rows' format (int8 halves their bytes at the same sigma)
    kv_record_dtype: str | None = None  # the disk records' format (the disk rows)


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


def policy_configs(model: DecoderModel, batch: int, context: int, budgets: list[str], limits: solver.Limits,
                   disk_profile, compute_profile, reuse_table: dict | None = None, chosen: dict | None = None,
                   record_dtypes=("auto",)) -> list[tuple[str, str | None, dict]]:
    """(row name, budget label, runtime config) for every row of one (batch, context); ``kvswap-quality``
    rows run the configurations of ``chosen`` (edgekv.evals.harness.recorded_configs) at this batch.  Each disk
    row (kvswap*, token, flexgen) comes once per ``kv_record_dtype`` of ``record_dtypes``, same configuration."""
    dims = model.dims
    base = {"max_context": context, "max_batch": batch, "io_align_bytes": limits.io_align_bytes,
            "io_queue_depth": QUEUE_DEPTH}
    rows = [("full", None, {**base, "G": 4, "M": 1, "C": 1, "sigma": 8}),
            ("flexgen", None, {**base, "G": limits.g_max, "M": 1, "C": 1, "sigma": 8, "reuse": False})]
    itemsize = torch.empty(0, dtype=model.dtype).element_size()
    full_bytes = dims.n_layers * context * 2 * dims.n_kv_heads * dims.head_dim * itemsize
    t_io = io_model(disk_profile, dims, model.dtype, limits.io_align_bytes, QUEUE_DEPTH)
    for label in budgets:
        num, _, den = label.partition("/")
        per_seq = float(num) / float(den) * full_bytes
        budget_mib = per_seq * batch / 2**20
        tuned = solver.solve(batch, context, per_seq, dims, model.dtype, limits, t_io, compute_profile.t_model_ms,
                             lambda G, C, M: tables.reuse_rate(reuse_table or {}, G, C, M))
        token = solver.fit_memory(per_seq, dims, model.dtype, limits, context, 1, reuse=False)
        noreuse = solver.fit_memory(per_seq, dims, model.dtype, limits, context, tuned.G, reuse=False)
        for name, fit, reuse in (("token", token, False), ("kvswap-noreuse", noreuse, False), ("kvswap", tuned, tuned.reuse)):
            if fit is None:
                continue
            rows.append((name, label, {**base, "G": fit.G, "M": fit.M, "C": fit.C, "sigma": fit.sigma, "reuse": reuse,
                                       "max_kv_mem_mib": budget_mib}))
        rows.append(("arkv", label, {**base, "G": 4, "M": 1, "C": 1, "sigma": 8, "max_kv_mem_mib": budget_mib}))
        if (context, label) in (chosen or {}):
            rows.append(("kvswap-quality", label, {**base, **chosen[(context, label)], "max_kv_mem_mib": budget_mib}))
    return [(name, label, {**cfg, "kv_record_dtype": record}) for name, label, cfg in rows
            for record in (record_dtypes if name.startswith(DISK_ROWS) else ("auto",))]


def bench_point(model: DecoderModel, kv_dir: Path, batch: int, context: int, budgets: list[str], steps: int,
                warmup: int, limits: solver.Limits, disk_profile, compute_profile, policies, reuse_table=None,
                log=print, gguf: Path | None = None, on_event=None, chosen: dict | None = None,
                record_dtypes=("auto",)) -> list[Run]:
    """Every row at one (batch, context); with ``gguf`` (the model's source file, llama-cpp-python importable)
    also the llama.cpp row at batch 1."""
    g = torch.Generator().manual_seed(batch * 100003 + context)
    vocab = model.dims.vocab
    prompt_len = context - steps - warmup - 8
    prompts = [torch.randint(4, vocab, (prompt_len - 4 * i,), generator=g).tolist() for i in range(batch)]
    cache = PromptKVCache()
    runs: list[Run] = []
    full_rate = None
    for name, budget, cfg in policy_configs(model, batch, context, budgets, limits, disk_profile, compute_profile,
                                            reuse_table, chosen, record_dtypes):
        if name not in policies:
            continue
        label = name if cfg["kv_record_dtype"] == "auto" else f"{name},{cfg['kv_record_dtype']}"
        policy = "kvswap" if name.startswith("kvswap") else name
        timer = StepTimer()
        with Engine(model, RuntimeConfig.load(cfg), policy, kv_dir) as engine:
            engine.prompt_cache = cache
            engine.events.subscribe(timer)
            if on_event is not None:
                engine.events.subscribe(on_event)
            out = engine.generate(prompts, max_new_tokens=steps + warmup + 1, stop_token_ids=[])
        rate, step_ms = decode_rate(timer.steps, warmup)
        s = [r.stats for r in out]
        decoded = sum(x["generated_tokens"] - 1 for x in s)
        read = sum(x["kv_bytes_read"] for x in s)
        eff = effective_bandwidth(read, s[0]["io_read_s"])
        stride = RecordLayout(cfg["G"], model.dims.n_kv_heads, model.dims.head_dim, model.dtype,
                              limits.io_align_bytes, cfg["kv_record_dtype"]).stride_bytes
        profile_bw = disk_profile.read_mib_s(stride, QUEUE_DEPTH, source="disk") if name not in IN_MEMORY_POLICIES else None
        if name == "full":
            full_rate = rate
        per_layer = 1e3 / (len(timer.steps) * model.dims.n_layers)  # whole run (warm-up included), ms per layer-step
        parts = {"select": s[0]["select_s"] * per_layer, "io_stall": s[0]["io_stall_s"] * per_layer}
        parts["compute"] = max(0.0, s[0]["decode_s"] * per_layer - parts["select"] - parts["io_stall"])
        run = Run(label, budget, batch, context, rate, None, s[0]["kv_resident_bytes"] / 2**20, read / decoded, eff,
                  ratio(eff, profile_bw), float(np.mean([x["reuse_rate"] for x in s])), s[0]["io_stall_share"], step_ms,
                  parts, cfg["G"] if name not in IN_MEMORY_POLICIES else None, cfg["M"] if name.startswith(("kvswap", "token")) else None,
                  cfg["C"] if name == "kvswap" else None, cfg["sigma"] if name.startswith(("kvswap", "token")) else None,
                  s[0]["o_direct"], *((cfg.get("sink_tokens", 0), cfg.get("window_tokens", 0), cfg.get("klr_dtype", "bfloat16"))
                                      if name.startswith("kvswap") else ()),
                  kv_record_dtype=cfg["kv_record_dtype"] if name.startswith(DISK_ROWS) else None)
        runs.append(run)
        log(f"  {label:20s} {budget or '':5s} {run.decode_tok_s:9.1f} tok/s  step {run.step_ms:7.2f} ms")
    if gguf is not None and batch == 1:
        runs.append(llama_cpp_run(gguf, model.dims, prompts[0], context, steps, warmup))
        log(f"  {'llama.cpp':20s} {'':5s} {runs[-1].decode_tok_s:9.1f} tok/s  step {runs[-1].step_ms:7.2f} ms")
    for run in runs:
        run.ratio_to_full = ratio(run.decode_tok_s, full_rate)
    return runs


def llama_cpp_run(gguf: Path, dims, prompt: list[int], context: int, steps: int, warmup: int) -> Run:
    """llama.cpp on the same GGUF at batch 1 (its own quantized weights, the whole f16 KV in memory, as many
    threads as torch uses): the reference a user would otherwise pick.  Decode steps are timed one by one
    around ``eval`` of the greedy token, the first ``warmup`` excluded, like the engine's step events."""
    import time

    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)
    try:
        llm.eval(prompt)
        step_ns = []
        for _ in range(warmup + steps):
            # without logits_all the high-level API keeps no scores: read the last token's logits from the context
            token = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))))
            start = time.perf_counter_ns()
            llm.eval([token])
            step_ns.append(time.perf_counter_ns() - start)
    finally:
        llm.close()
    rate, step_ms = decode_rate([(i, 1, ns) for i, ns in enumerate(step_ns)], warmup)
    kv_f16_bytes = dims.n_layers * context * 2 * dims.n_kv_heads * dims.head_dim * 2  # llama.cpp's default f16 cache
    return Run("llama.cpp", None, 1, context, rate, None, kv_f16_bytes / 2**20, 0.0, None, None, 0.0, 0.0, step_ms)


def table(runs: list[Run]) -> str:
    head = (f"{'batch':>5} {'ctx':>6} {'policy':20} {'budget':>6} {'tok/s':>8} {'x full':>7} {'KV MiB':>7} "
            f"{'KiB/tok':>8} {'eff MiB/s':>9} {'vs disk':>7} {'reuse':>5} {'stall':>5} {'G':>3} {'M':>4} {'C':>4} {'sigma':>5}")
    lines = [head]
    for r in runs:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        lines.append(f"{r.batch:>5} {r.context:>6} {r.policy:20} {r.budget or '-':>6} {r.decode_tok_s:8.1f} "
                     f"{f(r.ratio_to_full, '.2f'):>7} {r.kv_resident_mib:7.1f} {r.read_bytes_per_token / 1024:8.1f} "
                     f"{f(r.eff_read_bw_mib_s, '.0f'):>9} {f(r.eff_bw_vs_profile, '.2f'):>7} {r.reuse_rate:5.2f} "
                     f"{r.io_stall_share:5.2f} {f(r.G, 'd'):>3} {f(r.M, 'd'):>4} {f(r.C, 'd'):>4} {f(r.sigma, 'g'):>5}")
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
        if key[0] == "kvswap" and len({r.context for r in rows}) > 1:
            for b in sorted({r.batch for r in rows}):
                sub = [r for r in rows if r.batch == b]
                ax2.plot([r.context for r in sub], [r.step_ms for r in sub], "-o", label=f"kvswap {key[1]} b={b}")
    batch = max(r.batch for r in runs if r.context == context)
    last = [r for r in runs if r.context == context and r.batch == batch and r.layer_ms]
    bottom = np.zeros(len(last))
    for part, color in (("compute", "C0"), ("select", "C1"), ("io_stall", "C3")):
        values = np.array([r.layer_ms[part] for r in last])
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


def run(model_dir: Path, kv_dir: Path, batches: list[int], contexts: list[int], budgets: list[str], steps: int,
        warmup: int, disk_seconds: float, policies: list[str], log=print, quiet: bool = False,
        chosen_from: str | None = None, record_dtypes=("auto",)) -> tuple[list[Run], dict]:
    from edgekv.runtime.model import load_model

    kv_dir.mkdir(parents=True, exist_ok=True)
    model = load_model(model_dir, torch.device("cpu"), torch.float32, max(contexts) + 64)
    limits = solver.Limits()
    log(f"disk profile of {kv_dir} ({disk_seconds:g} s, fio beside our reader)")
    disk_profile = diskprof.profile_disk(kv_dir, disk_seconds, 256, block_sizes=(4096, 16384, 65536, 262144),
                                         queue_depths=(QUEUE_DEPTH,))
    ranks = sorted({LowRankAdapter.rank_for(model.dims.n_kv_heads, model.dims.head_dim, s) for s in solver.SIGMAS})
    compute_profile = profile_compute(model, {}, sorted(set(batches)), sorted(set(contexts)), ranks, limits.mg_const)
    reuse_table, source = cached_reuse_table(model_dir)
    log(f"reuse rate for the solver: {source}")
    gguf, llama_note = llama_cpp_source(model_dir, policies)
    log(f"llama.cpp row: {llama_note}")
    points = [(c, b) for c in contexts for b in batches]
    runs = []
    with Progress(len(points), "bench points", quiet) as progress:
        for context, batch in points:
            with progress.cell(f"batch {batch}, context {context}") as on_event:
                runs += bench_point(model, kv_dir, batch, context, budgets, steps, warmup, limits, disk_profile,
                                    compute_profile, policies, reuse_table, progress.write, gguf, on_event,
                                    recorded_configs(chosen_from) if chosen_from else {}, record_dtypes)
    meta = {"model": str(model_dir), "steps": steps, "warmup_steps": warmup, "queue_depth": QUEUE_DEPTH,
            "disk": {"reference": disk_profile.reference, "reader": disk_profile.reader, "o_direct": disk_profile.o_direct,
                     "points": [asdict(p) for p in disk_profile.points]},
            "threads": torch.get_num_threads(), "reuse_table": source, "llama_cpp": llama_note,
            "quality_configs_from": chosen_from, "record_dtypes": list(record_dtypes)}
    return runs, meta


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
    return gguf, f"{gguf.name} at batch 1 (llama-cpp-python runs one sequence; f16 KV in memory)"


def cached_reuse_table(model_dir: Path) -> tuple[dict | None, str]:
    """The install step's reuse lookup table for this model when `make deploy` has built it."""
    import os

    from edgekv.deploy import model_fingerprint

    root = Path(os.environ.get("EDGEKV_CACHE") or Path.home() / ".cache" / "edgekv")
    path = root / "tables" / model_fingerprint(Path(model_dir)) / "tables.json"
    if not path.is_file():
        return None, "none cached (run make deploy for this model); the solver assumes no reuse"
    return tables.load_tables(path)[0], str(path)


def write_json(path: Path, runs: list[Run], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))

