"""The dtype a CPU deployment computes in: the profile's where it holds quality and runs faster here, else float32.

On a GPU the profile names the dtype the GPU computes natively and it is deployed as named.  On the CPU float32 is
what every CPU computes well, but one with bf16 instructions (AVX512-BF16, AMX) decodes faster in bfloat16 where a
step's bytes are its weights and KV (SmolLM2 8K on a 2-core EPYC: edgekv full 0.89-1.00x llama.cpp in bfloat16,
0.68-0.81x in float32), while a CPU without them converts every operand and runs slower,
and a model whose step is mostly its output head or short windows gains little.  So the profile's dtype is measured
against float32 on this machine, with the weight format already chosen, not assumed: its perplexity on calibration
text (teacher-forced through the model's own forward, as the weight formats are), and the prompt's prefill and
``full``'s decode step of one sequence at ``max_context`` (one at a time, so a model that barely fits in float32 is
never loaded twice); the candidate must be faster at both.  The decode step alone misleads on a CPU without bf16
instructions once attention reads a bfloat16 cache natively (runtime/dense_attention.py): the test model's step was
1.53 against 1.61 ms in float32 on a 2-core Zen 3, while every matmul of a prompt (and the deploy's own profiles)
ran several times slower.  The KV knobs' tables stay measured in float32: they hold each policy's loss against
``full`` in the same dtype.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from edgekv.install.weights import scored
from edgekv.runtime.config import RuntimeConfig
from edgekv.runtime.engine import Engine
from edgekv.runtime.model import DecoderModel

BASELINE = "float32"
STEPS = 8  # timed decode steps a dtype, after two


@dataclass(frozen=True)
class DtypeTrial:
    dtype: str
    ppl_ratio: float  # to float32, the same weight format
    top1_agreement: float  # argmax tokens equal to float32's
    step_ms: float  # full's decode step, one sequence at the deployment's longest context (``timings``)
    prefill_ms: float  # the prompt before it
    chosen: bool = False
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def timings(model: DecoderModel, tokens: int, steps: int = STEPS) -> tuple[float, float]:
    """(milliseconds of the prefill of ``tokens`` prompt tokens, median milliseconds of ``full``'s decode step after
    them), one sequence: the model's whole step as it runs (attention, norms, conversions, head), not a sum of parts
    (Gemma 3 270M's layers and head alone were faster in bfloat16, its real step 0.84x as fast)."""
    room = steps + 2
    engine = Engine(model, RuntimeConfig.load({"max_context": tokens + room, "max_batch": 1}), policy="full")
    ids = [(i * 7919) % (model.dims.vocab - 10) + 10 for i in range(tokens)]  # ids every vocabulary has
    with engine, engine.open_batch(1, tokens + room) as batch:
        started = time.perf_counter()
        batch.join(0, ids)
        batch.end_prefill()
        prefill_s = time.perf_counter() - started
        token, times = torch.tensor([ids[-1]]), []
        for _ in range(room):
            started = time.perf_counter()
            batch.step(token)
            times.append(time.perf_counter() - started)
    return prefill_s * 1e3, statistics.median(times[2:]) * 1e3  # the first steps warm up


def choose(load, candidate: str, ppl_max: float, windows: list[list[int]], tokens: int,
           progress=lambda: None) -> tuple[str, list[DtypeTrial]]:
    """(the chosen dtype, both trials): ``load(dtype)`` loads the model, in the deployment's weight format, in a
    dtype (one at a time); ``candidate`` is chosen when its perplexity is within ``ppl_max`` of float32's and both its
    prefill and its step are faster."""
    measured = {}
    for dtype in (BASELINE, candidate):
        model = load(dtype)
        nll, top = scored(model, windows)
        measured[dtype] = nll, top, *timings(model, tokens)
        del model
        progress()
    (base_nll, base_top, base_prefill, base_ms), (nll, top, prefill, ms) = measured[BASELINE], measured[candidate]
    ratio = math.exp(nll - base_nll)
    notes = ([f"ppl ratio above {ppl_max:g}"] if ratio > ppl_max else []) + \
            ([f"its step ({ms:.2f} ms) is not faster than float32's ({base_ms:.2f} ms) here"]
             if ms >= base_ms else []) + \
            ([f"its prefill ({prefill:.0f} ms) is not faster than float32's ({base_prefill:.0f} ms) here"]
             if prefill >= base_prefill else [])
    trial = DtypeTrial(candidate, round(ratio, 5), round((top == base_top).float().mean().item(), 4), round(ms, 3),
                       round(prefill, 1), not notes, "; ".join(notes))
    base = DtypeTrial(BASELINE, 1.0, 1.0, round(base_ms, 3), round(base_prefill, 1))
    return (candidate if trial.chosen else BASELINE), [base, trial]
