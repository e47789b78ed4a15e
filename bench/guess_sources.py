"""Where a better guess could come from, per layer: of the picks a step's correction makes (the layer's own query,
every layer corrected), the share the layer-ahead guess held, and the share the same layer's corrected picks of the
step before held.  The eval text is fed a token a step (what a guess recalls depends on the text); batch 1.

    python -m bench.guess_sources --model smollm2 --context 8192 --kvswap G=4,M=205,C=205,sigma=2 --weights int4 \\
        --extra '{"reuse": false, "klr_dtype": "int8", "score_reduce": "softmax", "correction_reads": 52}'
"""
import argparse
import collections
import json
import tempfile

import numpy as np
import torch
from edgekv.runtime import Engine, offload

from bench.correction_cost import _prompted, _text_ids
from bench.step_profile import fields


def recorded(picks: dict) -> None:
    """Wrap ``OffloadedKV._correct`` so each call adds (corrected picks, the guess's picks) of row 0 to
    ``picks[layer]``, in step order."""
    inner = offload.OffloadedKV._correct

    def wrapper(self, layer, groups, valid):
        guess = self._guess[0]
        picks[layer].append((set(groups[0][valid[0]].tolist()), set(guess[guess >= 0].tolist())))
        return inner(self, layer, groups, valid)

    offload.OffloadedKV._correct = wrapper


def held(picks: set, source: set) -> float:
    return len(picks & source) / max(1, len(picks))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kvswap", default="G=4,M=205,C=205,sigma=2")
    ap.add_argument("--extra", default='{"reuse": false, "klr_dtype": "int8", "score_reduce": "softmax"}',
                    help="JSON fields")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--text", default="builtin", help="builtin, or a text file of at least --context + --steps tokens")
    args = ap.parse_args(argv)
    args.warmup = 0  # what _text_ids counts
    ids = _text_ids(args)
    picks = collections.defaultdict(list)
    recorded(picks)
    room = max(64, args.steps)
    cfg = {**fields(args.kvswap), **json.loads(args.extra), "max_batch": 1, "max_context": args.context + room,
           "correction": "corrected", "correction_recall": 1.0}
    with tempfile.TemporaryDirectory() as kv, Engine.from_pretrained(
            args.model, kv_offload_path=kv, policy="kvswap", device="cpu", weights=args.weights,
            config=cfg) as engine, _prompted(engine, args.context, room, ids) as batch:
        for token in ids[args.context : args.context + args.steps]:
            batch.step(torch.tensor([token]))
    print(f"{args.model} {args.context} tokens, {args.kvswap} {args.extra}, {args.steps} steps: the share of a step's "
          "corrected picks each source held")
    print("layer  layer-ahead guess  its picks a step before  either")
    for layer, steps in sorted(picks.items()):
        guess = np.mean([held(now, guessed) for now, guessed in steps])
        before = np.mean([held(now, last) for (last, _), (now, _) in zip(steps, steps[1:])])
        either = np.mean([held(now, last | guessed) for (last, _), (now, guessed) in zip(steps, steps[1:])])
        print(f"{layer:5d}  {guess:17.2f}  {before:23.2f}  {either:6.2f}")


if __name__ == "__main__":
    main()
