"""A disk policy's decode step attending straight from its slots (the native kernel, runtime/record_attention.py)
against attending a gathered copy (``OffloadedKV._keys_values`` and ``forward.decode_attention``), in one process on
one prefilled batch: the two alternate every ``--steps`` decode steps for ``--rounds`` rounds, in turn first, so the
files, the picks and the machine's load are the same for both; per path the median step and the stall a step.

    python -m bench.record_attention --model smollm2 --context 8192 --batch 1 --weights int4 --dtype bfloat16
"""
import argparse
import statistics
import time

from bench.deployed_batch import add_options, text_batch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, batch=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps a path takes per round")
    args = ap.parse_args(argv)
    with text_batch(args, room=8 + 2 * args.rounds * args.steps) as (policy, step):
        native = policy.record_attention
        if native is None:
            raise SystemExit("the native attention does not serve this configuration (a GPU, quantized or float16 "
                             "records, or no compiler): nothing to compare")
        paths = {"native": native, "gathered copy": None}
        ms, stall_ms = {name: [] for name in paths}, {name: [] for name in paths}
        print(f"{args.model} {args.context} tokens, batch {args.batch}, {args.kvswap} {args.extra}")
        for r in range(args.rounds):
            for name in list(paths)[:: 1 if r % 2 == 0 else -1]:
                policy.record_attention = paths[name]
                stall_before, started = policy.io_stall_s, time.perf_counter()
                for _ in range(args.steps):
                    step()
                ms[name].append((time.perf_counter() - started) / args.steps * 1e3)
                stall_ms[name].append((policy.io_stall_s - stall_before) / args.steps * 1e3)
        policy.record_attention = native
    base = statistics.median(ms["gathered copy"])
    for name in paths:
        print(f"{name}: median {statistics.median(ms[name]):.1f} ms a step ({', '.join(f'{x:.1f}' for x in ms[name])}); "
              f"stall {statistics.median(stall_ms[name]):.1f} ms a step; {base / statistics.median(ms[name]):.3f} x "
              f"the gathered copy's tok/s")


if __name__ == "__main__":
    main()
