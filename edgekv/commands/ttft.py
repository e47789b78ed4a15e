"""`edgekv ttft`: time to first token with a stored context, per link rate."""
from __future__ import annotations

from pathlib import Path

from edgekv.commands import common

NAME = "ttft"
MEMORY = "--contexts"  # what its memory grows with: named when it runs out
KV_FOLDERS = "existing"


def add(sub) -> None:
    from edgekv.runtime.checkpoints import MODEL_HELP

    tt = sub.add_parser("ttft", help="time to first token with a stored context: full prefill, load-only, "
                                     "bidirectional (Cake) and edgekv's load-or-compute plan, per link rate")
    tt.add_argument("--model", default="fixture", help=MODEL_HELP)
    tt.add_argument("--contexts", default="8192")
    tt.add_argument("--link-mib-s", default="50,100,200,400", help="store read rates to emulate (pacing the reads)")
    tt.add_argument("--drop-at", type=float, help="halve the link rate once this fraction of the load-only time has passed")
    tt.add_argument("--kv-path", help="folder on the KV disk for the store (default: the system temp dir)")
    tt.add_argument("--chunk-tokens", type=int, default=512)
    tt.add_argument("--new-tokens", type=int, default=8, help="greedy tokens compared with full prefill's")
    tt.add_argument("--costs", help="compute cost model JSON from `python -m edgekv.install.chunk_profile` "
                                    "(default: profiled and fit here, the report in the JSON)")
    tt.add_argument("--text", default="builtin", help="the context text: builtin (license texts) or a file")
    tt.add_argument("--json", help="write {runs: [...]} here")
    tt.add_argument("--png", help="TTFT vs link rate plot")
    tt.add_argument("--quiet", action="store_true")
    common.add_compute_flags(tt)
    tt.set_defaults(func=run)


def run(args) -> int:
    from edgekv import ttft_bench

    rates = [float(r) for r in args.link_mib_s.split(",") if r]
    costs = common.cost_model(args.costs) if args.costs else None
    contexts = [int(c) for c in args.contexts.split(",")]
    meta = {"model": args.model, "contexts": contexts, "link_mib_s": rates, "drop_at": args.drop_at,
            "chunk_tokens": args.chunk_tokens, "costs": args.costs}
    runs = ttft_bench.run(args.model, contexts, rates, args.drop_at, args.kv_path, chunk_tokens=args.chunk_tokens,
                          new_tokens=args.new_tokens, costs=costs, quiet=args.quiet, text=args.text, meta=meta,
                          device=args.device, dtype=args.dtype)
    print(ttft_bench.table(runs))
    if args.json:
        ttft_bench.write_json(Path(args.json), runs, meta)
    if args.png:
        ttft_bench.plot(runs, Path(args.png))
    return 0
