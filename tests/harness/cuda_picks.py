"""Why a policy's float32 tokens on CUDA differ from the CPU's: the first decode call whose group picks differ,
and each step's logit gap, for ``tests/test_cuda.py``'s cases (needs a GPU).

    python -m tests.harness.cuda_picks kvswap-sinks-window kvswap-int8-records
"""
import logging
import sys
import tempfile

import numpy as np
import torch
from edgekv.runtime import Engine

from tests.test_cuda import BASE, CASES, NEW_TOKENS, PROMPTS


def trace(case: str, device: str) -> tuple[list, list]:
    """(every layer's attended picks (layer, picks [B, M], -1 = none), every step's logits [B, V] on the CPU)."""
    policy, extra = CASES[case]
    picks = []
    with tempfile.TemporaryDirectory() as kv, Engine.from_pretrained(
            "fixture", kv_path=kv, config={**BASE, **extra}, policy=policy, device=device,
            dtype=torch.float32) as engine:
        engine.events.subscribe(lambda e: picks.append((e.info["layer"], np.where(e.info["valid"], e.info["groups"],
                                                                                  -1)))
                                if e.kind == "groups_selected" else None)
        batch = engine.open_batch(len(PROMPTS), BASE["max_context"])
        logits = torch.stack([batch.join(row, p).logits for row, p in enumerate(PROMPTS)]).float().cpu()
        batch.end_prefill()
        steps = []
        with batch:
            for _ in range(NEW_TOKENS):
                steps.append(logits)
                logits = batch.step(logits.argmax(-1)).float().cpu()
    return picks, steps


def main(cases: list[str]) -> None:
    logging.disable(logging.WARNING)
    for case in cases:
        (cpu_picks, cpu_logits), (gpu_picks, gpu_logits) = trace(case, "cpu"), trace(case, "cuda")
        print(f"== {case}")
        for call, ((layer, a), (_, b)) in enumerate(zip(cpu_picks, gpu_picks)):
            if not np.array_equal(np.sort(a, 1), np.sort(b, 1)):
                apart = [sorted(set(a[s].tolist()) ^ set(b[s].tolist())) for s in range(len(a))]
                print(f"  picks differ first at call {call}, layer {layer}: groups in one only, per row {apart}")
                break
        else:
            print(f"  the same picks in all {len(cpu_picks)} calls")
        for step, (x, y) in enumerate(zip(cpu_logits, gpu_logits)):
            top = x.topk(2, -1).values
            print(f"  step {step}: cpu {x.argmax(-1).tolist()} cuda {y.argmax(-1).tolist()} max |logit diff| "
                  f"{(x - y).abs().max():.1e}, cpu top-2 gap {[round(g, 3) for g in (top[:, 0] - top[:, 1]).tolist()]}")
            if not torch.equal(x.argmax(-1), y.argmax(-1)):
                break


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
