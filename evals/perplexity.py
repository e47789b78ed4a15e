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

from edgekv.runtime import Engine, RuntimeConfig, policies
from edgekv.runtime.checkpoints import load_tokenizer
from edgekv.runtime.model import DecoderModel, load_model, read_model_config
from edgekv.runtime.prompt_cache import PromptKVCache

from .harness import (Adapters, Variant, config_summary, engine_for, engine_steps, open_engine, quality_chooser,
                      read_bytes_per_token)
from .progress import Progress

LICENSES = Path("/usr/share/common-licenses")
# Real English prose every Debian-based machine has (package base-files); near-duplicate versions left out.
BUILTIN_TEXTS = ("GPL-3", "LGPL-2.1", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "GPL-2", "MPL-1.1", "CC0-1.0", "Artistic",
                 "LGPL-3", "BSD")


def load_text(source: str) -> tuple[str, str]:
    """(text, description) for ``builtin`` (evaluation text), ``calibration`` (Python's own documentation,
    which every CPython carries and no evaluation scores) or a text file's path."""
    if source == "calibration":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), "calibration: CPython's pydoc_data.topics"
    if source == "builtin":
        missing = [n for n in BUILTIN_TEXTS if not (LICENSES / n).is_file()]
        if missing:
            raise FileNotFoundError(f"the built-in text needs {LICENSES}/{{{','.join(missing)}}} (Debian's base-files); "
                                    "pass --ppl TEXT_FILE with any long English text instead")
        text = "\n\n".join((LICENSES / n).read_text(encoding="utf-8", errors="replace") for n in BUILTIN_TEXTS)
        return text, f"builtin: {LICENSES}/{{{','.join(BUILTIN_TEXTS)}}}"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"--ppl {source}: no such file; pass a text file or 'builtin'")
    return path.read_text(encoding="utf-8", errors="replace"), str(path)


def tokenize(model_dir: str | Path, text: str) -> tuple[list[int], str]:
    """(token ids, how): the checkpoint's tokenizer, or, for a model without one whose vocabulary covers
    the 256 byte values (the fixture), the text's UTF-8 bytes as ids; the ratios to ``full`` then still
    measure what a policy changes, the perplexity itself is of a model never trained on bytes."""
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is not None:
        return tokenizer(text)["input_ids"], "the checkpoint's tokenizer"
    vocab = read_model_config(model_dir)["vocab_size"]
    if vocab < 256:
        raise ValueError(f"{model_dir} has no tokenizer and {vocab} < 256 token ids; --ppl needs a tokenizer "
                         "(or 256 ids to read the text as bytes)")
    return list(text.encode("utf-8")), "UTF-8 bytes as token ids (the model has no tokenizer)"


