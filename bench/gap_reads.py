"""Reading through gaps (``io_gap_bytes``, runtime/disk_store.py) against splitting at them, in one process on one
prefilled batch: the store's gap alternates every ``--steps`` decode steps for ``--rounds`` rounds (each round's first
step untimed), so the files, the picks' spread and the machine's load are the same for every setting; per setting the
median step, the requests and the records read a step (wanted, and read only to bridge a gap), and how long some read ran.

    python -m bench.gap_reads --model smollm2 --context 8192 --batch 4 --weights int4 --dtype bfloat16 --gaps 0,3,6
"""
import argparse
import json
import statistics
import tempfile
import time

import torch

from edgekv.runtime import Engine
from bench.correction_cost import _text_ids
from bench.scorer import DEPLOYED
from bench.step_profile import fields


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kvswap", default=DEPLOYED[0])
    ap.add_argument("--extra", default=DEPLOYED[1], help="JSON fields")
    ap.add_argument("--gaps", default="0,3,6", help="gaps read through, in records (0: split at every gap)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps a setting takes per round")
    ap.add_argument("--text", default="builtin", help="the prompts: this text's tokens, row r from token 997 r")
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the CPU's, float32)")
    ap.add_argument("--kv-path", default=None)
    args = ap.parse_args(argv)
    gaps = [int(g) for g in args.gaps.split(",")]
    room = 8 + len(gaps) * args.rounds * (args.steps + 1)
    ids = _text_ids(argparse.Namespace(model=args.model, text=args.text, context=args.context + 997 * (args.batch - 1),
                                       warmup=0, steps=room))
    cfg = {**fields(args.kvswap), **json.loads(args.extra), "max_batch": args.batch, "max_context": args.context + room}
    starts = [997 * row for row in range(args.batch)]
    ms = {g: [] for g in gaps}
    counts = {g: [0, 0, 0, 0, 0.0] for g in gaps}  # steps, requests, records, gap records, seconds reading
    with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
            args.model, kv_offload_path=kv, policy="kvswap", device="cpu", dtype=args.dtype, weights=args.weights,
            config=cfg) as engine:
        batch = engine.open_batch(args.batch, args.context + room)
        for row, start in enumerate(starts):
            batch.join(row, ids[start : start + args.context])
        batch.end_prefill()
        with batch:
            policy, made = getattr(batch.policy, "inner", None) or batch.policy, [0]  # a hybrid model: its global layers
            store = policy.store

            def step() -> None:
                batch.step(torch.tensor([ids[start + args.context + made[0]] for start in starts]))
                made[0] += 1

            for _ in range(8):
                step()
            for r in range(args.rounds):
                for gap in gaps:
                    store.gap_records = gap
                    step()
                    before = (store.requests, store.records_read, store.gap_records_read, policy.read_time.total_s)
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        step()
                    ms[gap].append((time.perf_counter() - started) / args.steps * 1e3)
                    after = (store.requests, store.records_read, store.gap_records_read, policy.read_time.total_s)
                    counts[gap] = [counts[gap][0] + args.steps] + [c + b - a for c, a, b in zip(counts[gap][1:], before, after)]
                    print(f"round {r} gap {gap}: {ms[gap][-1]:.1f} ms a step", flush=True)
    base = statistics.median(ms[gaps[0]])
    for gap in gaps:
        steps, requests, records, bridged, reading_s = counts[gap]
        print(f"batch {args.batch} gap {gap} records: median {statistics.median(ms[gap]):.1f} ms a step "
              f"({', '.join(f'{x:.1f}' for x in ms[gap])}); {requests / steps:.0f} requests, {records / steps:.0f} "
              f"records + {bridged / steps:.0f} read through gaps, reads running {reading_s / steps * 1e3:.0f} ms a step; {base / statistics.median(ms[gap]):.3f} x "
              f"gap {gaps[0]}'s tok/s")


if __name__ == "__main__":
    main()
