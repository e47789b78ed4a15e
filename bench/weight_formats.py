"""Decode steps on the CPU in each weight format, side by side in one process: full and kvswap at one configuration,
each format's model prefilled once, the formats interleaved round by round (this machine's speed drifts between
runs; within one run the rows see the same drift).  A format may name the model's dtype too (``int4@bfloat16``).
Speed only: ``install/weights.py`` and ``install/dtypes.py`` measure what a format or a dtype costs in perplexity.

    python -m bench.weight_formats --model smollm2 --context 8192 --repeat 4 [--batch 4]
    python -m bench.weight_formats --model gemma3-270m --formats int4,int4@bfloat16 --policies full --batch 4
"""
import argparse
import collections
import contextlib
import json
import statistics
import tempfile
import time

import torch
from edgekv.runtime import Engine

from bench.step_profile import fields, prefilled, step_ms


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--formats", default="native,int4", help="weight formats, comma-separated, each with the model's "
                    "dtype after an @ where it is not the CPU's float32 (int4@bfloat16); the first is the base")
    ap.add_argument("--policies", default="full,kvswap", help="full, kvswap or both")
    ap.add_argument("--kvswap", default="G=4,M=410,C=393,sigma=8", help="the kvswap row's geometry")
    ap.add_argument("--extra", default='{"reuse": false, "sink_tokens": 4, "window_tokens": 64}', help="JSON fields")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (each its own prompt)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per row and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=4, help="rounds; the median is reported")
    ap.add_argument("--kv-path", default=None)
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    rows = {"full": {}, "kvswap": {**fields(args.kvswap), **json.loads(args.extra)}}  # policy -> its geometry
    if set(args.policies.split(",")) - set(rows):
        raise SystemExit(f"--policies {args.policies}: each is one of {', '.join(rows)}")
    rows = {policy: rows[policy] for policy in args.policies.split(",")}
    steps_needed = args.warmup + args.repeat * (args.steps + 1)
    token = torch.full((args.batch,), 42)
    ms = collections.defaultdict(list)
    with contextlib.ExitStack() as stack:
        batches = {}
        for weights in formats:
            named, _, dtype = weights.partition("@")
            for policy, geometry in rows.items():
                kv = stack.enter_context(tempfile.TemporaryDirectory(dir=args.kv_path))
                cfg = {**geometry, "max_batch": args.batch,
                       "max_context": args.context + 64 + steps_needed}
                engine = stack.enter_context(Engine.from_pretrained(args.model, kv_offload_path=kv, policy=policy,
                                                                    device="cpu", config=cfg, weights=named,
                                                                    dtype=dtype or None))
                started = time.perf_counter()
                batch = batches[weights, policy] = stack.enter_context(prefilled(engine, args.context + 64, args.batch))
                print(f"{policy} {weights}: prefilled {args.context} tokens x {args.batch} in "
                      f"{time.perf_counter() - started:.1f} s", flush=True)
                for _ in range(args.warmup):
                    batch.step(token)
        for _ in range(args.repeat):
            for key, batch in batches.items():
                ms[key].append(step_ms(batch, token, args.steps))
    print(f"# {args.model}, {args.context} tokens, batch {args.batch}, kvswap {args.kvswap} {args.extra}, "
          f"{torch.get_num_threads()} threads, median of {args.repeat} interleaved rounds of {args.steps} steps")
    for policy in rows:
        base = statistics.median(ms[formats[0], policy])
        for weights in formats:
            runs = ms[weights, policy]
            median = statistics.median(runs)
            print(f"{policy:7s} {weights:7s} {median:6.1f} ms a step, {1e3 * args.batch / median:5.1f} tok/s, "
                  f"{base / median:.2f} x "
                  f"{formats[0]} (runs: {', '.join(f'{r:.0f}' for r in runs)})")


if __name__ == "__main__":
    main()
