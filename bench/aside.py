"""The decode step's helper thread (runtime/aside.py), in one process on one prefilled batch: the next layer's scores
posted to it, shared with it (``PostOrShare``: a step chooses between the two by timing them; either way the
records' attention is shared with it), and no helper lent,
alternating every ``--steps`` decode steps for ``--rounds`` rounds (each round's first step untimed), so the files, the
picks and the machine's load are the same for all; per setting the median step, the compute thread's CPU time a step
(what the helper takes off it) and the process's.

    python -m bench.aside --model smollm2 --context 8192 --batch 4 --weights int4 --dtype bfloat16 --kv-path /dev/shm
"""
import statistics
import time

from bench.deployed_batch import alternate, alternating_room, parser, text_batch
from edgekv.runtime.aside import PostOrShare


def main(argv=None) -> None:
    ap = parser(__doc__, batch=4, rounds=5)
    args = ap.parse_args(argv)
    with text_batch(args, room=alternating_room(args, 3)) as (policy, step):
        helper = policy.aside
        if helper is None:
            raise SystemExit("no helper thread here (one core, or its library could not be built): nothing to compare")

        def setting(aside, post):
            return lambda: (policy.lend_aside(aside), setattr(policy, "post_or_share", PostOrShare(fixed=post)))

        settings = {"posted": setting(helper, True), "shared": setting(helper, False), "no helper": setting(None, False)}
        ms, cpu = alternate(step, settings, args.rounds, args.steps, lambda: (time.thread_time(), time.process_time()))
    steps, base = args.rounds * args.steps, statistics.median(ms["no helper"])
    for name in settings:
        runs, (compute_s, process_s) = ms[name], cpu[name]
        print(f"batch {args.batch} {name}: median {statistics.median(runs):.1f} ms a step "
              f"({', '.join(f'{x:.1f}' for x in runs)}); the compute thread's CPU {compute_s / steps * 1e3:.1f} ms a "
              f"step, the process's {process_s / steps * 1e3:.1f}; {base / statistics.median(runs):.3f} x no helper's "
              "tok/s")


if __name__ == "__main__":
    main()
