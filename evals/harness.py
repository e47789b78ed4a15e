"""The quality harness: task instances through the engine, per policy and KV budget, scored by exact match.

A budget is a fraction of the full KV cache at the evaluated context; ``budget_config``
turns it into (sigma, M, G, C) with the install step's memory fit (KVSwap Appendix A:
M*G preset to 400, scaled down only when the budget cannot hold it, then the smallest
sigma that fits).  Quality needs no disk timing, so G stays the variant's.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from edgekv.install import quality, solver
from edgekv.install.solver import Limits, fit_memory, quality_fit
from edgekv.runtime import Engine, policies
from edgekv.runtime.engine import preflight
from edgekv.runtime.config import picked_groups
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.checkpoints import cache_root, checkpoint_fingerprint
from edgekv.runtime.devices import resolve_compute
from edgekv.runtime.model import DecoderModel, ModelDims, load_model
from edgekv.runtime.prompt_cache import PromptKVCache
from edgekv.runtime.store.files import write_json_atomic

from . import scoring
from .progress import Progress
from .scoring import Adapters, engine_for, engine_steps, read_bytes_per_token, task_format
from .tasks import TASKS, TaskInstance, make_instance, make_set



@dataclass(frozen=True)
class Variant:
    """One column of the table: a policy, a budget and switches."""

    policy: str
    budget: float | None = None  # fraction of the full KV; None for full / flexgen
    G: int = 4
    reuse: bool | None = None  # None: as the memory fit chooses; True/False: forced at the same (sigma, M, G)
    rolling_buffer: bool = True
    selector: str = "lowrank"
    score_reduce: str = "sum"
    ablation: str = ""  # what differs from the main row of its policy, e.g. "G=2" (part of the label)
    rule: str = "mg_const"  # "quality": the best measured configuration under the budget; "mg_const": KVSwap's M*G = 400
    overrides: tuple = ()  # (field, value) pairs set on the chosen configuration (ablations; may exceed the budget)
    record_dtype: str = "auto"  # kv_record_dtype of the disk records, on top of the configuration chosen for exact ones

    @property
    def label(self) -> str:
        name = self.policy if self.budget is None else f"{self.policy}@1/{round(1 / self.budget)}"
        return ",".join([name] + [x for x in (self.ablation, self.record_dtype) if x and x != "auto"])


def budget_bytes(budget: float, max_context: int, dims: ModelDims, itemsize: int) -> float:
    """A budget (a fraction of the full KV at ``max_context`` tokens) in bytes per sequence."""
    return budget * dims.n_layers * max_context * 2 * dims.n_kv_heads * dims.head_dim * itemsize


def budget_config(variant: Variant, context: int, dims: ModelDims, kv_dtype: torch.dtype, max_batch: int,
                  limits: Limits = Limits(io_align_bytes=512), chooser: "QualityChooser | None" = None) -> dict:
    """(sigma, M, G, C, reuse, S, W) for ``variant.budget`` of the full KV at ``context`` tokens: by measured
    quality (``rule="quality"``, through ``chooser``), else by the install step's memory fit with M*G = 400
    (edgekv.install.solver.quality_fit); ``token`` is G = 1 without reuse.  ``overrides`` are applied last.
    ``record_dtype`` only changes the records of the configuration chosen for exact ones, so a row shows what the
    format alone costs in quality and saves in reads (its memory stays within the budget: records only shrink)."""
    spec = policies.get(variant.policy)
    G = spec.group_tokens or variant.G
    max_context = context + 64
    base = {"max_context": max_context, "max_batch": max_batch, "G": G, "rolling_buffer": variant.rolling_buffer,
            "selector": variant.selector, "score_reduce": variant.score_reduce, "kv_record_dtype": variant.record_dtype}
    if variant.budget is None:
        return {**base, "M": 1, "C": 1, "sigma": 8}
    itemsize = torch.empty(0, dtype=kv_dtype).element_size()
    budget = budget_bytes(variant.budget, max_context, dims, itemsize)
    if not spec.on_disk:  # in memory: the whole budget is its cache, no disk geometry to fit
        return {**base, "M": 1, "C": 1, "sigma": 8, "max_kv_mem_mib": budget * max_batch / 2**20, **dict(variant.overrides)}
    if variant.rule == "quality":
        if chooser is None:
            raise ValueError("rule 'quality' needs a QualityChooser (measured configurations); pass one or use 'mg_const'")
        chosen = chooser(variant, context, budget, max_batch)
        overridden = dict(variant.overrides)
        config = {**base, **chosen, **overridden, "max_kv_mem_mib": budget * max_batch / 2**20}
        if variant.record_dtype != "auto":  # a row's own format replaces the one a recorded configuration chose
            config["kv_record_dtype"] = variant.record_dtype
        if overridden:  # an ablation may leave the budget (sigma=1): it measures quality, not memory
            config["max_kv_mem_mib"] = None
        return config
    fit = spec.budget_geometry(RuleFit(budget, dims, kv_dtype, limits, max_context, G))
    if fit is None:
        raise ValueError(no_room(f"budget 1/{round(1 / variant.budget)}", budget, context, dims, itemsize))
    reuse = fit["reuse"] if variant.reuse is None else variant.reuse
    over = reuse and not fit["reuse"]  # per-layer slots at the shared buffers' M: a quality ablation, over budget
    config = {**base, "sigma": fit["sigma"], "M": fit["M"], "C": fit["C"], "reuse": reuse,
              "io_align_bytes": limits.io_align_bytes, "max_kv_mem_mib": None if over else budget * max_batch / 2**20}
    return {**config, **dict(variant.overrides)}


def no_room(what: str, budget_bytes: float, context: int, dims: ModelDims, itemsize: int) -> str:
    """Why a budget holds no group: on a hybrid model, often the sliding-window rings alone (Gemma 3 270M's 15 rings
    of 512 tokens are 5 % of its whole KV at 8K, more than 1/34)."""
    message = f"{what} leaves no room for one group at context {context}"
    ring_bytes = dims.window_ring_bytes(context + 64, itemsize)
    if ring_bytes >= budget_bytes:
        message += (f": the sliding-window layers' rings alone take {ring_bytes / 2**20:.1f} MiB of its "
                    f"{budget_bytes / 2**20:.1f} MiB a sequence; raise the budget (at a longer context the rings are a "
                    "smaller share of it)")
    return message


class RuleFit(policies.BudgetFit):
    """A budget per sequence as KVSwap's rule fits it at G (M*G = 400, then the smallest sigma that fits:
    ``tuned``), or as the largest (sigma, M, C) at a fixed G (``fixed``); no disk timing, quality only."""

    def __init__(self, budget_bytes: float, dims: ModelDims, kv_dtype: torch.dtype, limits: Limits, max_context: int,
                 G: int):
        super().__init__()
        self.args, self.G = (budget_bytes, dims, kv_dtype, limits, max_context), G

    def tuned(self) -> dict | None:
        return self.geometry(quality_fit(*self.args, self.G))

    def fixed(self, G: int, reuse: bool) -> dict | None:
        return self.geometry(fit_memory(*self.args, G, reuse=reuse))


TOP1_TIE_ERRORS = 2  # top-1 agreements within this many standard errors of the best count as a tie (~95 %)


def least_loss(measured: list[dict], scored_tokens: int) -> dict:
    """The measured point of least loss: among the points whose top-1 agreement with full is within
    ``TOP1_TIE_ERRORS`` standard errors of the best (``scored_tokens`` calibration tokens each: a binomial share), the
    lowest ppl ratio.  Top-1 first: on SmolLM2 at 8K, 1/13, the lowest calibration ppl ratio (0.928, top-1 0.898)
    measured 1.031 / 0.899 on held-out text and the best top-1 (0.957) 1.005 / 0.972.  Within the error, ppl: at 4K,
    1/34, a top-1 better by two points of 254 tokens measured worse held out (1.126 / 0.834 against 1.084 / 0.875)."""
    best = max(r["top1_agreement"] for r in measured)
    error = TOP1_TIE_ERRORS * math.sqrt(best * (1 - best) / scored_tokens)
    return min((r for r in measured if r["top1_agreement"] >= best - error),
               key=lambda r: (r["ppl_ratio"], -r["top1_agreement"]))


class QualityChooser:
    """Budget -> the configuration with the least measured loss (``least_loss``) that fits it (the install step's
    quality table with its narrow windows and fine shares, restricted to the budget's frontier, and each corrected
    family again at the largest int4 rank that fits).  Each point is measured once per
    (context, adapters) on calibration windows no evaluation scores and cached on disk per model: a point serves
    every budget it fits."""

    def __init__(self, model: DecoderModel, model_dir: str | Path, kv_path, adapters: "Adapters", quiet: bool = False,
                 cache_dir: str | Path | None = None):
        self.model, self.model_dir, self.kv_path, self.adapters, self.quiet = model, Path(model_dir), kv_path, adapters, quiet
        root = Path(cache_dir) if cache_dir else cache_root()
        self.path = root / "tables" / checkpoint_fingerprint(self.model_dir) / "eval-quality.json"
        self.cache = _per_point(json.loads(self.path.read_text())) if self.path.is_file() else {}

    def __call__(self, variant: Variant, context: int, budget_bytes: float, max_batch: int) -> dict:
        measured = self.measured(variant, context, self.grid(variant, context, budget_bytes))
        best = least_loss(measured, quality.WINDOWS * (quality.continuation(context) - 1))
        config = quality.run_config(best, context)
        picked = picked_groups(config["M"], best["G"], best["sink_tokens"], best["window_tokens"])
        return {**config, "C": picked, "calibration_ppl_ratio": best["ppl_ratio"]}

    def grid(self, variant: Variant, context: int, budget_bytes: float) -> list[dict]:
        """The points a budget chooses among: the frontier of the grid with the narrow windows and fine shares (or
        the squeezed points), and each corrected family at the largest int4 rank that fits."""
        G = policies.get(variant.policy).group_tokens or variant.G
        limits = Limits(io_align_bytes=512)
        bytes_of = lambda p: solver.smallest_bytes(self.model.dims, self.model.dtype, limits, context + 64, p)  # noqa: E731
        sink_windows, shares = quality.SINK_WINDOW + quality.NARROW_WINDOWS, quality.MG_SHARES + quality.FINE_SHARES
        grid = (quality.frontier(quality.candidates(context, [G], solver.SIGMAS, quality.CORRECTIONS, sink_windows,
                                                    shares), bytes_of, budget_bytes)
                or quality.squeezed(context, G, solver.SIGMAS, bytes_of, budget_bytes, quality.CORRECTIONS, sink_windows))
        if not grid:
            raise ValueError(no_room(f"budget {budget_bytes / 2**20:.1f} MiB", budget_bytes, context, self.model.dims,
                                     self.model.dtype.itemsize))
        dims = self.model.dims
        return grid + quality.rank_filled(grid, bytes_of, budget_bytes, dims.n_kv_heads * dims.head_dim)

    def measured(self, variant: Variant, context: int, grid: list[dict]) -> list[dict]:
        """``grid``'s points with their loss on calibration windows: from the cache, the rest measured now."""
        table = self.cache.setdefault(f"{variant.policy} context={context} adapters={self.adapters.source}", {"points": []})
        rows = {quality.point_key(r): r for r in table["points"]}
        unmeasured = [p for p in grid if quality.point_key(p) not in rows]
        if unmeasured:
            windows, table["source"] = scoring.calibration_windows(self.model_dir, context, quality.WINDOWS)
            with Progress(len(unmeasured) + 1, f"choosing by quality at {context}", self.quiet) as progress:
                scorer = scoring.ConfigScorer(self.model, self.kv_path, self.adapters, windows, quality.continuation(context),
                                              progress, max_batch=quality.WINDOWS, label=f"{context}")
                for p in unmeasured:
                    row = scorer(variant.policy, quality.run_config(p, context))
                    rows[quality.point_key(p)] = {**p, "ppl_ratio": row["ppl_ratio"], "top1_agreement": row["top1_agreement"]}
            table["points"] = list(rows.values())
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():  # with what another eval of this model measured meanwhile
                self.cache = _per_point(json.loads(self.path.read_text()), into=self.cache)
            write_json_atomic(self.path, self.cache)
        return [rows[quality.point_key(p)] for p in grid]


