"""Measure a profile's quality table for a model file and write it as shipped data (``profiles/quality/``).

A default deploy then takes the table from there when the model file (its GGUF's SHA-256) and the settings match,
instead of measuring it (most of an hour for SmolLM2 at 8K on a 2-core CPU).  The table is measured exactly as a
deploy measures it, on a fresh cache:

    python -m tools.ship_quality --platform local --model smollm2 --out profiles/quality/smollm2-local.json

``--add-to-shipped`` keeps the points of the table already shipped for this model file and settings and measures
only what it lacks (the selections of a grown ``solver.corrections``, the int4 twins of ``quality.twins``), as a
deploy would.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from edgekv import deploy
from edgekv.install import quality
from edgekv.runtime.checkpoints import gguf_sha256


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="local")
    ap.add_argument("--model", default=None, help="default: the profile's")
    ap.add_argument("--out", required=True)
    ap.add_argument("--add-to-shipped", action="store_true",
                    help="keep the shipped table's points, measure only the selections and twins it lacks")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgekv-ship-") as scratch:
        d = deploy.prepare(args.platform, args.model, [str(Path(scratch) / "kv")], Path(scratch) / "deploy",
                           not args.add_to_shipped, print)
        sha = gguf_sha256(d.model_dir)
        if sha is None:
            raise SystemExit(f"{d.model_dir} was not converted from a GGUF file: a shipped table names its model by the file")
        cache = Path(scratch) / "cache"
        _, adapters = deploy.lookup_tables(d, cache, None)
        points = deploy.quality_table(d, cache, adapters, None, deploy.solver_limits(d.prof))
        table_path = cache / "tables" / d.model_fp / "quality.json"
        fp = deploy.shipped_fingerprint(json.loads(table_path.read_text())["fingerprint"])
    meta = {"machine": f"{deploy._cpu_model()}, {platform.machine()}", "seconds": round(time.perf_counter() - started),
            "command": f"python -m tools.ship_quality --platform {args.platform}"
                       + (f" --model {args.model}" if args.model else "") + f" --out {args.out}"
                       + (" --add-to-shipped" if args.add_to_shipped else "")}
    if args.add_to_shipped:
        kept = quality.shipped(sha, fp)
        if kept:
            points_of, source, was = list(kept[3]), kept[1].name, kept[2]
            meta["kept"] = f"the points of {points_of} from {source} ({was.get('command')}, {was.get('seconds')} s)"
    quality.ship(Path(args.out), sha, fp, points, meta)
    print(f"{len(points)} points -> {args.out}")


if __name__ == "__main__":
    main()
