"""Reading through gaps (``io_gap_bytes``, runtime/disk_store.py) against splitting at them, in one process on one
prefilled batch: the store's gap alternates every ``--steps`` decode steps for ``--rounds`` rounds (each round's first
step untimed), so the files, the picks' spread and the machine's load are the same for every setting; per setting the
median step, the requests and the records read a step (wanted, and read only to bridge a gap), and how long some read ran.

    python -m bench.gap_reads --model smollm2 --context 8192 --batch 4 --weights int4 --dtype bfloat16 --gaps 0,3,6
"""
import functools
import statistics

from bench.deployed_batch import alternate, alternating_room, parser, text_batch


def main(argv=None) -> None:
    ap = parser(__doc__, batch=4, rounds=4, steps=6)
    ap.add_argument("--gaps", default="0,3,6", help="gaps read through, in records (0: split at every gap)")
    args = ap.parse_args(argv)
    gaps = [int(g) for g in args.gaps.split(",")]
    with text_batch(args, room=alternating_room(args, len(gaps))) as (policy, step):
        store = policy.store
        ms, counts = alternate(  # counts: requests, records, gap records, seconds reading
            step, {f"gap {gap}": functools.partial(setattr, store, "gap_records", gap) for gap in gaps}, args.rounds,
            args.steps, lambda: (store.requests, store.records_read, store.gap_records_read, policy.io_read_s))
    steps, base = args.rounds * args.steps, statistics.median(ms[f"gap {gaps[0]}"])
    for gap in gaps:
        runs, (requests, records, bridged, reading_s) = ms[f"gap {gap}"], counts[f"gap {gap}"]
        print(f"batch {args.batch} gap {gap} records: median {statistics.median(runs):.1f} ms a step "
              f"({', '.join(f'{x:.1f}' for x in runs)}); {requests / steps:.0f} requests, {records / steps:.0f} "
              f"records + {bridged / steps:.0f} read through gaps, reads running {reading_s / steps * 1e3:.0f} ms a "
              f"step; {base / statistics.median(runs):.3f} x gap {gaps[0]}'s tok/s")

if __name__ == "__main__":
    main()