def _per_point(cache: dict, into: dict | None = None) -> dict:
    """The eval's table cache keyed by (policy, context, adapters): a cache written per (budget, grid), as the
    eval kept it before, is merged into it (its points measured the same way), and the points of ``cache`` merged
    into ``into`` (a point ``into`` has stays as it is)."""
    merged: dict[str, dict] = into if into is not None else {}
    for key, entry in cache.items():
        words = dict(w.split("=", 1) for w in key.split()[1:])
        table = merged.setdefault(f"{key.split()[0]} context={words['context']} adapters={words['adapters']}",
                                  {"points": []})
        table["source"] = entry.get("source", table.get("source"))
        known = {quality.point_key(r) for r in table["points"]}
        table["points"] += [r for r in entry.get("points", entry.get("measured", [])) if quality.point_key(r) not in known]
    return merged


@dataclass
class Result:
    task: str
    context: int
    policy: str
    budget: float | None
    variant: str
    accuracy: float
    samples: int
    config: dict
    seconds: float
    kv_read_bytes_per_token: float = 0.0  # disk reads per decoded token (record format and reuse included)


def open_engine(model: DecoderModel, kv_path, variant: Variant, context: int, max_batch: int,
                adapters: "Adapters", chooser: QualityChooser | None = None) -> tuple[Engine, dict]:
    """An engine for one variant at ``context`` on an already loaded model, and the config it runs."""
    config = budget_config(variant, context, model.dims, model.dtype, max_batch, chooser=chooser)
    return engine_for(model, kv_path, variant.policy, config, adapters)


