"""What evals, the install step's quality table and deploy share to score a configuration: the text and windows
(calibration or evaluation), the adapters per sigma, an engine for a (policy, config), and ``ConfigScorer``:
perplexity ratio, top-1 agreement and KL against the reference policy.  It imports neither the task harness nor
the perplexity mode, which both build on it."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv.runtime import Engine, RuntimeConfig, policies
from edgekv.runtime.adapter import LowRankAdapter, collect_keys
from edgekv.runtime.checkpoints import load_tokenizer
from edgekv.runtime.model import DecoderModel, read_model_config
from edgekv.runtime.prompt_cache import PromptKVCache

from .progress import Progress
from .tasks import TASKS, VOCAB_SIZE, FixtureFormat, TextFormat, make_set

LICENSES = Path("/usr/share/common-licenses")
# Real English prose every Debian-based machine has (package base-files); near-duplicate versions left out.
BUILTIN_TEXTS = ("GPL-3", "LGPL-2.1", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "GPL-2", "MPL-1.1", "CC0-1.0", "Artistic",
                 "LGPL-3", "BSD")


def load_text(source: str) -> tuple[str, str]:
    """(text, description) for ``builtin`` (evaluation text: Debian's license texts, then, for contexts longer than
    they hold twice, Python's documentation topics from the last one back), ``calibration`` (those topics from the
    first one on: calibration windows start at the front, the evaluation's reach the topics only from the back, so
    they never meet below ~50K tokens of each, e.g. 32K contexts of Gemma 3) or a text file's path."""
    if source == "calibration":
        return _pydoc_topics(), "calibration: CPython's pydoc_data.topics"
    if source == "builtin":
        missing = [n for n in BUILTIN_TEXTS if not (LICENSES / n).is_file()]
        if missing:
            raise FileNotFoundError(f"the built-in text needs {LICENSES}/{{{','.join(missing)}}} (Debian's base-files); "
                                    "pass --ppl TEXT_FILE with any long English text instead")
        text = "\n\n".join((LICENSES / n).read_text(encoding="utf-8", errors="replace") for n in BUILTIN_TEXTS)
        # appended, so every split the licenses alone allowed (calibration first, then windows) is unchanged
        return (text + "\n\n" + _pydoc_topics(reverse=True),
                f"builtin: {LICENSES}/{{{','.join(BUILTIN_TEXTS)}}}, then pydoc topics from the last")
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"--ppl {source}: no such file; pass a text file or 'builtin'")
    return path.read_text(encoding="utf-8", errors="replace"), str(path)


def _pydoc_topics(reverse: bool = False) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics, reverse=reverse))


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


def read_bytes_per_token(outs) -> float:
    """KV bytes read from disk per decoded token over a batch's results (0 for the in-memory policies)."""
    return sum(o.stats["kv_bytes_read"] for o in outs) / max(1, sum(o.stats["generated_tokens"] - 1 for o in outs))


def read_stats(outs) -> dict:
    """What a batch read per decoded token: KV bytes, and records a correction read on top of the guess's (with
    the share of the corrected picks the guess had; None without correction)."""
    decoded = max(1, sum(o.stats["generated_tokens"] - 1 for o in outs))
    return {"kv_read_bytes_per_token": read_bytes_per_token(outs),
            "correction_records_per_token": sum(o.stats["kv_correction_records"] for o in outs) / decoded,
            "guess_recall": outs[0].stats["guess_recall"] if outs else None,
            "corrected_layer_share": outs[0].stats.get("corrected_layer_share") if outs else None}


def task_format(model_dir: str | Path):
    """The fixture's token ids for a 256-token model without a tokenizer, else words from its tokenizer."""
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is not None:
        return TextFormat(tokenizer)
    if read_model_config(model_dir).get("vocab_size") == VOCAB_SIZE:
        return FixtureFormat()
    raise ValueError(f"{model_dir} has no tokenizer; the harness needs one to build word tasks for it")


