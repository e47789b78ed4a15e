"""The low-rank selector's scorer, native (runtime/native/ekv_score.c) against torch, in one process on one prefilled
batch: the two alternate every ``--steps`` decode steps for ``--rounds`` rounds (each round's first step untimed), so
the disk, the machine's load and the context length are the same for both; the median step of each and their ratio.

    python -m bench.scorer --model smollm2 --context 8192 --batch 1 --weights int4 --dtype bfloat16
"""
import statistics
import tempfile

import torch

from edgekv.runtime import Engine, selector
from bench.deployed_batch import parser, engine_config
from bench.step_profile import prefilled, step_ms


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, text=False)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps a scorer takes per round")
    args = ap.parse_args(argv)
    if selector.native_scorer() is None:
        raise SystemExit("the native scorer could not be built here (see the warning above): nothing to compare")
    room = 8 + 2 * args.rounds * (args.steps + 1)
    native, ms = selector.native_scorer, {"torch": [], "native": []}
    with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
            args.model, kv_offload_path=kv, policy="kvswap", device="cpu", dtype=args.dtype, weights=args.weights,
            config=engine_config(args, room)) as engine, prefilled(engine, args.context + room, rows=args.batch, room=room) as batch:
        token = torch.tensor([42] * args.batch)
        try:
            for _ in range(8):
                batch.step(token)
            for r in range(args.rounds):
                for scorer in ms:
                    selector.native_scorer = native if scorer == "native" else (lambda: None)
                    ms[scorer].append(step_ms(batch, token, args.steps))
                    print(f"round {r} {scorer}: {ms[scorer][-1]:.1f} ms a step", flush=True)
        finally:
            selector.native_scorer = native
    for scorer, runs in ms.items():
        print(f"batch {args.batch} {scorer:6s}: median {statistics.median(runs):.1f} ms a step "
              f"({', '.join(f'{x:.1f}' for x in runs)})")
    print(f"native is {statistics.median(ms['torch']) / statistics.median(ms['native']):.3f} x torch's tok/s")


if __name__ == "__main__":
    main()
