"""A disk policy's decode step against its reads, on one prefilled batch: per window of ``--steps`` steps, the step's
wall time, the share of it with some read in flight, the compute thread's wait for the guesses' reads (stall), its
time in corrections (rescoring and the reads it waits for), and the records read a step.  Run it at two commits to
compare what the pipeline overlaps; windows of one run show the machine's spread.

    python -m bench.read_share --model smollm2 --context 8192 --batch 1 --weights int4 --dtype bfloat16
"""
import time

from bench.deployed_batch import parser, text_batch


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="decode steps a window times")
    args = ap.parse_args(argv)
    with text_batch(args, room=8 + args.windows * args.steps) as (policy, step):
        for _ in range(args.windows):
            before = (policy.io_read_s, policy.io_stall_s, policy.correction_s, int(policy.store.records_read),
                      policy.corrected_layer_steps.copy())
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            wall = time.perf_counter() - started
            read_s, stall_s, correction_s, records, corrected = (
                policy.io_read_s - before[0], policy.io_stall_s - before[1], policy.correction_s - before[2],
                int(policy.store.records_read) - before[3], policy.corrected_layer_steps - before[4])
            per_step = 1e3 / args.steps
            print(f"step {wall * per_step:.1f} ms | some read in flight {read_s / wall:.2f} of it | stall "
                  f"{stall_s * per_step:.1f} ms | correction {correction_s * per_step:.1f} ms | records "
                  f"{records / args.steps:.0f} a step | layers corrected {corrected[0] / max(1, corrected[1]):.2f}")


if __name__ == "__main__":
    main()
