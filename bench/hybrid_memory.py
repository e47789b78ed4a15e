"""Resident KV of each row of a perplexity eval on a hybrid model, beside the same configuration with every layer
treated as global (what a KV offloader that ignores sliding windows keeps), from the runtime's own memory plan.

    python -m bench.hybrid_memory EVAL_JSON --model gemma3-270m [--json OUT]

Each row's configuration is the one the eval ran (its ``config``), for one sequence at the row's context; the
quality is the eval's (the ratio and top-1 agreement it measured), the bytes are what ``plan_memory`` allocates.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from edgekv.runtime import policies
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.config import RuntimeConfig
from edgekv.runtime.memory import BudgetError, plan_memory
from edgekv.runtime.model import ModelDims, read_model_config
from edgekv.runtime.policies.disk import record_layout

MIB = 2**20


def resident_mib(policy: str, config: dict, dims: ModelDims, dtype: torch.dtype) -> float | None:
    """One sequence's planned resident KV in MiB; None when the configuration does not fit its budget that way."""
    known = set(RuntimeConfig.keys())
    cfg = policies.get(policy).effective_config(RuntimeConfig.load({k: v for k, v in config.items() if k in known}
                                                                   | {"max_batch": 1}))
    rank = LowRankAdapter.rank_for(dims.n_kv_heads, dims.head_dim, cfg.sigma)
    stride = record_layout(cfg, dims, dtype).stride_bytes
    try:
        return plan_memory(policy, cfg, dims, torch.empty(0, dtype=dtype).element_size(), rank, stride).total_bytes / MIB
    except BudgetError:
        return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("eval_json")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dims = ModelDims.from_config(read_model_config(resolve_checkpoint(args.model)))
    flat = dataclasses.replace(dims, layer_windows=())
    dtype = getattr(torch, args.dtype)
    rows = []
    for row in json.loads(open(args.eval_json).read())["ppl"]:
        config = {**row["config"], "max_kv_mem_mib": None}  # the plan itself, not the budget check
        hybrid, as_global = resident_mib(row["policy"], config, dims, dtype), resident_mib(row["policy"], config, flat, dtype)
        rows.append({"variant": row["variant"], "context": row["context"], "ppl_ratio": round(row["ratio_to_full"], 4),
                     "top1": round(row["top1_agreement"], 4), "resident_mib": round(hybrid, 2),
                     "all_global_mib": round(as_global, 2), "share": round(hybrid / as_global, 4)})
        print(f"{row['context']:>6} {row['variant']:<16} ppl x {row['ratio_to_full']:.4f}  top-1 {row['top1_agreement']:.3f}  "
              f"resident {hybrid:8.2f} MiB  all layers global {as_global:8.2f} MiB  ({hybrid / as_global:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
