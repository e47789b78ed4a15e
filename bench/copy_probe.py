"""Does a quality-grid point keep what retrieval needs?  Each point of the eval rule's grid under one budget (its
frontier, the fine share and the rank-filled points, as ``evals.harness.QualityChooser`` builds it), measured twice
against ``full``: on the calibration text's next tokens (the rule's measure, read from the eval's table cache when it
is there) and on *copies*: calibration windows whose last tokens repeat spans of their own prompt, so predicting them
means attending to where the span sits (induction, as a needle's answer does).  Per point: the copies' KL(full ||
kvswap) and recall (of the copied tokens full predicts, the share kvswap predicts too).

    python -m bench.copy_probe --model smollm2 --context 4096 --budget 1/34 --out copy-probe.json
"""
import argparse
import json
import random
import tempfile

import torch
from edgekv.commands.common import parse_budget
from edgekv.evals.harness import QualityChooser, Variant, budget_bytes
from edgekv.evals.progress import Progress
from edgekv.evals.scoring import (Adapters, ConfigScorer, calibration_windows, compare, engine_for, load_text,
                                  run_windows, split_text, tokenize)
from edgekv.install import quality
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.model import load_model


def copy_windows(windows: list[list[int]], spans: int, span_tokens: int, seed: int) -> list[list[int]]:
    """Each window with its last ``spans * span_tokens`` tokens replaced by spans of its prompt (past its first 64
    tokens and its last 256), drawn by ``seed``."""
    rng, tail_tokens, out = random.Random(seed), spans * span_tokens, []
    for window in windows:
        prompt = window[: len(window) - tail_tokens]
        starts = [rng.randrange(64, len(prompt) - 256) for _ in range(spans)]
        out.append(prompt + [t for s in starts for t in prompt[s : s + span_tokens]])
    return out


def copy_row(scorer: ConfigScorer, model, kv, adapters: Adapters, config: dict, on_event) -> dict:
    """KL(full || kvswap) over the copied tokens, and the recall of those full predicts."""
    engine, _ = engine_for(model, kv, "kvswap", {**config, "max_batch": scorer.max_batch}, adapters)
    logp, _ = run_windows(engine, scorer.cache, scorer.windows, scorer.continuation, on_event)
    reference, targets = scorer.reference, scorer.targets
    found = reference.argmax(-1) == targets
    return {"copy_kl": compare(logp, reference, targets)[2],
            "copy_recall": float(((logp.argmax(-1) == targets) & found).sum() / found.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", default="1/34", help="a fraction of the full KV, as the eval's --budgets take it")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--spans", type=int, default=2)
    ap.add_argument("--span-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--limit", type=int, default=None, help="measure only the first N points (a quick check)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = resolve_checkpoint(args.model)
    ctx = args.context
    model = load_model(model_dir, "cpu", torch.float32, ctx + 64, "native")
    ids, _ = tokenize(model_dir, load_text("builtin")[0])
    adapters = Adapters(model, [split_text(ids, ctx, ctx, 4).calibration])  # as `edgekv eval --ppl builtin` fits them
    budget = parse_budget(args.budget)
    copies = copy_windows(calibration_windows(model_dir, ctx, args.windows)[0], args.spans, args.span_tokens, args.seed)
    tail_tokens = args.spans * args.span_tokens
    rows = []
    with tempfile.TemporaryDirectory() as kv:
        chooser = QualityChooser(model, model_dir, kv, adapters)
        grid = chooser.grid(Variant("kvswap", budget=budget, rule="quality"), ctx,
                            budget_bytes(budget, ctx + 64, model.dims, model.dtype.itemsize))
        natural = chooser.measured(Variant("kvswap", rule="quality"), ctx, grid[: args.limit])
        with Progress(len(natural) + 1, "copy probe") as progress:
            scorer = ConfigScorer(model, kv, adapters, copies, tail_tokens, progress, max_batch=4, label="copy")
            for point in natural:
                with progress.cell(f"copies {quality.point_key(point)}", scorer.steps) as on_event:
                    rows.append({**point, **copy_row(scorer, model, kv, adapters, quality.run_config(point, ctx), on_event)})
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    for r in sorted(rows, key=lambda r: r["copy_kl"]):
        print(f"M*G {r['mg_tokens']:>5} sigma {r['sigma']:6.2f} {r['klr_dtype']:>8} S={r['sink_tokens']} "
              f"W={r['window_tokens']:<3} {r['correction']:>9}  next tokens {r['ppl_ratio']:.3f} / {r['top1_agreement']:.3f}"
              f"  copies: KL {r['copy_kl']:.4f} recall {r['copy_recall']:.3f}")


if __name__ == "__main__":
    main()
