"""Read requests per step with the records in token order or laid out by co-activation, on one recorded trace.

    python bench/coactivation.py --model fixture --context 8192 --batch 4 --steps 64 --recluster 8,16 --json out.json

Records kvswap's picks on the eval's retrieval prompts (the engine's "groups_selected" events), then replays
them: the groups a step reads (every pick without reuse, the reuse buffer's misses with it) are turned into
requests by the store's own coalescing rule, once with records in token order and once after the groups the
first R steps picked were laid out again by ``CoactivationLayout.refine`` (what ``recluster_steps`` does live).
Only the steps after R are counted, so the figure is what a long decode sees once the layout is refined; the
bench's ``kvswap/Np+cluster`` rows average over every step, the R before it included.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgekv.bench import task_prompts
from edgekv.runtime import Engine, RuntimeConfig
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.cluster import CoactivationLayout
from edgekv.runtime.disk_store import request_starts
from edgekv.runtime.model import load_model
from edgekv.runtime.placement import Placement
from edgekv.runtime.slots import SlotTable


def record_picks(model, model_dir: Path, context: int, batch: int, steps: int, config: dict) -> list:
    """The kvswap picks of ``steps`` decode steps over task prompts: (layer, groups [B, M], valid [B, M])."""
    prompts = task_prompts(model_dir, batch, context - steps - 8, torch.Generator().manual_seed(context))
    trace = []
    keep = lambda e: trace.append((e.info["layer"], e.info["groups"].copy(), e.info["valid"].copy())) \
        if e.kind == "groups_selected" else None  # noqa: E731
    with tempfile.TemporaryDirectory(dir="/var/tmp") as kv, \
            Engine(model, RuntimeConfig.load(config), "kvswap", kv) as engine:
        engine.events.subscribe(keep)
        engine.generate(prompts, max_new_tokens=steps + 1, stop_token_ids=[])
    return trace


def reads_per_step(trace, n_layers: int, batch: int, capacity: int | None, n_groups: int) -> list[list[list[np.ndarray]]]:
    """[layer][step][seq] the groups each step reads: every pick (capacity None), or a FIFO buffer's misses."""
    out = [[] for _ in range(n_layers)]
    table = SlotTable(n_layers, batch, capacity, n_groups) if capacity else None
    for layer, groups, valid in trace:
        if table is None:
            out[layer].append([groups[b][valid[b]] for b in range(batch)])
        else:
            _, misses = table.assign(layer, groups, valid)
            out[layer].append([misses.group[misses.seq == b] for b in range(batch)])
    return out


def requests(placement: Placement, groups: np.ndarray, max_records: int) -> int:
    """Requests the store makes for ``groups`` of one (sequence, layer) placed by ``placement`` (first copies)."""
    path, index = (copy[:, 0] for copy in placement.copies(0, groups))
    order = np.lexsort((index, path))
    return len(request_starts(path[order].astype(np.int32), index[order], 1, max_records))


def replay(reads, placer: CoactivationLayout, n_groups: int, n_paths: int, recluster: int, max_records: int) -> dict:
    """Requests and records per step after step ``recluster``, token order vs the refined layout (the store's own
    ``Placement``, moved as ``DiskKVStore.relocate`` moves it)."""
    striped = Placement(1, n_groups, n_paths)
    striped.stripe(0, np.arange(n_groups))
    totals = {"token": 0, "clustered": 0, "records": 0, "steps": 0}
    for per_layer in reads:
        for b in range(len(per_layer[0])):
            picks = np.zeros((recluster, n_groups), dtype=bool)
            for step in range(recluster):
                picks[step, per_layer[step][b]] = True
            refined = Placement(1, n_groups, n_paths)
            refined.stripe(0, np.arange(n_groups))
            refined.move(0, placer.refine(picks, n_paths)[0])
            for step in range(recluster, len(per_layer)):
                groups = per_layer[step][b]
                totals["token"] += requests(striped, groups, max_records)
                totals["clustered"] += requests(refined, groups, max_records)
                totals["records"] += len(groups)
        totals["steps"] = len(per_layer) - recluster
    steps = totals["steps"]
    return {"requests_per_step_token": totals["token"] / steps, "requests_per_step_clustered": totals["clustered"] / steps,
            "records_per_step": totals["records"] / steps, "ratio": totals["token"] / max(1, totals["clustered"])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fixture")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--G", type=int, default=2)
    parser.add_argument("--M", type=int, default=200)
    parser.add_argument("--sigma", type=float, default=2)
    parser.add_argument("--recluster", default="8,16")
    parser.add_argument("--paths", default="1,2,4")
    parser.add_argument("--max-request-bytes", type=int, default=262144)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    model_dir = resolve_checkpoint(args.model)
    model = load_model(model_dir, torch.device("cpu"), torch.float32, args.context + 64)
    config = {"G": args.G, "M": args.M, "C": args.M, "sigma": args.sigma, "max_context": args.context,
              "max_batch": args.batch}
    trace = record_picks(model, model_dir, args.context, args.batch, args.steps, config)
    cfg = RuntimeConfig.load(config)
    n_groups = -(-args.context // args.G)
    from edgekv.runtime.engine import _record_layout

    stride = _record_layout(cfg, model.dims, model.dtype).stride_bytes
    placer = CoactivationLayout(cfg.placement.cluster_queries, cfg.placement.cluster_radius, 0.0, model.scaling, stride)
    rows = []
    for reuse, capacity in (("no reuse", None), (f"FIFO C={args.M}", args.M)):
        reads = reads_per_step(trace, model.dims.n_layers, args.batch, capacity, n_groups)
        for n_paths in (int(p) for p in args.paths.split(",")):
            for recluster in (int(r) for r in args.recluster.split(",")):
                row = {"reuse": reuse, "n_paths": n_paths, "recluster_steps": recluster,
                       **replay(reads, placer, n_groups, n_paths, recluster, max(1, args.max_request_bytes // stride))}
                rows.append(row)
                print(f"{reuse:12s} paths {n_paths} R={recluster:3d}: requests/step token order "
                      f"{row['requests_per_step_token']:8.1f}, clustered {row['requests_per_step_clustered']:8.1f} "
                      f"(x{row['ratio']:.2f}) for {row['records_per_step']:.1f} records/step", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