def recorded_configs(eval_json: str | Path) -> dict[tuple[int, str], dict]:
    """{(context, budget label): config} of the kvswap main rows of an ``edgekv eval --json`` result (tasks or
    perplexity): the configurations that eval ran, for another eval or the bench to run again."""
    data = json.loads(Path(eval_json).read_text())
    rows = data.get("ppl") or data.get("results") or []
    keys = ("G", "M", "C", "sigma", "reuse", "sink_tokens", "window_tokens", "score_reduce", "klr_dtype", "io_align_bytes",
            "kv_record_dtype", "correction", "correction_reads", "correction_recall", "guess_from_before", "replacement")
    return {(r["context"], f"1/{round(1 / r['budget'])}"): {k: r["config"][k] for k in keys if k in r["config"]}
            for r in rows if r["budget"] and r["policy"] in policies.names() and policies.get(r["policy"]).tunable
            and r["variant"] == f"{r['policy']}@1/{round(1 / r['budget'])}"}


class RecordedChooser:
    """The quality rule's choices read back from an earlier eval's JSON instead of measured again, so a retrieval
    run uses the very configurations a perplexity run chose (and reports, under the same budget)."""

    def __init__(self, eval_json: str | Path):
        self.path = Path(eval_json)
        self.configs = recorded_configs(eval_json)

    def __call__(self, variant: Variant, context: int, budget_bytes: float, max_batch: int) -> dict:
        key = (context, f"1/{round(1 / variant.budget)}")
        if key not in self.configs:
            raise ValueError(f"{self.path} has no kvswap row at context {key[0]}, budget {key[1]} (it has "
                             f"{sorted(self.configs)}); run that eval with this context and budget, or drop --configs-from")
        return dict(self.configs[key])


