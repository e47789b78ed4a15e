"""The `edgekv` command: the top parser, the checks and the entry point.  Each subcommand lives in its own module
under edgekv/commands/ (its flags, its own checks, its runner): generate.py, serve.py, context.py, ttft.py,
native.py (build-native), deploy.py, evaluate.py (eval), bench.py, energy.py, fpga.py; what they share (the flag
checks every command gets, the KV-folder helpers, the help strings) is in commands/common.py."""
from __future__ import annotations

import argparse
import functools
import logging
import sys

from edgekv.commands import COMMANDS
from edgekv.commands.common import UsageError, check_common
from edgekv.commands.common import record_dtypes as _record_dtypes

__all__ = ["UsageError", "_record_dtypes", "build_parser", "main", "parse_args"]
_BY_NAME = {command.NAME: command for command in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgekv", description="Long-context LLM inference with the KV cache on disk")
    sub = ap.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(sub)
    return ap


def _check_args(args) -> None:
    """Every flag's value checked once, before any model loads; refusals are UsageErrors naming the flag.  The
    command's own check runs at its place among the common ones, so the same error wins when several flags are bad."""
    command = _BY_NAME[args.command]
    if hasattr(command, "prepare"):
        command.prepare(args)
    check_common(args, command)


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, parsed and checked: argparse exits with status 2 naming a flag it cannot parse, and a value
    that cannot work raises UsageError naming its flag.  No model is loaded here."""
    args = _parsed(argv)
    _check_args(args)
    return args


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()  # built once: parsing does not change it, and building takes tens of ms


def _parsed(argv) -> argparse.Namespace:
    for item in sys.argv[1:] if argv is None else argv:
        flag, equals, value = item.partition("=")
        if flag.startswith("--") and equals and value == "--":  # argparse would strip it and hand on an empty list
            _parser().error(f"argument {flag}: '--' is not a value (argparse reads it as the end of the options); "
                            "give the value itself")
    args = _parser().parse_args(argv)
    args.command_line = " ".join(["edgekv", *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parsed(argv)
    try:
        _check_args(args)
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"edgekv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # e.g. numpy's "Unable to allocate 7.28 TiB" for a context nobody can hold
        print(f"edgekv {args.command}: error: out of memory ({exc}); ask for less: "
              f"{getattr(_BY_NAME[args.command], 'MEMORY', 'smaller sizes')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
