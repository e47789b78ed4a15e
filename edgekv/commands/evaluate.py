"""`edgekv eval`: retrieval accuracy (or perplexity) per policy and KV budget."""
from __future__ import annotations

from edgekv.commands import common
from edgekv.commands.common import KV_PATHS_HELP

NAME = "eval"
MEMORY = "--contexts or --samples"  # what its memory grows with: named when it runs out
KV_FOLDERS = "existing"


def add(sub) -> None:
    from edgekv.runtime.checkpoints import MODEL_HELP

    ev = sub.add_parser("eval", help="RULER-style retrieval accuracy per policy and KV budget")
    ev.add_argument("--model", default="fixture", help=MODEL_HELP)
    ev.add_argument("--policies", default="full,kvswap,token")
    ev.add_argument("--budgets", default="1/13,1/34", help="fractions of the full KV cache")
    ev.add_argument("--contexts", default="4096")
    ev.add_argument("--tasks", default="all")
    ev.add_argument("--samples", type=int, help="instances per task and context (default 20); with --ppl, windows per context (default 4)")
    ev.add_argument("--ppl", metavar="TEXT_FILE|builtin",
                    help="perplexity of a text's continuation through the decode path instead of retrieval tasks")
    ev.add_argument("--ppl-tokens", type=int, default=256, help="continuation tokens per window, teacher-forced (with --ppl)")
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--rule", default="quality", choices=["quality", "mg_const"],
                    help="how a budget becomes kvswap's configuration: the lowest measured loss that fits it (quality; "
                         "measured once per model, context and budget on calibration text, then cached), or KVSwap's "
                         "M*G = 400 with the smallest sigma that fits (mg_const)")
    ev.add_argument("--configs-from", metavar="EVAL_JSON",
                    help="with --rule quality: kvswap runs the configurations an earlier eval chose (its --json, tasks "
                         "or --ppl) at the same contexts and budgets, instead of measuring the choice again")
    ev.add_argument("--ablations", action="store_true",
                    help="also, at the last budget: the loss taken apart (oracle top-k, sigma=1, softmax votes, no sinks/"
                         "window, M*G = 400); with tasks also no rolling buffer, reuse forced off/on, other G")
    ev.add_argument("--group-size", type=int, default=4, help="G of the kvswap rows (token is always G=1)")
    ev.add_argument("--score-reduce", default="sum", choices=["sum", "softmax"],
                    help="predictor: logits summed over heads (KVSwap), or each head's softmax summed")
    ev.add_argument("--adapter", help="low-rank adapter safetensors (default: one per sigma, calibrated on task prompts of another seed)")
    ev.add_argument("--kv-path", default=None, help="folder for the KV files (default: the system temp dir)")
    ev.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help=KV_PATHS_HELP)
    ev.add_argument("--niah", metavar="PNG", help="also a needle-in-a-haystack heatmap (contexts x depths)")
    ev.add_argument("--recall-sigmas", metavar="LIST", help="also the predictor's selection recall per sigma, e.g. 2,4,8,16")
    ev.add_argument("--record-dtype", default="auto", metavar="LIST",
                    help="disk record formats (fp16, int8, int4): each kvswap, token and flexgen row is run again with "
                         "them (same configuration, other records), labelled e.g. kvswap@1/13,int8")
    ev.add_argument("--json")
    common.add_compute_flags(ev)
    common.add_weights_flag(ev, "--ppl only")
    ev.set_defaults(func=run)


