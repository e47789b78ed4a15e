"""`edgekv ttft`: time to first token of a prompt whose context is stored, four ways side by side.

Per context length a context (real text) is saved once to a context store on the KV disk; the
prompt is that context plus a question.  ``full_prefill`` computes the whole prompt;
``load_only``, ``bidirectional`` (Cake) and ``edgekv`` (SparKV's plan + runtime adaptation)
reuse the stored KV, each at every link rate: the store's reads are paced to the rate
(``ThrottledBackend``, O_DIRECT reads under it), and ``--drop-at F`` halves the rate once F of
the load-only time at the nominal rate has passed.  Every method then greedily decodes a few
tokens, compared with full prefill's.  The rate at which load-only and full prefill take the
same time (``crossover``) is always measured too.  TTFT is the engine's prefill time of the
prompt (store lookup, loads, computes and the question's compute); energy per request where
a power meter exists.
"""
from __future__ import annotations

import json
import tempfile
import time

import numpy as np
from dataclasses import asdict, dataclass
from pathlib import Path

from edgekv.evals.perplexity import load_text, tokenize
from edgekv.evals.progress import Progress
from edgekv.runtime import Engine
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.store import ThrottledBackend
from edgekv.runtime.ttft.costs import load_s
from edgekv.runtime.ttft.grid import ChunkGrid
from edgekv.runtime.ttft.prefill import METHODS, TTFTOptions

QUESTION_TOKENS = 32
STORED_METHODS = tuple(m for m in METHODS if m != "full_prefill")
COUNTS = ("stored_tokens", "loaded", "computed", "bytes_loaded", "to_compute", "to_load", "failed_loads", "recomputed")


@dataclass
class TTFTRun:
    method: str
    context: int
    link_mib_s: float | None
    ttft_s: float
    tokens_match_full: bool
    drop_at: float | None = None
    crossover: bool = False  # the rate at which load-only takes as long as full prefill
    stored_tokens: int = 0
    loaded: int = 0
    computed: int = 0
    bytes_loaded: int = 0
    to_compute: int = 0
    to_load: int = 0
    failed_loads: int = 0
    recomputed: int = 0
    plan_s: float | None = None
    chunks_s: float | None = None  # the load/compute phase alone (the executor's wall time)
    overlap_bound_s: float | None = None  # no schedule of the stored chunks can be faster (see overlap_bound_s)
    energy_j: float | None = None


def _meter(quiet_log):
    from edgekv.platforms.power.base import MeterUnavailable
    from edgekv.platforms.power.select import open_meter

    try:
        meter = open_meter("auto")
        meter.start()
        return meter
    except (MeterUnavailable, OSError) as exc:
        quiet_log(f"no power meter here ({exc}): energy per request not measured")
        return None


