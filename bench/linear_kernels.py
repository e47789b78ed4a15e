"""One decode token through each linear layer shape of a model, in each weight format, on one thread: the kernels
alone, the formats interleaved round by round in one process (this machine's speed drifts between runs).

    python -m bench.linear_kernels --model smollm2 --formats int4,ggml --rounds 5
"""
import argparse
import statistics
import time

import torch

from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.model import load_model


def layers(model) -> dict:
    """name -> the module a decode token passes: block 0's packed q/k/v, o, packed gate/up, down, and the head."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    return {"qkv": getattr(attn, "qkv_packed", attn.q_proj), "o": attn.o_proj,
            "gate_up": getattr(mlp, "gate_up_packed", mlp.gate_proj), "down": mlp.down_proj, "head": model.lm_head}


def us_per_call(module, x: torch.Tensor, calls: int) -> float:
    module(x)
    started = time.perf_counter()
    for _ in range(calls):
        module(x)
    return (time.perf_counter() - started) / calls * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--formats", default="int4,ggml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200, help="calls a layer and round (a tenth for the head)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    checkpoint = resolve_checkpoint(args.model)
    models = {f: load_model(checkpoint, torch.device("cpu"), torch.float32, 256, f) for f in args.formats.split(",")}
    us = {(f, name): [] for f, model in models.items() for name in layers(model)}
    with torch.no_grad():
        for _ in range(args.rounds):
            for f, model in models.items():
                for name, module in layers(model).items():
                    inputs = getattr(module, "in_features", None) or module.weight.shape[1]  # a rescored head's
                    x = torch.randn(1, 1, inputs)
                    us[f, name].append(us_per_call(module, x, args.calls // (10 if name == "head" else 1)))
    base = args.formats.split(",")[0]
    print(f"# {args.model}, one token, one thread, median of {args.rounds} interleaved rounds (us a call)")
    for name in layers(next(iter(models.values()))):
        cells = [f"{f} {statistics.median(us[f, name]):8.1f}" for f in models]
        ratios = [f"{statistics.median(us[base, name]) / statistics.median(us[f, name]):.2f}x" for f in models]
        print(f"{name:8s} " + "  ".join(cells) + f"   ({' / '.join(ratios)} {base}'s speed)")


if __name__ == "__main__":
    main()