def run(args) -> int:
    import torch

    from edgekv.evals import harness
    from edgekv.evals.variants import eval_variants
    from edgekv.runtime.checkpoints import resolve_checkpoint

    model = resolve_checkpoint(args.model)
    kv_paths = common.kv_paths(args)
    tasks = list(harness.TASKS) if args.tasks == "all" else args.tasks.split(",")
    budgets = [common.parse_budget(b) for b in args.budgets.split(",")]
    main = {"G": args.group_size, "score_reduce": args.score_reduce}
    variants = eval_variants(args.policies.split(","), budgets, main, args.rule,
                             common.record_dtypes(args.record_dtype), args.ablations, tasks=not args.ppl)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.weights not in (None, "native") and not args.ppl:
        raise ValueError(f"--weights {args.weights} is measured by perplexity only: add --ppl builtin (or a text file)")
    if args.configs_from and args.rule != "quality":
        raise ValueError("--configs-from replays the quality rule's choices; drop it or use --rule quality")
    if args.ppl:
        return _eval_ppl(args, model, variants, contexts, kv_paths)
    with common.scratch_kv(kv_paths) as kv:
        results = harness.evaluate(model, kv, variants, contexts, tasks, args.samples or 20, args.seed,
                                   adapter_path=args.adapter, quiet=args.quiet, configs_from=args.configs_from,
                                   device=args.device, dtype=args.dtype)
    print(harness.table(results))
    meta = {"model": args.model, "checkpoint": str(model), "seed": args.seed, "samples": args.samples or 20,
            "command": args.command_line}
    if args.niah:
        depths = [i / 10 for i in range(11)]
        variant = next((v for v in variants if v.budget is not None and not v.ablation), variants[0])
        with common.scratch_kv(kv_paths) as kv:
            grid = harness.niah_grid(model, kv, variant, contexts, depths, max(1, (args.samples or 20) // 4), args.seed,
                                     adapter_path=args.adapter)
        harness.plot_niah(args.niah, grid, contexts, depths, f"NIAH, {variant.label}")
        meta["niah"] = {"variant": variant.label, "contexts": contexts, "depths": depths, "accuracy": grid.tolist()}
        print(f"NIAH heatmap ({variant.label}) written to {args.niah}")
    if args.recall_sigmas:
        from edgekv.evals.recall import selection_recall
        from edgekv.runtime.model import load_model

        sigmas = [float(x) for x in args.recall_sigmas.split(",")]
        decoder = load_model(model, torch.device("cpu"), torch.float32, max(contexts) + 64)
        fmt = harness.task_format(model)
        calibration = [i.context for i in harness.make_set(tasks, contexts[0], 1, args.seed + 1, fmt)]
        rows = selection_recall(decoder, harness.make_set(tasks, contexts[0], max(1, (args.samples or 20) // 2), args.seed, fmt),
                                sigmas, G=4, picked_groups=max(1, contexts[0] // 34 // 4), calibration=calibration)
        meta["selection_recall"] = rows
        for row in rows:
            print(f"sigma {row['sigma']:g} (rank {row['rank']}): top-M recall {row['recall']:.3f}, "
                  f"needle group picked {row['needle_hit']:.3f}")
    if args.json:
        harness.write_json(args.json, results, meta)
    return 0


def _eval_ppl(args, model, variants, contexts, kv_paths: list[str] | None) -> int:
    from edgekv.evals import perplexity

    if args.niah or args.recall_sigmas or args.adapter:
        raise ValueError("--ppl runs perplexity only; drop --niah/--recall-sigmas/--adapter")
    text, source = perplexity.load_text(args.ppl)
    ids, tokens = perplexity.tokenize(model, text)
    with common.scratch_kv(kv_paths) as kv:
        results = perplexity.evaluate_ppl(model, kv, variants, contexts, ids, args.samples or 4, args.ppl_tokens,
                                          quiet=args.quiet, configs_from=args.configs_from, device=args.device,
                                          dtype=args.dtype, weights=args.weights)
    print(perplexity.table(results))
    for line in perplexity.oracle_gap(results):
        print(line)
    if args.json:
        meta = {"model": str(args.model), "checkpoint": str(model), "text": source,
                "tokens": tokens, "windows": args.samples or 4,
                "continuation_tokens": args.ppl_tokens, "command": args.command_line}
        perplexity.write_json(args.json, results, meta)
    return 0