def install_costs(model, chunk_tokens: int, contexts: list[int], progress) -> tuple[object, dict]:
    """The install step's compute profile of this model's chunks and the predictor fit on it; the report
    (predictor and roofline errors on held-out chunks) goes into the bench's JSON."""
    from edgekv.install.chunk_profile import fit_predictor, fit_report, profile_chunks

    lengths = sorted({max(chunk_tokens // 2, 16), chunk_tokens})
    points = sorted({c for c in (1024, 2048, 4096, *contexts) if c <= max(contexts)})
    progress.write(f"profiling chunk compute ({lengths} tokens up to {max(contexts)}) for the predictor")
    profile = profile_chunks(model, chunk_tokens_list=lengths, contexts=points)
    report = fit_report(profile)
    return fit_predictor(profile), {"source": "install.chunk_profile (fit here)", "errors": report["errors"]}


def run(model: str, contexts: list[int], link_rates: list[float], drop_at: float | None, kv_path: str | Path | None,
        chunk_tokens: int = 512, new_tokens: int = 8, costs=None, quiet: bool = False, text: str = "builtin",
        meta: dict | None = None, device: str | None = None, dtype: str | None = None) -> list[TTFTRun]:
    """Every method at every (context, link rate); ``meta`` (when given) receives the cost model's report."""
    meta = {} if meta is None else meta
    model_dir = resolve_checkpoint(model)
    corpus, _ = load_text(text)
    ids, _ = tokenize(model_dir, corpus)
    if len(ids) < max(contexts):
        raise ValueError(f"the {text} text has {len(ids)} tokens, fewer than the largest context {max(contexts)}")
    config = {"max_context": max(contexts) + new_tokens + 1}
    runs: list[TTFTRun] = []
    cells = len(contexts) * (1 + len(STORED_METHODS) * (len(link_rates) + 1))
    with tempfile.TemporaryDirectory(prefix="edgekv-ttft-", dir=kv_path) as store_dir, \
            Engine.from_pretrained(model_dir, config=config, policy="full", device=device, dtype=dtype) as engine, \
            Progress(cells, "ttft", quiet) as progress:
        meter = _meter(progress.write)
        if costs is None:
            costs, meta["costs"] = install_costs(engine.model, chunk_tokens, contexts, progress)
        windows: list[tuple[int, int]] = []  # per run, monotonic ns: the meter's trace is cut into them at the end
        store = engine.open_context_store(store_dir, chunk_tokens=chunk_tokens)
        inner = store.backend
        for context in contexts:
            prompt = ids[:context]
            stored = engine.save_context(prompt[: context - QUESTION_TOKENS])

            def timed(method: str, rate: float | None, drop_s: float | None):
                engine.ttft = TTFTOptions(method, compute_costs=costs, link_mib_s=rate)
                store.backend = ThrottledBackend(inner, rate, drop_at_s=drop_s) if rate else inner
                if rate:
                    store.backend.start()
                with progress.cell(f"{method} {context} @{rate or '-'} MiB/s"):
                    t0 = time.monotonic_ns()
                    result = engine.generate([prompt], max_new_tokens=new_tokens)[0]
                    windows.append((t0, time.monotonic_ns()))
                return result, engine.prefill_stats[0] if engine.prefill_stats else {}

            full, _ = timed("full_prefill", None, None)
            runs.append(TTFTRun("full_prefill", context, None, full.stats["prefill_s"], True))
            grid = ChunkGrid(stored.n_tokens, store.chunk_tokens, engine.model.dims.n_layers)
            chunk_bytes = np.array([store.read_bytes_per_chunk_layer(ref) for ref in stored.chunks], float)
            total_bytes = float(chunk_bytes.sum()) * grid.n_layers
            crossover = total_bytes / full.stats["prefill_s"] / 2**20
            for rate in [*link_rates, crossover]:
                drop_s = drop_at * total_bytes / (rate * 2**20) if drop_at else None
                bound = overlap_bound_s(costs.compute_s(grid), load_s(grid, chunk_bytes, rate))
                for method in STORED_METHODS:
                    result, stats = timed(method, rate, drop_s)
                    counts = {k: stats.get(k, 0) for k in COUNTS}
                    runs.append(TTFTRun(method, context, round(rate, 1), result.stats["prefill_s"],
                                        result.token_ids == full.token_ids, drop_at=drop_at, crossover=rate == crossover,
                                        plan_s=stats.get("plan_s"), chunks_s=stats.get("wall_s"), overlap_bound_s=bound,
                                        **counts))
                    progress.write(_line(runs[-1]))
        if meter is not None:
            trace = meter.stop()
            meter.close()
            for r, (t0, t1) in zip(runs, windows):
                r.energy_j = trace.energy_j(t0, t1) if not trace.error and len(trace.samples) > 1 else None
    return runs


def overlap_bound_s(compute_s: np.ndarray, load_s: np.ndarray) -> float:
    """A lower bound on any two-path schedule of these chunks: dependencies dropped and every chunk split
    between the paths at will (fractional), the makespan balances both paths.  Chunks go to compute in
    order of compute/load ratio; the balance point is found on that order."""
    c, s = compute_s.ravel(), load_s.ravel()
    order = np.argsort(c / np.maximum(s, 1e-12))
    c, s = c[order], s[order]
    computed = np.concatenate([[0.0], np.cumsum(c)])  # first k chunks computed
    loaded = np.concatenate([np.cumsum(s[::-1])[::-1], [0.0]])  # the rest loaded
    k = int(np.argmax(computed >= loaded))  # first k where compute catches up: the balance lies in chunk k-1
    if k == 0:
        return float(loaded[0]) if computed[0] >= loaded[0] else 0.0
    c_prev, l_prev, ck, sk = computed[k - 1], loaded[k - 1], c[k - 1], s[k - 1]
    f = (l_prev - c_prev) / max(ck + sk, 1e-12)  # fraction of chunk k-1 computed at the balance
    return float(c_prev + f * ck)


def _line(r: TTFTRun) -> str:
    return (f"{r.method:>13} ctx {r.context:>6} link {r.link_mib_s or 0:>7.1f} MiB/s  TTFT {r.ttft_s:7.3f} s  "
            f"chunks {r.chunks_s or 0:6.3f} s (bound {r.overlap_bound_s or 0:6.3f})  loaded {r.loaded:>4} "
            f"computed {r.computed:>4} moved {r.to_compute}/{r.to_load}  match {r.tokens_match_full}")


def table(runs: list[TTFTRun]) -> str:
    """TTFT per (context, link rate): each method's seconds and edgekv's speed-up over the best other."""
    lines = [f"{'context':>7} {'link MiB/s':>10} " + " ".join(f"{m:>13}" for m in METHODS) + f" {'best/edgekv':>11}"]
    full = {r.context: r.ttft_s for r in runs if r.method == "full_prefill"}
    keys = sorted({(r.context, r.link_mib_s) for r in runs if r.link_mib_s})
    for context, rate in keys:
        row = {r.method: r.ttft_s for r in runs if r.context == context and r.link_mib_s == rate}
        row["full_prefill"] = full[context]
        best_other = min(v for m, v in row.items() if m != "edgekv")
        cross = "*" if any(r.crossover for r in runs if r.context == context and r.link_mib_s == rate) else " "
        lines.append(f"{context:>7} {rate:>9.1f}{cross} " + " ".join(f"{row.get(m, float('nan')):>13.3f}" for m in METHODS)
                     + f" {best_other / row['edgekv']:>10.2f}x")
    return "\n".join(lines)


def plot(runs: list[TTFTRun], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r.context for r in runs})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        full = next(r.ttft_s for r in runs if r.method == "full_prefill" and r.context == context)
        ax.axhline(full, color="k", linestyle="--", label="full_prefill")
        for method in STORED_METHODS:
            pts = sorted((r.link_mib_s, r.ttft_s) for r in runs if r.method == method and r.context == context)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_xlabel("link rate (MiB/s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{context} tokens" + (f", rate halves at {runs[0].drop_at:g}" if runs[0].drop_at else ""))
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def write_json(path: Path, runs: list[TTFTRun], meta: dict) -> None:
    Path(path).write_text(json.dumps({"runs": [asdict(r) for r in runs], "meta": meta}, indent=1))
