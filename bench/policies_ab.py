"""edgekv's policies side by side in one process at any batch, their decode steps alternating round by round on the
same text (each row its own stretch of it), so the machine's drift falls on all of them alike: per policy the median
step and its tok/s over the first's.  ``bench.llama_ab`` adds llama.cpp, at batch 1 only.

    python -m bench.policies_ab --model smollm2 --context 8192 --batch 4 --weights ggml --dtype float32 \\
        --policies full,kvswap --kvswap G=4,M=205,C=256,sigma=2 --extra '<the deployed fields>'
"""
import contextlib

from bench.deployed_batch import alternate, alternating_room, parser, print_medians, text_batch


def main(argv=None) -> None:
    ap = parser(__doc__, batch=4, rounds=6, steps=6, setting="policy")
    ap.add_argument("--policies", default="full,kvswap", help="comma-separated, the first the base (kvswap: --kvswap, "
                    "--extra)")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    with contextlib.ExitStack() as stack:
        steps = {p: stack.enter_context(text_batch(args, alternating_room(args, len(policies)), policy=p))[1]
                 for p in policies}
        current = [policies[0]]
        ms, _ = alternate(lambda: steps[current[0]](), {p: (lambda p=p: current.__setitem__(0, p)) for p in policies},
                          args.rounds, args.steps)
    print_medians(ms, policies[0], prefix=f"batch {args.batch} ")


if __name__ == "__main__":
    main()
