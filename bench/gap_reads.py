"""Reading through gaps (``io_gap_bytes``, runtime/disk_store.py) against splitting at them, in one process on one
prefilled batch: the store's gap alternates every ``--steps`` decode steps for ``--rounds`` rounds (each round's first
step untimed), so the files, the picks' spread and the machine's load are the same for every setting; per setting the
median step, the requests and the records read a step (wanted, and read only to bridge a gap), and how long some read ran.

    python -m bench.gap_reads --model smollm2 --context 8192 --batch 4 --weights int4 --dtype bfloat16 --gaps 0,3,6
"""
import argparse
import statistics
import time

from bench.deployed_batch import add_options, text_batch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, batch=4)
    ap.add_argument("--gaps", default="0,3,6", help="gaps read through, in records (0: split at every gap)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps a setting takes per round")
    args = ap.parse_args(argv)
    gaps = [int(g) for g in args.gaps.split(",")]
    ms = {g: [] for g in gaps}
    counts = {g: [0, 0, 0, 0, 0.0] for g in gaps}  # steps, requests, records, gap records, seconds reading
    with text_batch(args, room=8 + len(gaps) * args.rounds * (args.steps + 1)) as (policy, step):
        store = policy.store
        for r in range(args.rounds):
            for gap in gaps:
                store.gap_records = gap
                step()
                before = (store.requests, store.records_read, store.gap_records_read, policy.io_read_s)
                started = time.perf_counter()
                for _ in range(args.steps):
                    step()
                ms[gap].append((time.perf_counter() - started) / args.steps * 1e3)
                after = (store.requests, store.records_read, store.gap_records_read, policy.io_read_s)
                counts[gap] = [counts[gap][0] + args.steps] + [c + b - a for c, a, b in zip(counts[gap][1:], before, after)]
                print(f"round {r} gap {gap}: {ms[gap][-1]:.1f} ms a step", flush=True)
    base = statistics.median(ms[gaps[0]])
    for gap in gaps:
        steps, requests, records, bridged, reading_s = counts[gap]
        print(f"batch {args.batch} gap {gap} records: median {statistics.median(ms[gap]):.1f} ms a step "
              f"({', '.join(f'{x:.1f}' for x in ms[gap])}); {requests / steps:.0f} requests, {records / steps:.0f} "
              f"records + {bridged / steps:.0f} read through gaps, reads running {reading_s / steps * 1e3:.0f} ms a "
              f"step; {base / statistics.median(ms[gap]):.3f} x gap {gaps[0]}'s tok/s")


if __name__ == "__main__":
    main()
