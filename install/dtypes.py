"""The dtype a CPU deployment computes in: the profile's where it holds quality and runs faster here, else float32.

On a GPU the profile names the dtype the GPU computes natively and it is deployed as named.  On the CPU float32 is
what every CPU computes well, but one with bf16 instructions (AVX512-BF16, AMX) decodes faster in bfloat16: half
the bytes of weights and KV a token (SmolLM2 8K on a 2-core EPYC: edgekv full 0.89-0.93x llama.cpp in bfloat16,
0.68-0.71x in float32; docs/results, issue 34), while a CPU without them converts every operand and runs slower.
So the profile's dtype is measured against float32 on this machine, not assumed: its perplexity on calibration
text (teacher-forced through the model's own forward, as the weight formats are) and one decode block at the
deployment's longest context and largest batch.  The KV knobs' tables stay measured in float32: they hold each
policy's loss against ``full`` in the same dtype.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from edgekv.install.compute import time_block
from edgekv.install.weights import scored

BASELINE = "float32"


@dataclass(frozen=True)
class DtypeTrial:
    dtype: str
    ppl_ratio: float  # to float32
    top1_agreement: float  # argmax tokens equal to float32's
    block_ms: float  # one decode block (layer 0) at the deployment's largest batch and longest context
    chosen: bool = False
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def choose(load, candidate: str, ppl_max: float, windows: list[list[int]], batch: int, tokens: int,
           progress=lambda: None) -> tuple[str, list[DtypeTrial]]:
    """(the chosen dtype, both trials): ``load(dtype)`` loads the model's own weights in a dtype, one at a time;
    ``candidate`` is chosen when its perplexity is within ``ppl_max`` of float32's and its block is faster."""
    measured = {}
    for dtype in (BASELINE, candidate):
        model = load(dtype)
        nll, top = scored(model, windows)
        measured[dtype] = nll, top, time_block(model, batch, tokens)
        del model
        progress()
    (base_nll, base_top, base_ms), (nll, top, ms) = measured[BASELINE], measured[candidate]
    ratio = math.exp(nll - base_nll)
    notes = ([f"ppl ratio above {ppl_max:g}"] if ratio > ppl_max else []) + \
            ([f"its block ({ms:.2f} ms) is not faster than float32's ({base_ms:.2f} ms) here"] if ms >= base_ms else [])
    trial = DtypeTrial(candidate, round(ratio, 5), round((top == base_top).float().mean().item(), 4), round(ms, 3),
                       not notes, "; ".join(notes))
    return (candidate if trial.chosen else BASELINE), [DtypeTrial(BASELINE, 1.0, 1.0, round(base_ms, 3)), trial]
