"""`edgekv build-native`: compile the native KV reader and kernels."""
from __future__ import annotations

NAME = "build-native"


def add(sub) -> None:
    nat = sub.add_parser("build-native", help="compile the C KV reader (io_uring and pthread backends) and arkv's quantized attention kernel")
    nat.set_defaults(func=run)


def run(args) -> int:
    from edgekv.runtime.native_build import build_all

    for backend, where in build_all().items():
        print(f"{backend}: {where}")
    return 0
