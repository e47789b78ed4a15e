"""A disk policy's decode step attending straight from its slots (the native kernel, runtime/record_attention.py)
against attending a gathered copy (``OffloadedKV._keys_values`` and ``forward.decode_attention``), in one process on
one prefilled batch: the two alternate every ``--steps`` decode steps for ``--rounds`` rounds, in turn first (each
round's first step untimed), so the files, the picks and the machine's load are the same for both; per path the
median step and the stall a step.

    python -m bench.record_attention --model smollm2 --context 8192 --batch 1 --weights int4 --dtype bfloat16
"""
import functools
import statistics

from bench.deployed_batch import alternate, alternating_room, parser, text_batch


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, rounds=8, steps=8, setting="path")
    args = ap.parse_args(argv)
    with text_batch(args, room=alternating_room(args, 2)) as (policy, step):
        native = policy.record_attention
        if native is None:
            raise SystemExit("the native attention does not serve this configuration (a GPU, float16 records, or no "
                             "compiler): nothing to compare")
        paths = {"native": native, "gathered copy": None}
        ms, stall_s = alternate(step, {name: functools.partial(setattr, policy, "record_attention", attention)
                                       for name, attention in paths.items()}, args.rounds, args.steps,
                                lambda: (policy.io_stall_s,))
        policy.record_attention = native
    base, steps = statistics.median(ms["gathered copy"]), args.rounds * args.steps
    for name, runs in ms.items():
        print(f"{name}: median {statistics.median(runs):.1f} ms a step ({', '.join(f'{x:.1f}' for x in runs)}); "
              f"stall {stall_s[name][0] / steps * 1e3:.1f} ms a step; {base / statistics.median(runs):.3f} x the "
              f"gathered copy's tok/s")

if __name__ == "__main__":
    main()
