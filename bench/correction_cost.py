"""What a correction costs a decode step, and where: the same kvswap configuration guess-only, corrected, and corrected
with its reads overlapped (``MODES``), each after a few warm-up steps, ms per step in the policy's phases (wall time of
each phase on the compute thread, nested phases inside their callers).

    python -m bench.correction_cost --model smollm2 --context 8192 --kvswap G=4,M=410,C=393,sigma=8 \\
        --extra '{"reuse": false, "sink_tokens": 4, "window_tokens": 64}'
"""
import argparse
import collections
import functools
import json
import tempfile
import time

import torch
from edgekv.runtime import Engine, offload, slots

from bench.step_profile import fields, prefilled

PHASES = {offload.OffloadedKV: ("prefetch", "take_picks", "attend", "_pick", "_wait_fetch", "_correct", "_wait",
                                "_read_misses", "_keys_values"),
          slots.PreloadSlots: ("assign", "correct", "resident"), slots.SlotTable: ("assign", "correct", "resident")}

# the same configuration three ways: the layer-ahead guess, corrected, and corrected with the attention over what is in
# memory overlapping the correction's reads
MODES = {"guess": {"correction": "guess"}, "corrected": {"correction": "corrected"},
         "corrected-overlap": {"correction": "corrected", "correction_overlap": True}}


def timed(spent: collections.Counter) -> None:
    """Wrap each phase so its wall time adds to ``spent`` under its name."""
    for cls, names in PHASES.items():
        for name in names:
            inner = getattr(cls, name)

            @functools.wraps(inner)
            def wrapper(*args, _inner=inner, _key=f"{cls.__name__}.{name}", **kwargs):
                started = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    spent[_key] += time.perf_counter() - started

            setattr(cls, name, wrapper)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kvswap", default="G=4,M=410,C=393,sigma=8")
    ap.add_argument("--extra", default='{"reuse": false, "sink_tokens": 4, "window_tokens": 64}', help="JSON fields")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--kv-path", default=None)
    args = ap.parse_args(argv)
    spent = collections.Counter()
    timed(spent)
    cfg = {**fields(args.kvswap), **json.loads(args.extra), "max_batch": 1, "max_context": args.context + 64}
    for mode, extra in MODES.items():
        with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
                args.model, kv_offload_path=kv, policy="kvswap", device="cpu",
                config={**cfg, **extra}) as engine, prefilled(engine, args.context + 64) as batch:
            token = torch.tensor([42])
            for _ in range(args.warmup):
                batch.step(token)
            spent.clear()
            extra = batch.policy.correction_records.sum()
            started = time.perf_counter()
            for _ in range(args.steps):
                batch.step(token)
            step_ms = (time.perf_counter() - started) / args.steps * 1e3
            extra = (batch.policy.correction_records.sum() - extra) / args.steps
        print(f"== {mode}: {step_ms:.1f} ms a step ({1e3 / step_ms:.2f} tok/s), {extra:.0f} extra records a step")
        for key, seconds in spent.most_common():
            print(f"  {key:28s} {seconds / args.steps * 1e3:7.2f} ms a step")


if __name__ == "__main__":
    main()