def quality_chooser(model: DecoderModel, model_dir, kv_path, adapters: "Adapters", variants: list[Variant],
                    quiet: bool, configs_from: str | Path | None = None) -> "QualityChooser | RecordedChooser | None":
    """What turns a budget into kvswap's configuration under the quality rule: an earlier eval's choices
    (``configs_from``), else measured (and cached) here."""
    if not any(v.rule == "quality" for v in variants):
        return None
    return RecordedChooser(configs_from) if configs_from else QualityChooser(model, model_dir, kv_path, adapters, quiet)


def check_budgets(model: DecoderModel, kv_path, variants: list[Variant], contexts: list[int], max_batch: int,
                  adapters: "Adapters", chooser) -> None:
    """Every row whose configuration is known without measuring (all but a quality choice still to be measured) is
    checked against its memory budget before any row runs: an over-budget row is refused in seconds, not after
    the rows before it ran (and their results lost with the run)."""
    for context in contexts:
        for variant in variants:
            if variant.rule == "quality" and not isinstance(chooser, RecordedChooser):
                continue
            config = budget_config(variant, context, model.dims, model.dtype, max_batch, chooser=chooser)
            adapter, _, cfg = scoring.engine_inputs(variant.policy, config, adapters)
            try:
                preflight(variant.policy, cfg, model.dims, model.dtype, adapter, kv_path)
            except ValueError as exc:
                raise ValueError(f"row {variant.label} at context {context}: {exc}") from exc