class Adapters:
    """Low-rank adapters per sigma, calibrated once on task prompts of another seed (never on the
    evaluated prompts), or one fixed adapter file whose rank then replaces the fitted sigma."""

    def __init__(self, model: DecoderModel, calibration: list[list[int]], fixed: LowRankAdapter | None = None,
                 fitted: dict[float, LowRankAdapter] | None = None):
        self.fixed = fixed
        self._fitted: dict[float, LowRankAdapter] = dict(fitted or {})
        self._keys = None if fixed or fitted else collect_keys(model, calibration)
        self._dims = model.dims
        what = "fixed" if fixed else "files" if fitted else json.dumps(calibration)
        self.source = hashlib.sha256(what.encode()).hexdigest()[:12]  # what the adapters were fitted on

    @classmethod
    def from_files(cls, model: DecoderModel, paths: dict[float, str]) -> "Adapters":
        """The install step's adapter files, one per sigma."""
        return cls(model, [], fitted={float(s): LowRankAdapter.load(p) for s, p in paths.items()})

    def __call__(self, sigma: float) -> LowRankAdapter:
        if self.fixed is not None:
            return self.fixed
        if sigma not in self._fitted and self._keys is None:
            raise ValueError(f"no adapter for sigma {sigma:g}; the install step built {sorted(self._fitted)}")
        if sigma not in self._fitted:
            self._fitted[sigma] = LowRankAdapter.fit_sigma(self._keys, self._dims.n_kv_heads, self._dims.head_dim, sigma)
        return self._fitted[sigma]


def engine_steps(forced_tokens: list[int], max_batch: int) -> int:
    """Step events a teacher-forced run emits: a prefill per prompt, then per batch its longest forced span."""
    chunks = [forced_tokens[i : i + max_batch] for i in range(0, len(forced_tokens), max_batch)]
    return sum(len(c) + max(c) for c in chunks)


def engine_inputs(policy: str, config: dict, adapters: Adapters) -> tuple[LowRankAdapter | None, dict, RuntimeConfig]:
    """(the calibrated adapter of ``config``'s sigma, the config it runs, that config's runtime fields, loaded)."""
    adapter = None
    if policies.get(policy).predicts:
        adapter = adapters(config["sigma"])
        if adapters.fixed is not None:
            config = {**config, "sigma": None}  # the file's rank replaces the fitted sigma
    known = set(RuntimeConfig.keys())
    return adapter, config, RuntimeConfig.load({k: v for k, v in config.items() if k in known})


def engine_for(model: DecoderModel, kv_path, policy: str, config: dict, adapters: Adapters) -> tuple[Engine, dict]:
    """An engine running ``config`` with the calibrated adapter of its sigma, and the config it runs."""
    adapter, config, runtime = engine_inputs(policy, config, adapters)
    return Engine(model, runtime, policy, kv_path, adapter=adapter), config


def _predictions(engine, windows: list[list[int]], continuation: int, on_event) -> tuple[torch.Tensor, dict]:
    """Log-probabilities [windows, continuation - 1, vocab] of the decode-path predictions of each window's tail,
    and what was read per decoded token (``read_stats``)."""
    engine.events.subscribe(on_event)
    prompts = [w[:-continuation] for w in windows]
    forced = [w[-continuation:] for w in windows]
    outs = engine.generate(prompts, max_new_tokens=continuation + 1, stop_token_ids=[], output_logits=True,
                           teacher_forcing=forced)
    # row 0 is the prefill's prediction (the same for every policy); row j >= 1 predicts forced[j] after decoding forced[j-1]
    return torch.stack([o.logits[1:continuation] for o in outs]).log_softmax(dim=-1), read_stats(outs)


def run_windows(engine, cache: PromptKVCache, windows: list[list[int]], continuation: int, on_event
         ) -> tuple[torch.Tensor, dict]:
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
            self.reference, _ = run_windows(Engine(model, config, policies.reference(), kv_path), self.cache, windows, continuation, on_event)
        self.full_ppl = compare(self.reference, self.reference, self.targets)[0]

    def __call__(self, policy: str, config: dict) -> dict:
        engine, ran = engine_for(self.model, self.kv_path, policy, {**config, "max_batch": self.max_batch}, self.adapters)
        with self.progress.cell(f"{self.label} {policy} {_short(config)}".strip(), self.steps) as on_event:
            logp, read = run_windows(engine, self.cache, self.windows, self.continuation, on_event)
        ppl, agree, kl = compare(logp, self.reference, self.targets)
        self.progress.write(f"{self.label} {policy} {_short(config)}: ppl x full {ppl / self.full_ppl:.3f}  top-1 {agree:.3f}")
        return {"policy": policy, "config": ran, "ppl": ppl, "ppl_ratio": ppl / self.full_ppl, "top1_agreement": agree,
                "kl": kl, **read}


def _short(config: dict) -> str:
    return " ".join(f"{k}={config[k]}" for k in ("G", "M", "sigma", "sink_tokens", "window_tokens", "correction")
                    if k in config)


def compare(logp: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """(perplexity, top-1 agreement with the reference, KL(reference || policy)) over all positions."""
    nll = -logp.gather(-1, targets[..., None]).mean()
    agree = (logp.argmax(-1) == reference.argmax(-1)).float().mean()
    kl = (reference.exp() * (reference - logp)).sum(-1).mean()
    return math.exp(float(nll)), float(agree), float(kl)
