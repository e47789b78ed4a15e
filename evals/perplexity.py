"""Perplexity through the decode path: a real text's continuation teacher-forced after a long prefix.

Retrieval tasks need a capable model; on a small real model the loss a KV policy causes shows
in its next-token distribution instead.  The text is tokenized once and cut into a calibration
span (the low-rank adapters are fitted on it) followed by evaluation windows that never overlap
it.  A window of ``context`` tokens is a prefix (prefilled once, its KV replayed into every
policy) and its last ``continuation`` tokens, fed as forced decode inputs, so every prediction
after the first goes through the decode path and its KV policy.  Per (context, policy, budget):
perplexity of those predictions, its ratio to ``full``, top-1 agreement with ``full`` and
KL(full || policy) in nats per token.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from edgekv.runtime import policies
from edgekv.runtime.devices import resolve_compute
from edgekv.runtime.model import load_model
from edgekv.runtime.prompt_cache import PromptKVCache

from .harness import Variant, check_budgets, config_summary, open_engine, quality_chooser
from .progress import Progress
from .scoring import (BUILTIN_TEXTS, LICENSES, Adapters, ConfigScorer, Split, calibration_windows, compare,  # noqa: F401
                      engine_steps, load_text, run_windows, split_text, tokenize)

@dataclass
class PplResult:
    policy: str
    budget: float | None
    context: int
    variant: str
    ppl: float
    ratio_to_full: float
    top1_agreement: float
    kl_full_policy: float
    tokens: int  # scored predictions (windows x (continuation - 1))
    windows: int
    config: dict
    seconds: float
    kv_read_bytes_per_token: float = 0.0  # disk reads per decoded token (record format and reuse included)
    correction_records_per_token: float = 0.0  # records a correction read per decoded token, beyond the guess's
    guess_recall: float | None = None  # the share of the corrected picks the layer-ahead guess had (corrected rows)
    corrected_layer_share: float | None = None  # layer-steps corrected (below 1 with correction_recall < 1)


def evaluate_ppl(model_dir: str | Path, kv_path: str | Path, variants: list[Variant], contexts: list[int],
                 ids: list[int], windows: int = 4, continuation: int = 256, max_batch: int = 4,
                 quiet: bool = False, configs_from: str | Path | None = None, device: str | None = None,
                 dtype: str | None = None, weights: str | None = None) -> list[PplResult]:
    """Every (context, variant) cell on the same windows of the token stream ``ids``; ``full`` first (the reference)."""
    if continuation < 2 or continuation >= min(contexts):
        raise ValueError(f"--ppl-tokens {continuation} must be in [2, {min(contexts)}) (shorter than the context)")
    calibration = min(contexts)
    splits = {c: split_text(ids, c, calibration, windows) for c in contexts}
    model = load_model(model_dir, *resolve_compute(device, dtype), max(contexts) + 64, weights or "native")
    adapters = Adapters(model, [splits[min(contexts)].calibration])
    chooser = quality_chooser(model, model_dir, kv_path, adapters, variants, quiet, configs_from)
    variants = [Variant(policies.reference())] + [v for v in variants if v.policy != policies.reference()]
    check_budgets(model, kv_path, variants, contexts, max_batch, adapters, chooser)
    results = []
    with Progress(len(contexts) * len(variants), "ppl cells", quiet) as progress:
        for context in contexts:
            split = splits[context]
            targets = torch.tensor([w[-continuation + 1 :] for w in split.windows])
            cache = PromptKVCache()  # each window's prefix is prefilled once, replayed into every policy
            steps = engine_steps([continuation] * len(split.windows), max_batch)
            reference, full_ppl = None, math.nan
            for variant in variants:
                start = time.perf_counter()
                engine, config = open_engine(model, kv_path, variant, context, max_batch, adapters, chooser)
                with progress.cell(f"{context} {variant.label}", steps) as on_event:
                    logp, read = run_windows(engine, cache, split.windows, continuation, on_event)
                if reference is None:  # full runs first
                    reference = logp
                ppl, agree, kl = compare(logp, reference, targets)
                full_ppl = full_ppl if variant.policy != policies.reference() else ppl
                results.append(PplResult(variant.policy, variant.budget, context, variant.label, ppl, ppl / full_ppl,
                                         agree, kl, targets.numel(), len(split.windows), config,
                                         round(time.perf_counter() - start, 1), **read))
                progress.write(f"context {context:6d}  {variant.label:22s} ppl {ppl:8.3f}  x full {results[-1].ratio_to_full:6.3f}  "
                               f"top-1 {agree:.3f}  KL {kl:.4f}  ({results[-1].seconds:.0f} s)" + _corrected(read))
    return results


def _corrected(read: dict) -> str:
    if read["guess_recall"] is None:
        return ""
    share = read.get("corrected_layer_share")
    return (f"  corrected: {read['correction_records_per_token']:.1f} extra reads/token, "
            f"guess recall {read['guess_recall']:.3f}" + (f", layers corrected {share:.2f}" if share is not None else ""))


def table(results: list[PplResult]) -> str:
    head = f"{'context':>7} {'variant':24} {'ppl':>9} {'x full':>7} {'top-1':>6} {'KL':>8}  config"
    lines = [head]
    for r in results:
        config = "" if r.policy == policies.reference() else config_summary({**r.config, "policy": r.policy})
        lines.append(f"{r.context:>7} {r.variant:24} {r.ppl:9.3f} {r.ratio_to_full:7.3f} {r.top1_agreement:6.3f} "
                     f"{r.kl_full_policy:8.4f}  {config}")
    return "\n".join(lines)


def oracle_gap(results: list[PplResult]) -> list[str]:
    """Per (context, budget) with the loss stages measured (``--ablations``): what is left between the main row and
    the oracle, and where: the layer-ahead guess (main - corrected; nothing when the main row is corrected) and the
    low-rank keys (corrected - oracle), in ppl ratio and top-1 agreement."""
    lines = []
    for r in results:
        if r.budget is None or r.variant != f"{r.policy}@1/{round(1 / r.budget)}":
            continue
        stage = {s.variant.split(",", 1)[1]: s for s in results if (s.context, s.policy, s.budget) ==
                 (r.context, r.policy, r.budget) and s.variant.startswith(r.variant + ",")}
        if "oracle" not in stage or "corrected" not in stage:
            continue
        oracle, corrected = stage["oracle"], stage["corrected"]
        guess = r if r.config.get("correction", "guess") == "guess" else None
        parts = [f"oracle {oracle.ratio_to_full:.3f} / {oracle.top1_agreement:.3f}",
                 f"corrected {corrected.ratio_to_full:.3f} / {corrected.top1_agreement:.3f}"]
        if guess is not None:
            parts.append(f"guess {guess.ratio_to_full:.3f} / {guess.top1_agreement:.3f}: the layer-ahead guess costs "
                         f"{guess.ratio_to_full - corrected.ratio_to_full:+.3f} ppl x, "
                         f"{guess.top1_agreement - corrected.top1_agreement:+.3f} top-1")
        parts.append(f"the low-rank keys {corrected.ratio_to_full - oracle.ratio_to_full:+.3f} ppl x, "
                     f"{corrected.top1_agreement - oracle.top1_agreement:+.3f} top-1")
        skipping = next((s for name, s in stage.items() if name.startswith("corrected,recall=")), None)
        if skipping is not None:
            share = skipping.corrected_layer_share
            parts.append(f"correcting only where the guess falls short ({skipping.variant.split(',', 1)[1]}"
                         + (f", {share:.2f} of the layer-steps" if share is not None else "") + ") "
                         f"{skipping.ratio_to_full - corrected.ratio_to_full:+.3f} ppl x, "
                         f"{skipping.top1_agreement - corrected.top1_agreement:+.3f} top-1")
        lines.append(f"gap to the oracle at {r.context}, {r.variant} (ppl x full / top-1): " + "; ".join(parts))
    return lines


def write_json(path: str | Path, results: list[PplResult], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "ppl": [asdict(r) for r in results]}, indent=1))