def _score(model: DecoderModel, kv_path, variant: Variant, context: int, instances: list[TaskInstance],
           max_batch: int, adapters: Adapters, on_event=None, prompt_cache: PromptKVCache | None = None,
           chooser: QualityChooser | None = None) -> tuple[list[bool], dict, float]:
    """Run ``instances`` through one variant: exact match per instance, the config, KV bytes read per token."""
    engine, config = open_engine(model, kv_path, variant, context, max_batch, adapters, chooser)
    with engine:
        engine.prompt_cache = prompt_cache
        if on_event is not None:
            engine.events.subscribe(on_event)
        outs = engine.generate([x.context for x in instances], teacher_forcing=[x.forced for x in instances])
    return [x.score(o.token_ids) for x, o in zip(instances, outs)], config, read_bytes_per_token(outs)


def _load(model_dir, contexts: list[int], tasks: list[str], seed: int, adapter_path, device=None, dtype=None
          ) -> tuple[DecoderModel, Adapters]:
    """The model once for every variant (weights are not reloaded per cell) on ``device`` in ``dtype``
    (runtime/devices.py: default $EDGEKV_DEVICE or the GPU), and its adapters."""
    model = load_model(model_dir, *resolve_compute(device, dtype), max(contexts) + 64)
    fixed = LowRankAdapter.load(adapter_path) if adapter_path else None
    calibration = [] if fixed else [x.context for x in make_set(tasks, min(contexts), 1, seed + 7919, task_format(model_dir))]
    return model, Adapters(model, calibration, fixed)


