"""`edgekv bench`: decode throughput of every policy side by side."""
from __future__ import annotations

from edgekv.commands import common
from edgekv.commands.common import KV_PATHS_HELP, UsageError

NAME = "bench"
MEMORY = "--contexts or --batches"  # what its memory grows with: named when it runs out
CHECK_AFTER = "numbers"  # the contexts must fit once --contexts, --batches, --steps are numbers
KV_FOLDERS = "existing"


def policy_names() -> tuple[str, ...]:
    """--policies lists bench rows (every registered policy, its variants such as kvswap-noreuse, llama.cpp)."""
    from edgekv.bench import row_names

    return row_names()


def add(sub) -> None:
    from edgekv.runtime.checkpoints import MODEL_HELP

    be = sub.add_parser("bench", help="decode throughput of every policy side by side (same model, prompts, budget)")
    be.add_argument("--quick", action="store_true", help="fixture, 4K context, batch 2, 4 steps, budget 1/13 (< 1 min)")
    be.add_argument("--model", default="fixture", help=MODEL_HELP)
    be.add_argument("--batches", default="1,2,4")
    be.add_argument("--contexts", default="4096,16384")
    be.add_argument("--budgets", default="1/13,1/34", help="fractions of the full KV cache of the batch")
    be.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    be.add_argument("--warmup", type=int, default=4, help="decode steps excluded from timing")
    be.add_argument("--quality-configs", metavar="EVAL_JSON",
                    help="also time kvswap-quality rows: the configurations an `edgekv eval --json` run chose by measured "
                         "quality, per context and budget, beside the solver's kvswap rows (M*G = 400)")
    be.add_argument("--policies", default="full,flexgen,token,kvswap-noreuse,kvswap,kvswap-noverify,kvswap-quality,llama.cpp",
                    help="rows; llama.cpp runs when the model is a GGUF file and llama-cpp-python is installed")
    be.add_argument("--quiet", action="store_true", help="no progress bars")
    be.add_argument("--disk-seconds", type=float, default=10, help="time for the disk profile the solver and ratios use")
    be.add_argument("--kv-path", default=None, help="folder on the disk to measure (default: the system temp dir)")
    be.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help=KV_PATHS_HELP)
    be.add_argument("--path-limit-mib-s", type=float, metavar="MIB_S",
                    help="pace each KV path's reads to this rate (several emulated disks on one)")
    be.add_argument("--prompts", choices=("random", "tasks"), default="random",
                    help="random tokens, or the eval's retrieval tasks (text with structure: what clustering and reuse "
                         "feed on)")
    be.add_argument("--record-dtype", default="auto", metavar="LIST",
                    help="disk record formats (fp16, int8, int4): each kvswap, token and flexgen row is run again with "
                         "them (same configuration, other records), labelled e.g. kvswap,int8")
    be.add_argument("--json")
    be.add_argument("--png", help="throughput vs batch and kvswap step time vs context")
    common.add_compute_flags(be)
    common.add_weights_flag(be, "default native; SmolLM2 ppl: int8 1.37x fp32's, int4 1.0007x")
    be.set_defaults(func=run)


def prepare(args) -> None:
    """--quick: its sizes replace the flags' before any flag is checked."""
    if args.quick:
        args.batches, args.contexts, args.budgets, args.steps, args.warmup, args.disk_seconds = "2", "4096", "1/13", 4, 2, 2


def check(args) -> None:
    """Each context leaves a prompt (bench.bench_point: context - steps - warmup - 8 - 4 * (batch - 1) tokens)."""
    shortest = min(common.whole_list("--contexts", args.contexts))
    batch = max(common.whole_list("--batches", args.batches))
    least = args.steps + args.warmup + 8 + 4 * (batch - 1) + 1
    if shortest < least:
        raise UsageError(f"--contexts {shortest} leaves no prompt before {args.steps} --steps, {args.warmup} "
                         f"--warmup steps at --batches {batch}; give contexts of at least {least}")


def run(args) -> int:
    from edgekv import bench
    from edgekv.runtime.checkpoints import resolve_checkpoint

    checkpoint = resolve_checkpoint(args.model)
    kv_paths = common.kv_paths(args)
    with common.scratch_kv(kv_paths) as kvs:
        runs, meta = bench.run(checkpoint, kvs[0], [int(b) for b in args.batches.split(",")],
                               [int(c) for c in args.contexts.split(",")], args.budgets.split(","), args.steps,
                               args.warmup, args.disk_seconds, args.policies.split(","), quiet=args.quiet,
                               chosen_from=args.quality_configs,
                               record_dtypes=common.record_dtypes(args.record_dtype),
                               kv_paths=kvs if args.kv_paths else None, path_limit_mib_s=args.path_limit_mib_s,
                               prompt_source=args.prompts, device=args.device, dtype=args.dtype, weights=args.weights)
    meta.update(model=args.model, checkpoint=str(checkpoint), command=args.command_line)
    print(bench.table(runs))
    for point, why in meta.get("llama_cpp_failed", {}).items():  # "{batch}x{context}": no llama.cpp row there
        print(f"{bench.LLAMA_CPP_ROW} at {point}: {why}")
    if meta["synthetic_weights"]:
        print(f"{args.model}: synthetic weights (random, in the architecture's shape): speed and memory only")
    if "paths" in meta:
        print(bench.notes(meta))
    print(f"reproduce: {meta['command']}  (decode only; {args.warmup} warm-up steps excluded; "
          f"O_DIRECT={all(r.o_direct for r in runs if r.o_direct is not None)})")
    if args.json:
        bench.write_json(args.json, runs, meta)
    if args.png:
        bench.plot(runs, args.png)
    return 0
