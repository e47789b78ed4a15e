"""Torch calls per decode step, by the edgekv function that made them: where a policy's per-layer overhead comes
from (each call costs host time on the CPU, a launch on a GPU), full beside the policy, in one run.

    python -m tests.harness.op_counts --model fixture --context 2048 --kvswap G=4,M=40,C=40,sigma=8
    python -m tests.harness.op_counts --model smollm2 --context 2048 --weights ggml --dtype float32 --kvswap G=4,M=205,...
    python -m tests.harness.op_counts --model synth:llama-3.1-8b --context 16384 --kvswap G=8,M=50,C=50,sigma=16 --device cuda
"""
import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from bench.deployed_batch import fields
from edgekv.runtime import Engine

ROOT = str(Path(__file__).resolve().parents[2]) + "/"


class CallCounter(TorchFunctionMode):
    """Counts every torch function and method call under it by the nearest caller inside this repository."""

    def __init__(self):
        super().__init__()
        self.by_caller = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(ROOT):
            frame = frame.f_back
        if frame is not None:
            self.by_caller[f"{frame.f_code.co_filename.removeprefix(ROOT)} {frame.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))


def prefilled(engine: Engine, context: int, room: int = 64):
    """A batch of one sequence ready to decode, ``room`` positions left: ids every model has (the fixture's vocabulary
    is small)."""
    ids = min(30000, engine.model.dims.vocab - 10)
    batch = engine.open_batch(1, context)
    batch.join(0, [(i * 7919) % ids + 10 for i in range(context - room)])
    batch.end_prefill()
    return batch


def count(model: str, policy: str, cfg: dict, context: int, steps: int, device: str = "cpu", weights: str | None = None,
          dtype: str | None = None) -> tuple[collections.Counter, int]:
    """(calls by caller over ``steps`` decode steps after 3 unmeasured ones, the model's layers).  Calls on the decode
    thread only (a torch function mode is per thread): on a GPU the I/O threads' copies to the device slots are not
    among them."""
    with tempfile.TemporaryDirectory() as kv, Engine.from_pretrained(
            model, kv_path=kv, config={"max_context": context, "max_batch": 1, **cfg}, policy=policy,
            device=device, weights=weights, dtype=dtype) as engine:
        token = torch.tensor([5])
        with prefilled(engine, context) as batch:
            for _ in range(3):
                batch.step(token)
            with CallCounter() as counter:
                for _ in range(steps):
                    batch.step(token)
        return counter.by_caller, engine.model.dims.n_layers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="fixture")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--policy", default="kvswap")
    ap.add_argument("--kvswap", default="G=4,M=40,C=40,sigma=8", help="the policy's geometry")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cuda: the GPU path's calls (device slots, pinned picks)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the device's)")
    args = ap.parse_args(argv)
    for policy, cfg in (("full", {}), (args.policy, fields(args.kvswap))):
        calls, layers = count(args.model, policy, cfg, args.context, args.steps, args.device, args.weights, args.dtype)
        total = sum(calls.values()) / args.steps
        print(f"== {policy}: {total:.0f} torch calls a step, {total / layers:.0f} a layer ({layers} layers)")
        for caller, n in calls.most_common(args.top):
            print(f"{n / args.steps:7.0f}  {caller}")


if __name__ == "__main__":
    main()
