"""``make gpu-check``: what a user runs first on an Orin or an RTX box, and what a lent GPU machine runs.

1. The ``cuda`` test suite (tests/test_cuda.py: every policy on the GPU against the CPU's fp32 tokens and
   Hugging Face's greedy tokens in fp16/bf16).
2. ``edgekv bench`` on ``synth:llama-3.1-8b`` (random weights in Llama 3.1 8B's shapes: speed and memory only) at
   16K and 32K, batch 1, 4 and 8, budget 1/13, policies full, flexgen, kvswap, kvswap-ram (kvswap with its KV
   in RAM: the step with every read in memory, which kvswap's overlap is measured against) and kvswap-mapped
   (its slots in pinned host memory the GPU reads in place: a Jetson's layout, no copy).

Both land in one JSON (and the bench's plot) with the GPU, its driver and CUDA, torch and the KV disk named:

    .venv/bin/python -m edgekv.gpu_check --json deploy/gpu-check.json --png deploy/gpu-check.png

That takes well over ten minutes (flexgen reads the whole KV every step).  ``--quick`` (``make gpu-check QUICK=1``)
is what fits a few minutes of a lent machine: the suite, 16K at batch 1/4/8 without flexgen, then flexgen beside
kvswap at 16K x 1 (``flexgen_beside_kvswap`` in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

MODEL = "synth:llama-3.1-8b"
CONTEXTS, BATCHES, BUDGETS = (16384, 32768), (1, 4, 8), ("1/13",)
POLICIES = ("full", "flexgen", "kvswap", "kvswap-ram", "kvswap-mapped")
# --quick: what fits a lent machine's few minutes (about 5 on an H200, suite included;
# docs/results/gpu): 16K at batch 1/4/8 without flexgen, whose step reads the whole KV, then flexgen beside kvswap at 16K x 1
QUICK = {"contexts": "16384", "batches": "1,4,8", "steps": 8, "warmup": 2, "disk_seconds": 2.0,
         "policies": "full,kvswap,kvswap-ram,kvswap-mapped"}
QUICK_FLEXGEN = {"contexts": [16384], "batches": [1], "steps": 1, "warmup": 1, "policies": ["flexgen", "kvswap"]}


def gpu_facts() -> dict:
    import torch

    from edgekv.platforms.devices import gpu_driver

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}", "driver": gpu_driver(), "cuda": torch.version.cuda,
            "torch": torch.__version__, "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False)}


def disk_facts(path: Path) -> dict:
    """The filesystem and block device the KV folder is on (what the bench's reads measure)."""
    out = subprocess.run(["df", "--output=source,fstype,size", str(path)], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    source, fstype, size = lines[-1].split() if len(lines) > 1 else ("unknown", "unknown", "unknown")
    return {"kv_path": str(path), "device": source, "filesystem": fstype, "size_1k_blocks": size}


def run_suite(report: Path) -> dict:
    """The cuda suite in a child pytest (its own process: a failure cannot take this run with it)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                           "tests/test_cuda.py", f"--junitxml={report}"], capture_output=True, text=True,
                          env={**os.environ, "EDGEKV_DEVICE": "cuda"})
    tail = (done.stdout + done.stderr).strip().splitlines()
    return {"returncode": done.returncode, "summary": tail[-1] if tail else "", "seconds": round(time.monotonic() -
                                                                                                 started, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="deploy/gpu-check.json")
    ap.add_argument("--png", default="deploy/gpu-check.png")
    ap.add_argument("--kv-path", help="a folder on the KV disk (default: the system temp dir)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="a subset where time is short")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--policies", default=",".join(POLICIES), help="a subset (e.g. flexgen alone, with fewer steps)")
    ap.add_argument("--disk-seconds", type=float, default=10.0, help="the disk profile's time (fio beside the reader)")
    ap.add_argument("--skip-suite", action="store_true", help="the bench only")
    ap.add_argument("--quick", action="store_true",
                    help="the suite, 16K at batch 1/4/8 (full, kvswap, kvswap-ram, kvswap-mapped; 8 steps), then flexgen "
                         "beside kvswap at 16K x 1: about 5 minutes on an H200 (replaces the bench's other options)")
    ap.add_argument("--quality-configs", metavar="EVAL_JSON",
                    help="the configurations an eval chose, for the kvswap-quality rows (name them in --policies): "
                         "the same in every run, as a before/after needs (the solver's rows follow each run's disk "
                         "profile)")
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.quality_configs and not Path(args.quality_configs).is_file():
        ap.error(f"--quality-configs {args.quality_configs}: no such file (an `edgekv eval --json` output)")
    import torch

    if not torch.cuda.is_available():
        from edgekv.runtime.devices import cuda_fix

        print(f"gpu-check: torch {torch.__version__} sees no CUDA GPU; {cuda_fix()}", file=sys.stderr)
        return 2
    from edgekv import bench
    from edgekv.runtime.checkpoints import resolve_checkpoint

    out = Path(args.json)
    for folder in (out.parent, Path(args.png).parent):  # the defaults are under deploy/, absent before a deploy
        folder.mkdir(parents=True, exist_ok=True)
    result = {"gpu": gpu_facts(), "model": MODEL, "synthetic_weights": True}
    if not args.skip_suite:
        result["cuda_suite"] = run_suite(out.with_suffix(".junit.xml"))
        print(f"cuda suite: {result['cuda_suite']['summary']}")
    contexts, batches = (sorted(int(x) for x in arg.split(",")) for arg in (args.contexts, args.batches))

    def keep(runs, meta=None):  # after every row: a run cut off at its time limit keeps the rows it finished
        result["bench"] = {"complete": meta is not None, "meta": meta, "runs": [asdict(r) for r in runs]}
        out.write_text(json.dumps(result, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="edgekv-gpu-check-", dir=args.kv_path) as kv:
        result["disk"] = disk_facts(Path(kv))
        runs, meta = bench.run(resolve_checkpoint(MODEL), Path(kv), batches, contexts, list(BUDGETS), args.steps,
                               args.warmup, args.disk_seconds, args.policies.split(","), device="cuda", on_row=keep,
                               chosen_from=args.quality_configs)
    keep(runs, meta)
    if args.quick:  # flexgen's step reads the whole KV: one step at one point, beside kvswap in the same run
        with tempfile.TemporaryDirectory(prefix="edgekv-gpu-check-", dir=args.kv_path) as kv:
            flex, flex_meta = bench.run(resolve_checkpoint(MODEL), Path(kv), QUICK_FLEXGEN["batches"],
                                        QUICK_FLEXGEN["contexts"], list(BUDGETS), QUICK_FLEXGEN["steps"],
                                        QUICK_FLEXGEN["warmup"], args.disk_seconds, QUICK_FLEXGEN["policies"],
                                        device="cuda")
        result["flexgen_beside_kvswap"] = {"meta": flex_meta, "runs": [asdict(r) for r in flex]}
        out.write_text(json.dumps(result, indent=1, default=str))
    print(bench.table(runs))
    if args.quick:
        print(bench.table(flex))
    bench.plot(runs, args.png)
    print(f"gpu-check: {out} ({result['gpu']['gpu']}, driver {result['gpu']['driver']}, torch "
          f"{result['gpu']['torch']}, KV on {result['disk']['device']})")
    return 0 if result.get("cuda_suite", {}).get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
