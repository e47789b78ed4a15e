"""Decode steps on the CPU at several intra-op thread counts, side by side in one process: full, and kvswap guess-only
and corrected at one configuration, each prefilled once, the thread counts interleaved round by round (this machine's
speed drifts between runs; within one run the rows see the same drift).  What ``io.decode_cpu_threads`` and its
default (all cores, one left to a disk policy's reads) are chosen from.

    python -m bench.decode_threads --model smollm2 --context 8192 --repeat 4 [--batch 4]
"""
import argparse
import collections
import contextlib
import json
import statistics
import tempfile

import torch
from edgekv.runtime import Engine

from bench.step_profile import fields, prefilled, step_ms

# row -> (policy, correction): a row with a correction mode takes the kvswap geometry too
ROWS = {"full": ("full", None), "kvswap": ("kvswap", "guess"), "kvswap-corrected": ("kvswap", "corrected")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kvswap", default="G=4,M=410,C=393,sigma=8", help="the kvswap rows' geometry")
    ap.add_argument("--extra", default='{"reuse": false, "sink_tokens": 4, "window_tokens": 64}', help="JSON fields")
    ap.add_argument("--threads", default=None, help="thread counts, comma-separated (default: all cores, one fewer)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (each its own prompt)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per row and round")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=4, help="rounds; the median is reported")
    ap.add_argument("--kv-path", default=None)
    args = ap.parse_args(argv)
    cores = torch.get_num_threads()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({cores, max(1, cores - 1)},
                                                                                    reverse=True)
    steps_needed = args.warmup + args.repeat * len(counts) * (args.steps + 1)
    kvswap = {**fields(args.kvswap), **json.loads(args.extra)}
    token = torch.full((args.batch,), 42)
    ms = collections.defaultdict(list)
    with contextlib.ExitStack() as stack:
        batches = {}
        for row, (policy, correction) in ROWS.items():
            kv = stack.enter_context(tempfile.TemporaryDirectory(dir=args.kv_path))
            cfg = {**({**kvswap, "correction": correction} if correction else {}), "max_batch": args.batch,
                   "max_context": args.context + steps_needed}
            engine = stack.enter_context(Engine.from_pretrained(args.model, kv_offload_path=kv, policy=policy,
                                                                device="cpu", config=cfg))
            batches[row] = stack.enter_context(prefilled(engine, args.context + 64, args.batch))
            print(f"{row}: prefilled {args.context} tokens; the default decode threads {batches[row].decode_threads}")
            for _ in range(args.warmup):
                batches[row].step(token)
        for _ in range(args.repeat):
            for threads in counts:
                for row, batch in batches.items():
                    batch.decode_threads = threads
                    ms[row, threads].append(step_ms(batch, token, args.steps))
    print(f"# {args.model}, {args.context} tokens, batch {args.batch}, kvswap {args.kvswap} {args.extra}, {cores} cores, median of "
          f"{args.repeat} interleaved rounds of {args.steps} steps")
    for row in ROWS:
        base = statistics.median(ms[row, counts[0]])
        for threads in counts:
            runs = ms[row, threads]
            print(f"{row:18s} {threads} threads: {statistics.median(runs):6.1f} ms a step, {base / statistics.median(runs):.2f}"
                  f" x the {counts[0]}-thread tok/s (runs: {', '.join(f'{ms:.0f}' for ms in runs)})")


if __name__ == "__main__":
    main()
