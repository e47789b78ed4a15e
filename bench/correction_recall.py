"""What leaving well-guessed layers uncorrected costs in quality (``correction_recall``, runtime/offload.py): perplexity
and top-1 agreement against ``full`` of a configuration an earlier eval chose (``--configs-from``), corrected at every
layer, at each ``--recalls`` threshold, and guess-only, on the same windows of the eval text (with ``--from-before``,
each corrected row with ``guess_from_before`` off, and again on).  Its speed is ``bench.correction_cost --recalls``.

    python -m bench.correction_recall --model smollm2 --context 8192 --budget 1/13 \\
        --configs-from docs/results/chosen-smollm2-8k-deployed-top1.json --recalls 0.9,0.85,0.8 --json out.json
"""
import argparse

from edgekv.commands import common
from edgekv.evals import perplexity
from edgekv.evals.harness import Variant
from edgekv.runtime.checkpoints import resolve_checkpoint


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", default="1/13")
    ap.add_argument("--configs-from", required=True, metavar="EVAL_JSON", help="the configuration to run (edgekv eval)")
    ap.add_argument("--recalls", default="0.9,0.85,0.8", help="correction_recall thresholds, each a row")
    ap.add_argument("--from-before", action="store_true", help="each corrected row with guess_from_before off, and "
                    "again with it on (a ',from before' row)")
    ap.add_argument("--ppl", default="builtin")
    ap.add_argument("--samples", type=int, default=4, help="windows")
    ap.add_argument("--ppl-tokens", type=int, default=256)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="what every row computes in (default float32 on the CPU: the dtype the tables were measured in)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    budget = common.parse_budget(args.budget)
    row = lambda name="", **over: Variant("kvswap", budget, rule="quality", ablation=name,  # noqa: E731
                                          overrides=tuple(over.items()))
    recalls = [float(r) for r in filter(None, args.recalls.split(","))]
    corrected = [("", 1.0), *((f"recall={r:g}", r) for r in recalls)]
    pinned = {"guess_from_before": False} if args.from_before else {}  # else the runtime's default
    variants = [*(row(name, correction_recall=r, **pinned) if r < 1 or pinned else row() for name, r in corrected),
                *(row(f"{name},from before".lstrip(","), correction_recall=r, guess_from_before=True)
                  for name, r in corrected if args.from_before),
                row("guess", correction="guess")]
    model = resolve_checkpoint(args.model)
    text, source = perplexity.load_text(args.ppl)
    ids, tokens = perplexity.tokenize(model, text)
    with common.scratch_kv(None) as kv:
        results = perplexity.evaluate_ppl(model, kv, variants, [args.context], ids, args.samples, args.ppl_tokens,
                                          configs_from=args.configs_from, dtype=args.dtype)
    print(perplexity.table(results))
    if args.json:
        perplexity.write_json(args.json, results, {"model": args.model, "checkpoint": str(model), "text": source,
                                                   "tokens": tokens, "windows": args.samples,
                                                   "continuation_tokens": args.ppl_tokens,
                                                   "configs_from": args.configs_from, "dtype": args.dtype or "default"})


if __name__ == "__main__":
    main()
