"""kvswap decode step time vs context at one fixed configuration: nothing per step may grow with S
except the predictor's scan of K_lr.

    .venv/bin/python bench/step_scaling.py --contexts 4096,8192,16384,32768 --batches 1,4 --png steps.png

Same model (the fixture by default), same (G, M, C, sigma) at every context, one shared prefill
per prompt, decode timed from step events after warm-up; prints ms per step and the ratio to
the shortest context.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgekv.bench import StepTimer, decode_rate
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime import Engine, RuntimeConfig
from edgekv.runtime.model import load_model
from edgekv.runtime.prompt_cache import PromptKVCache


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="fixture")
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--config", default='{"G": 8, "M": 50, "C": 50, "sigma": 8}')
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--kv-path", default="/var/tmp")
    ap.add_argument("--png")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    model = load_model(resolve_checkpoint(args.model), torch.device("cpu"), torch.float32, max(contexts) + 64)
    fixed = json.loads(args.config)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in contexts:
            g = torch.Generator().manual_seed(context)
            prompts = [torch.randint(4, model.dims.vocab, (context - args.steps - args.warmup - 8,), generator=g).tolist()
                       for _ in range(batch)]
            cfg = RuntimeConfig.load({**fixed, "max_context": context, "max_batch": batch, "io_align_bytes": 512})
            timer = StepTimer()
            with Engine(model, cfg, "kvswap", args.kv_path) as engine:
                engine.prompt_cache = PromptKVCache()
                engine.events.subscribe(timer)
                out = engine.generate(prompts, max_new_tokens=args.steps + args.warmup + 1, stop_token_ids=[])
            _, step_ms = decode_rate(timer.steps, args.warmup)
            rows.append({"batch": batch, "context": context, "step_ms": step_ms, "reuse_rate": out[0].stats["reuse_rate"]})
            base = next(r["step_ms"] for r in rows if r["batch"] == batch)
            print(f"batch {batch} context {context:6d}: {step_ms:7.2f} ms/step  x{step_ms / base:.2f} of the shortest"
                  f"  (reuse {rows[-1]['reuse_rate']:.2f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": fixed, "rows": rows}, indent=1))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for b in sorted({r["batch"] for r in rows}):
            sub = [r for r in rows if r["batch"] == b]
            ax.plot([r["context"] for r in sub], [r["step_ms"] for r in sub], "-o", label=f"batch {b}")
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="ms per decode step", title=f"kvswap {fixed}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
