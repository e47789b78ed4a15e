"""`edgekv energy`: the energy a command uses."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

NAME = "energy"


def add(sub) -> None:
    en = sub.add_parser("energy", help="energy of a command: J, average and peak W, per phase when it runs edgekv")
    en.add_argument("--meter", default="auto", choices=["auto", "rapl", "ina3221", "jtop", "nvml", "xrt"])
    en.add_argument("--platform", help="meter order for auto (default: every meter)")
    en.add_argument("--rate-hz", type=float, default=10.0)
    en.add_argument("--json")
    en.add_argument("--csv", help="the power trace")
    en.add_argument("--png", help="power over time with prefill/decode shaded")
    en.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command [args]")
    en.set_defaults(func=run)


def run(args) -> int:
    import subprocess

    from edgekv.platforms import energy
    from edgekv.platforms.power import MeterUnavailable, open_meter

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise ValueError("no command to measure; usage: edgekv energy --json out.json -- <command> [args]")
    try:
        meter = open_meter(args.meter, args.platform, args.rate_hz)
    except MeterUnavailable as exc:
        print(f"edgekv energy: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        events_file = os.path.join(tmp, "events.jsonl")
        try:
            meter.start()
        except MeterUnavailable as exc:  # its first reading failed: nothing to measure, the command not run
            meter.close()
            print(f"edgekv energy: {exc}", file=sys.stderr)
            return 2
        try:
            rc = subprocess.run(command, env={**os.environ, "EDGEKV_EVENTS_FILE": events_file}).returncode
        finally:
            trace = meter.stop()
            meter.close()
        events = energy.read_events(events_file)
    result = energy.report(trace, events).to_json() | {"command": command, "returncode": rc}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.csv:
        energy.write_csv(args.csv, trace)
    if args.png:
        energy.plot(args.png, trace, events)
    if result.get("error"):
        print(f"edgekv energy: {result['error']}", file=sys.stderr)
        return rc or 3
    return rc
