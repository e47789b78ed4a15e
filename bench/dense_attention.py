"""``full``'s decode step on a CPU attending its cache in one native call (runtime/dense_attention.py), with the
helper thread and without, against ``forward.decode_attention`` (torch's grouped matmuls), in one process on one
prefilled batch: the three alternate every ``--steps`` decode steps for ``--rounds`` rounds, in turn first (each
round's first step untimed); per path the median step and its ratio to torch's tok/s.

    python -m bench.dense_attention --model smollm2 --context 8192 --batch 1 --weights int4 --dtype float32
"""

from bench.deployed_batch import alternate, alternating_room, parser, print_medians, text_batch


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, rounds=6, steps=6, setting="path")
    args = ap.parse_args(argv)
    with text_batch(args, room=alternating_room(args, 3), policy="full") as (policy, step):
        native = policy.dense
        if native is None:
            raise SystemExit("the native attention does not serve this model here (a GPU, a dtype it does not read, "
                             "or no compiler): nothing to compare")
        helper = native.aside

        def use(dense, aside):
            def apply():
                policy.dense = dense
                native.aside = aside
            return apply

        ms, _ = alternate(step, {"native, helper thread": use(native, helper), "native, one thread": use(native, None),
                                 "torch": use(None, helper)}, args.rounds, args.steps)
        use(native, helper)()
    print_medians(ms, "torch")


if __name__ == "__main__":
    main()