def calibration_windows(model_dir: str | Path, context: int, n: int, text_file: str | None = None
                        ) -> tuple[list[list[int]], str]:
    """``n`` windows of ``context`` tokens that no evaluation scores: the given text or CPython's documentation
    for a model with a tokenizer, retrieval-task prompts of a seed the eval never uses for the fixture."""
    if load_tokenizer(model_dir) is None:
        from .harness import task_format
        from .tasks import TASKS, make_set

        instances = make_set(list(TASKS), context, max(1, -(-n // len(TASKS))), 4242, task_format(model_dir))[:n]
        return [(x.context + x.forced)[:context] for x in instances], f"task corpus (seed 4242), {n} x {context} tokens"
    text, source = (Path(text_file).read_text(encoding="utf-8", errors="replace"), str(text_file)) if text_file \
        else load_text("calibration")
    ids, _ = tokenize(model_dir, text)
    return split_text(ids, context, 0, n).windows, f"{source}, {n} x {context} tokens"


@dataclass(frozen=True)
class Split:
    """Where calibration ends and which windows of the token stream are evaluated."""

    calibration: list[int]
    windows: list[list[int]]


def split_text(ids: list[int], context: int, calibration_tokens: int, windows: int) -> Split:
    """The first ``calibration_tokens`` calibrate; then up to ``windows`` disjoint windows of ``context`` tokens."""
    available = (len(ids) - calibration_tokens) // context
    if available < 1:
        raise ValueError(f"the text has {len(ids)} tokens; context {context} needs at least {calibration_tokens + context} "
                         f"({calibration_tokens} to calibrate the adapters, then one window); pass a longer text")
    start = calibration_tokens
    return Split(ids[:calibration_tokens], [ids[start + w * context : start + (w + 1) * context]
                                            for w in range(min(windows, available))])


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


def _predictions(engine, windows: list[list[int]], continuation: int, on_event) -> tuple[torch.Tensor, float]:
    """Log-probabilities [windows, continuation - 1, vocab] of the decode-path predictions of each window's tail,
    and the KV bytes read per decoded token."""
    engine.events.subscribe(on_event)
    prompts = [w[:-continuation] for w in windows]
    forced = [w[-continuation:] for w in windows]
    outs = engine.generate(prompts, max_new_tokens=continuation + 1, stop_token_ids=[], output_logits=True,
                           teacher_forcing=forced)
    # row 0 is the prefill's prediction (the same for every policy); row j >= 1 predicts forced[j] after decoding forced[j-1]
    return torch.stack([o.logits[1:continuation] for o in outs]).log_softmax(dim=-1), read_bytes_per_token(outs)


def _run(engine, cache: PromptKVCache, windows: list[list[int]], continuation: int, on_event
         ) -> tuple[torch.Tensor, float]:
    with engine:
        engine.prompt_cache = cache
        return _predictions(engine, windows, continuation, on_event)


class ConfigScorer:
    """Perplexity ratio, top-1 agreement and KL against ``full`` of any (policy, config), every one on
    the same windows: ``full`` runs once, each window's prefix is prefilled once and replayed.

    The install step's quality table and the eval's ablation rows both come from here."""

    def __init__(self, model: DecoderModel, kv_path, adapters: Adapters, windows: list[list[int]], continuation: int,
                 progress: Progress, max_batch: int = 4, label: str = ""):
        self.model, self.kv_path, self.adapters, self.windows = model, kv_path, adapters, windows
        self.continuation, self.progress, self.max_batch, self.label = continuation, progress, max_batch, label
        self.targets = torch.tensor([w[-continuation + 1 :] for w in windows])
        self.cache = PromptKVCache()
        self.steps = engine_steps([continuation] * len(windows), max_batch)
        config = RuntimeConfig.load({"max_context": max(len(w) for w in windows) + 64, "max_batch": max_batch})
        with progress.cell(f"{label} full".strip(), self.steps) as on_event:
            self.reference, _ = _run(Engine(model, config, policies.reference(), kv_path), self.cache, windows, continuation, on_event)
        self.full_ppl = compare(self.reference, self.reference, self.targets)[0]

    def __call__(self, policy: str, config: dict) -> dict:
        engine, ran = engine_for(self.model, self.kv_path, policy, {**config, "max_batch": self.max_batch}, self.adapters)
        with self.progress.cell(f"{self.label} {policy} {_short(config)}".strip(), self.steps) as on_event:
            logp, read = _run(engine, self.cache, self.windows, self.continuation, on_event)
        ppl, agree, kl = compare(logp, self.reference, self.targets)
        self.progress.write(f"{self.label} {policy} {_short(config)}: ppl x full {ppl / self.full_ppl:.3f}  top-1 {agree:.3f}")
        return {"policy": policy, "config": ran, "ppl": ppl, "ppl_ratio": ppl / self.full_ppl, "top1_agreement": agree,
                "kl": kl, "kv_read_bytes_per_token": read}


def _short(config: dict) -> str:
    return " ".join(f"{k}={config[k]}" for k in ("G", "M", "sigma", "sink_tokens", "window_tokens") if k in config)


def compare(logp: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """(perplexity, top-1 agreement with the reference, KL(reference || policy)) over all positions."""
    nll = -logp.gather(-1, targets[..., None]).mean()
    agree = (logp.argmax(-1) == reference.argmax(-1)).float().mean()
    kl = (reference.exp() * (reference - logp)).sum(-1).mean()
    return math.exp(float(nll)), float(agree), float(kl)


def evaluate_ppl(model_dir: str | Path, kv_path: str | Path, variants: list[Variant], contexts: list[int],
                 ids: list[int], windows: int = 4, continuation: int = 256, max_batch: int = 4,
                 quiet: bool = False, configs_from: str | Path | None = None) -> list[PplResult]:
    """Every (context, variant) cell on the same windows of the token stream ``ids``; ``full`` first (the reference)."""
    if continuation < 2 or continuation >= min(contexts):
        raise ValueError(f"--ppl-tokens {continuation} must be in [2, {min(contexts)}) (shorter than the context)")
    calibration = min(contexts)
    splits = {c: split_text(ids, c, calibration, windows) for c in contexts}
    model = load_model(model_dir, torch.device("cpu"), torch.float32, max(contexts) + 64)
    adapters = Adapters(model, [splits[min(contexts)].calibration])
    chooser = quality_chooser(model, model_dir, kv_path, adapters, variants, quiet, configs_from)
    variants = [Variant(policies.reference())] + [v for v in variants if v.policy != policies.reference()]
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
                    logp, read = _run(engine, cache, split.windows, continuation, on_event)
                if reference is None:  # full runs first
                    reference = logp
                ppl, agree, kl = compare(logp, reference, targets)
                full_ppl = full_ppl if variant.policy != policies.reference() else ppl
                results.append(PplResult(variant.policy, variant.budget, context, variant.label, ppl, ppl / full_ppl,
                                         agree, kl, targets.numel(), len(split.windows), config,
                                         round(time.perf_counter() - start, 1), read))
                progress.write(f"context {context:6d}  {variant.label:22s} ppl {ppl:8.3f}  x full {results[-1].ratio_to_full:6.3f}  "
                               f"top-1 {agree:.3f}  KL {kl:.4f}  ({results[-1].seconds:.0f} s)")
    return results


def table(results: list[PplResult]) -> str:
    head = f"{'context':>7} {'variant':24} {'ppl':>9} {'x full':>7} {'top-1':>6} {'KL':>8}  config"
    lines = [head]
    for r in results:
        config = "" if r.policy == policies.reference() else config_summary({**r.config, "policy": r.policy})
        lines.append(f"{r.context:>7} {r.variant:24} {r.ppl:9.3f} {r.ratio_to_full:7.3f} {r.top1_agreement:6.3f} "
                     f"{r.kl_full_policy:8.4f}  {config}")
    return "\n".join(lines)


def write_json(path: str | Path, results: list[PplResult], meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "ppl": [asdict(r) for r in results]}, indent=1))