def evaluate(
    model_dir: str | Path,
    kv_path: str | Path,
    variants: list[Variant],
    contexts: list[int],
    tasks: list[str],
    samples: int,
    seed: int,
    max_batch: int = 4,
    adapter_path: str | None = None,
    quiet: bool = False,
    configs_from: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> list[Result]:
    """Every (task, context, variant) cell; the same instances for every variant."""
    model, adapters = _load(model_dir, contexts, tasks, seed, adapter_path, device, dtype)
    chooser = quality_chooser(model, model_dir, kv_path, adapters, variants, quiet, configs_from)
    check_budgets(model, kv_path, variants, contexts, max_batch, adapters, chooser)
    fmt = task_format(model_dir)
    results = []
    with Progress(len(contexts) * len(variants), "eval cells", quiet) as progress:
        for context in contexts:
            instances = make_set(tasks, context, samples, seed, fmt)
            steps = engine_steps([len(x.forced) for x in instances], max_batch)
            cache = PromptKVCache()  # every variant sees the same prompts: each is prefilled once
            for variant in variants:
                start = time.perf_counter()
                with progress.cell(f"{context} {variant.label}", steps) as on_event:
                    hits, config, read = _score(model, kv_path, variant, context, instances, max_batch, adapters,
                                                on_event, cache, chooser)
                seconds = time.perf_counter() - start
                for task in tasks:
                    scored = [hit for inst, hit in zip(instances, hits) if inst.task == task]
                    results.append(Result(task, context, variant.policy, variant.budget, variant.label,
                                          float(np.mean(scored)), len(scored), config, round(seconds, 2), read))
                progress.write(f"context {context:6d}  {variant.label:28s} "
                               f"{np.mean([r.accuracy for r in results[-len(tasks):]]):.3f}  ({seconds:.1f} s)")
    return results


def relative_accuracy(results: list[Result]) -> dict[str, float]:
    """Mean over (task, context) of accuracy / full's accuracy, per variant (1.0 = no loss)."""
    full = {(r.task, r.context): r.accuracy for r in results if r.policy == policies.reference()}
    out = {}
    for label in dict.fromkeys(r.variant for r in results):
        ratios = [r.accuracy / full[(r.task, r.context)] for r in results
                  if r.variant == label and full.get((r.task, r.context))]
        out[label] = float(np.mean(ratios)) if ratios else math.nan
    return out


def table(results: list[Result]) -> str:
    """task x variant accuracy (%), one block per context, with the relative row."""
    lines = []
    labels = list(dict.fromkeys(r.variant for r in results))
    for context in dict.fromkeys(r.context for r in results):
        cell = {(r.task, r.variant): r.accuracy for r in results if r.context == context}
        tasks = list(dict.fromkeys(r.task for r in results if r.context == context))
        lines.append(f"context {context}")
        w = max(len(lab) for lab in labels) + 2
        lines.append(f"{'task':16}" + "".join(f"{lab:>{w}}" for lab in labels))
        for task in tasks:
            lines.append(f"{task:16}" + "".join(f"{100 * cell[(task, lab)]:{w}.1f}" for lab in labels))
        rel = relative_accuracy([r for r in results if r.context == context])
        lines.append(f"{'relative':16}" + "".join(f"{rel[lab]:{w}.3f}" for lab in labels))
        configs = {r.variant: {**r.config, "policy": r.policy} for r in results if r.context == context}
        for lab in labels:
            lines.append(f"  {lab}: {config_summary(configs[lab])}")
        lines.append("")
    return "\n".join(lines)


def config_summary(c: dict) -> str:
    """One line of what a row ran with: arkv's budget and formats, or the disk policies' selection knobs."""
    if c.get("policy") in policies.names() and not policies.get(c["policy"]).on_disk:
        budget = c.get("max_kv_mem_mib")
        return (f"max_kv_mem_mib={budget:.2f} " if budget else "no budget ") + \
            f"quant={c.get('arkv_quant', 'auto')} W={c.get('arkv_window_tokens', 32)}"
    return (f"G={c['G']} M={c['M']} C={c['C']} sigma={c['sigma']} reuse={c.get('reuse', '-')} "
            f"S={c.get('sink_tokens', 0)} W={c.get('window_tokens', 0)} {c.get('selector', '')} "
            f"records={c.get('kv_record_dtype', 'auto')}")


def niah_grid(
    model_dir, kv_path, variant: Variant, contexts: list[int], depths: list[float], samples: int, seed: int,
    max_batch: int = 4, adapter_path: str | None = None,
) -> np.ndarray:
    """Single-needle accuracy [context, depth] for one variant (KVSwap Fig. 9)."""
    model, adapters = _load(model_dir, contexts, ["single_needle"], seed, adapter_path)
    chooser = quality_chooser(model, model_dir, kv_path, adapters, [variant], quiet=True)
    fmt = task_format(model_dir)
    grid = np.zeros((len(contexts), len(depths)))
    for i, context in enumerate(contexts):
        rng = np.random.default_rng([seed, context])
        instances = [make_instance("single_needle", context, rng, depth=d, fmt=fmt) for d in depths for _ in range(samples)]
        hits, _, _ = _score(model, kv_path, variant, context, instances, max_batch, adapters, chooser=chooser)
        grid[i] = np.array(hits).reshape(len(depths), samples).mean(axis=1)
    return grid


def plot_niah(path, grid: np.ndarray, contexts: list[int], depths: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(contexts), 4))
    image = ax.imshow(grid.T, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.set_xticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for (i, j), value in np.ndenumerate(grid):
        ax.text(i, j, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: str | Path, results: list[Result], meta: dict) -> None:
    payload = {"meta": meta, "results": [asdict(r) for r in results], "relative": relative_accuracy(results)}
    Path(path).write_text(json.dumps(payload, indent=1))


__all__ = ["Variant", "budget_config", "evaluate", "relative_accuracy", "table", "write_json", "TASKS", "TaskInstance"]
