"""What the one-process benches of the deployed configuration share: their model and configuration options, and a
batch of text prompts prefilled and ready to decode (row r from token 997 r of the text), each step feeding every
row its text's next token, so the picks move as they do on real text."""
import argparse
import contextlib
import json
import tempfile

import torch

from edgekv.runtime import Engine
from bench.correction_cost import _text_ids
from bench.step_profile import fields

# what `make deploy` chose for SmolLM2 on the local profile (docs/results/chosen-smollm2-8k-deployed-bf16.json)
DEPLOYED = ("G=4,M=205,C=205,sigma=2", '{"reuse": false, "klr_dtype": "int8", "score_reduce": "softmax", '
            '"correction": "corrected", "correction_reads": 52, "correction_recall": 0.85, "guess_from_before": true}')


def add_options(ap: argparse.ArgumentParser, batch: int, text: bool = True) -> None:
    """The model, context, batch, kvswap configuration, weights, dtype and KV folder (and the prompts' text)."""
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--kvswap", default=DEPLOYED[0])
    ap.add_argument("--extra", default=DEPLOYED[1], help="JSON fields")
    if text:
        ap.add_argument("--text", default="builtin", help="the prompts: this text's tokens, row r from token 997 r")
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the CPU's, float32)")
    ap.add_argument("--kv-path", default=None)


def engine_config(args: argparse.Namespace, room: int) -> dict:
    """The kvswap configuration of ``args`` for a batch of ``args.batch`` rows with ``room`` steps past the context."""
    return {**fields(args.kvswap), **json.loads(args.extra), "max_batch": args.batch, "max_context": args.context + room}


@contextlib.contextmanager
def text_batch(args: argparse.Namespace, room: int):
    """(the kvswap policy, a function taking one decode step) over a prefilled batch with ``room`` steps to decode, 8
    of them taken; a hybrid model's policy is its global layers' one."""
    ids = _text_ids(argparse.Namespace(model=args.model, text=args.text, context=args.context + 997 * (args.batch - 1),
                                       warmup=0, steps=room))
    starts = [997 * row for row in range(args.batch)]
    with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
            args.model, kv_offload_path=kv, policy="kvswap", device="cpu", dtype=args.dtype, weights=args.weights,
            config=engine_config(args, room)) as engine:
        batch = engine.open_batch(args.batch, args.context + room)
        for row, start in enumerate(starts):
            batch.join(row, ids[start : start + args.context])
        batch.end_prefill()
        with batch:
            made = [0]

            def step() -> None:
                batch.step(torch.tensor([ids[start + args.context + made[0]] for start in starts]))
                made[0] += 1

            for _ in range(8):
                step()
            yield getattr(batch.policy, "inner", None) or batch.policy, step
