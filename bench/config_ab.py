"""Whole kvswap configurations side by side in one process: each variant (``--variants``, JSON objects merged over
``--extra``) gets its own engine, prefilled with the same text prompts, and the variants' decode steps alternate for
``--rounds`` rounds (each switch's first step untimed), so the machine's drift falls on every one alike; per variant
the median step, its ratio to the first's tok/s, the requests and MiB read a step, and its resident KV.  For what
cannot change on a live engine (the reuse buffer, K_lr's format, the records' format and padding).  A variant's
``dtype`` and ``weights`` are its model's (``--dtype``, ``--weights`` where it names none): kvswap in bfloat16 beside
float32, each on a model of its own.

    python -m bench.config_ab --model smollm2 --batch 4 --weights int4 --dtype bfloat16 \\
        --variants '[{}, {"C": 256, "reuse": true, "klr_dtype": "int4", "kv_record_dtype": "int4", "io_align_bytes": 2048}]'
"""
import argparse
import contextlib
import json
import statistics

from bench.deployed_batch import alternate, alternating_room, parser, text_batch

MODEL_FIELDS = ("dtype", "weights")  # a variant's model, not its engine's configuration


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, rounds=4, steps=6, setting="variant")
    ap.add_argument("--variants", default="[{}]", help="JSON list of objects, each merged over --extra")
    args = ap.parse_args(argv)
    variants = json.loads(args.variants)
    room = alternating_room(args, len(variants))
    with contextlib.ExitStack() as stack:
        engines = []
        for variant in variants:
            fields = {k: v for k, v in variant.items() if k not in MODEL_FIELDS}
            model = {k: variant.get(k, getattr(args, k)) for k in MODEL_FIELDS}
            mine = argparse.Namespace(**{**vars(args), **model, "extra": json.dumps({**json.loads(args.extra), **fields})})
            engines.append(stack.enter_context(text_batch(mine, room)))
        current = [engines[0][1]]
        ms, counts = alternate(
            lambda: current[0](), {str(i): (lambda step=step: current.__setitem__(0, step))
                                   for i, (_, step) in enumerate(engines)}, args.rounds, args.steps,
            lambda: tuple(x for policy, _ in engines for x in (policy.store.requests, int(policy.bytes_read.sum()))))
        steps, base = args.rounds * args.steps, statistics.median(ms["0"])
        for i, (variant, (policy, _)) in enumerate(zip(variants, engines)):
            runs, requests, read = ms[str(i)], counts[str(i)][2 * i], counts[str(i)][2 * i + 1]
            print(f"variant {i} {json.dumps(variant)}: median {statistics.median(runs):.1f} ms a step "
                  f"({', '.join(f'{x:.1f}' for x in runs)}); {base / statistics.median(runs):.3f} x variant 0's tok/s; "
                  f"{requests / steps:.0f} requests, {read / steps / 2**20:.1f} MiB read a step; resident KV "
                  f"{policy.resident_bytes / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
