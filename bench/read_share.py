"""A disk policy's decode step against its reads, on one prefilled batch: per window of ``--steps`` steps, the step's
wall time, the share of it with some read in flight, the compute thread's wait for the guesses' reads (stall), its
time in corrections (rescoring and the reads it waits for), and the records read a step.  Run it at two commits to
compare what the pipeline overlaps; windows of one run show the machine's spread.

    python -m bench.read_share --model smollm2 --context 8192 --batch 1 --weights int4 --dtype bfloat16
"""
import argparse
import json
import tempfile
import time

import torch

from edgekv.runtime import Engine
from bench.correction_cost import _text_ids
from bench.scorer import DEPLOYED
from bench.step_profile import fields


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kvswap", default=DEPLOYED[0])
    ap.add_argument("--extra", default=DEPLOYED[1], help="JSON fields")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="decode steps a window times")
    ap.add_argument("--text", default="builtin", help="the prompts: this text's tokens, row r from token 997 r")
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the CPU's, float32)")
    ap.add_argument("--kv-path", default=None)
    args = ap.parse_args(argv)
    room = 8 + args.windows * args.steps
    ids = _text_ids(argparse.Namespace(model=args.model, text=args.text, context=args.context + 997 * (args.batch - 1),
                                       warmup=0, steps=room))
    cfg = {**fields(args.kvswap), **json.loads(args.extra), "max_batch": args.batch, "max_context": args.context + room}
    starts = [997 * row for row in range(args.batch)]
    with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
            args.model, kv_offload_path=kv, policy="kvswap", device="cpu", dtype=args.dtype, weights=args.weights,
            config=cfg) as engine:
        batch = engine.open_batch(args.batch, args.context + room)
        for row, start in enumerate(starts):
            batch.join(row, ids[start : start + args.context])
        batch.end_prefill()
        with batch:
            policy, made = getattr(batch.policy, "inner", None) or batch.policy, [0]  # a hybrid model: its global layers

            def step() -> None:
                batch.step(torch.tensor([ids[start + args.context + made[0]] for start in starts]))
                made[0] += 1

            for _ in range(8):
                step()
            print(f"{args.model} {args.context} tokens, batch {args.batch}, {args.kvswap} {args.extra}")
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
