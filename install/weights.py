"""The weight format the install step deploys: the first of the profile's candidates (fastest first) whose
perplexity on calibration text stays within ``weights_ppl_max`` of the model's own weights, measured on this
checkpoint rather than assumed (int4 keeps a Q4 GGUF's grid in 4 bits and puts other tensors in int8), with the
top-1 agreement beside it. The KV knobs' tables are measured on the model's own weights, whatever is chosen here."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from edgekv.runtime.errors import ModelError
from edgekv.runtime.forward import teacher_forced_logits
from edgekv.runtime.model import DecoderModel
from edgekv.runtime.weights import check_weight_format

WINDOW_TOKENS = 1024  # per calibration window: a few seconds a format on a 2-core CPU for a 135M model
SCORED = "the runtime's layer calls"  # what ``scored`` runs through: part of the cached choices' keys


@dataclass(frozen=True)
class WeightTrial:
    weights: str
    ppl_ratio: float | None  # to the model's own weights; None: the format cannot run here (``note``)
    top1_agreement: float | None
    chosen: bool = False
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def scored(model: DecoderModel, windows: list[list[int]]) -> tuple[float, torch.Tensor]:
    """(mean negative log-likelihood of each next token, the argmax tokens) over ``windows``, teacher-forced through
    the runtime's own layer calls (runtime/forward.py ``teacher_forced_logits``): the weights' loss as the runtime
    computes them (under ggml, the norms taken in the projections' calls), apart from any KV policy's."""
    nll, tokens, count = 0.0, [], 0
    for window in windows:
        ids = torch.tensor(window[1:], device=model.device)
        logits = teacher_forced_logits(model, window)[:-1].float()
        nll -= torch.log_softmax(logits, -1).gather(1, ids[:, None]).sum().item()
        tokens.append(logits.argmax(-1))
        count += len(window) - 1
    return nll / count, torch.cat(tokens)


def choose(native: DecoderModel, load, candidates: list[str], ppl_max: float, windows: list[list[int]],
           progress=lambda: None) -> tuple[str, list[WeightTrial]]:
    """(the chosen format, every trial): ``load(weights)`` loads the model in a candidate format; the first
    candidate within ``ppl_max`` is chosen, else ``native``."""
    base_nll, base_top = scored(native, windows)
    trials, chosen = [], "native"
    for weights in candidates:
        try:
            check_weight_format(weights, native.device, native.dtype)
        except ModelError as exc:
            trials.append(WeightTrial(weights, None, None, note=str(exc)))
            progress()
            continue
        nll, top = scored(load(weights), windows)
        ratio = math.exp(nll - base_nll)
        fits = chosen == "native" and ratio <= ppl_max
        chosen = weights if fits else chosen
        trials.append(WeightTrial(weights, round(ratio, 5), round((top == base_top).float().mean().item(), 4), fits,
                                  "" if ratio <= ppl_max else f"ppl ratio above {ppl_max:g}"))
        progress()
    return chosen, trials
