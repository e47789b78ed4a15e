"""Random-read throughput of each KV reader backend beside fio, on one file, in one run.

    python bench/reader.py --dir /var/tmp --block-kib 4,16,64 --depth 32 --seconds 4

The runtime reads one batch of records per layer and step; this reads batches of
``--batch`` random aligned blocks with O_DIRECT, at most ``--depth`` in flight, and reports
MiB/s, IOPS and the ratio to fio (io_uring engine, same block size, queue depth and file)
when fio is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from edgekv.runtime.disk_store import aligned_zeros
from edgekv.runtime.reader import ReadBatch, open_reader


def make_file(path: Path, size_bytes: int) -> None:
    if path.exists() and path.stat().st_size >= size_bytes:
        return
    chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(size_bytes // len(chunk)):
            f.write(chunk)


def reader_mib_s(backend: str, path: Path, block: int, depth: int, batch: int, seconds: float) -> float:
    reader = open_reader(backend, queue_depth=depth)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    blocks = os.fstat(fd).st_size // block
    dest = aligned_zeros((batch, block), 4096)
    addresses = dest.ctypes.data + np.arange(batch, dtype=np.int64) * block
    fds = np.full(batch, fd, dtype=np.int32)
    rng = np.random.default_rng(1)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        offsets = rng.integers(0, blocks, batch, dtype=np.int64) * block
        reader.read(ReadBatch(fds, offsets, addresses, block))
        done += batch
    elapsed = time.perf_counter() - start
    os.close(fd)
    reader.close()
    return done * block / elapsed / 2**20


def fio_mib_s(path: Path, block: int, depth: int, seconds: float) -> float | None:
    if not shutil.which("fio"):
        return None
    out = subprocess.run(
        ["fio", "--name=r", f"--filename={path}", "--rw=randread", f"--bs={block}", f"--iodepth={depth}",
         "--ioengine=io_uring", "--direct=1", f"--runtime={seconds}", "--time_based", "--output-format=json"],
        capture_output=True, text=True,
    )
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)["jobs"][0]["read"]["bw"] / 1024


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--size-gib", type=float, default=2)
    ap.add_argument("--block-kib", default="4,16,64")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--batch", type=int, default=400, help="records per read call (KVSwap: M groups x batch)")
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--backends", default="io_uring,pthread,python")
    args = ap.parse_args(argv)
    path = Path(args.dir) / "edgekv-reader-bench.bin"
    make_file(path, int(args.size_gib * 2**30))
    print(f"{'block':>6} {'backend':>9} {'MiB/s':>8} {'IOPS':>8} {'vs fio':>7}")
    for kib in (int(b) for b in args.block_kib.split(",")):
        block = kib * 1024
        fio = fio_mib_s(path, block, args.depth, int(args.seconds))
        if fio:
            print(f"{kib:>5}K {'fio':>9} {fio:8.0f} {fio * 2**20 / block:8.0f} {1:7.2f}")
        for backend in args.backends.split(","):
            mib = reader_mib_s(backend, path, block, args.depth, args.batch, args.seconds)
            ratio = f"{mib / fio:7.2f}" if fio else "      -"
            print(f"{kib:>5}K {backend:>9} {mib:8.0f} {mib * 2**20 / block:8.0f} {ratio}")
    path.unlink()


if __name__ == "__main__":
    main()
