"""Fault injection at the KV reader: a wrapper around a real reader that damages one read of a run, and a
campaign that counts what the engine did about it.

Faults (one per run, at a random read):
  flip_memory  one bit of a record flipped after it landed in memory (a transient: DRAM, bus, DMA)
  flip_disk    one bit of a record flipped in its file before it is read (a persistent media error)
  torn_disk    the second half of a record overwritten with zeros in its file (a torn or lost write)
  eio          the read fails with EIO
  short        the record's file truncated before it is read (the reader meets its end: a short read)
  hang         the read blocks past the engine's read deadline

    .venv/bin/python -m bench.faults --trials 1200 --json docs/results/faults-campaign.json
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from edgekv.runtime.reader import KVReader, ReadBatch, record_starts

DAMAGE = ("flip_memory", "flip_disk", "torn_disk")
FAILURES = ("eio", "short", "hang")
FAULTS = DAMAGE + FAILURES


def record_location(batch: ReadBatch, i: int) -> tuple[int, int]:
    """(fd, file offset) of record ``i`` of a batch (in address order)."""
    starts = record_starts(batch)
    r = int(np.searchsorted(starts, i, side="right") - 1)
    return int(batch.fds[r]), int(batch.offsets[r]) + (i - int(starts[r])) * batch.nbytes


def rewrite(fd: int, offset: int, nbytes: int, change) -> None:
    """Replace bytes [offset, offset + nbytes) of the file behind ``fd`` by ``change(old bytes)``, through a
    buffered fd of its own (the KV fd may be O_DIRECT); a direct read afterwards writes the page cache back
    first, so it sees the change."""
    own = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        os.pwrite(own, change(os.pread(own, nbytes, offset)), offset)
        os.fsync(own)
    finally:
        os.close(own)


def _flip(byte: int, bit: int):
    return lambda data: data[:byte] + bytes([data[byte] ^ (1 << bit)]) + data[byte + 1 :]


def _tear(data: bytes) -> bytes:
    """The second half never written."""
    return data[: len(data) // 2] + bytes(len(data) - len(data) // 2)


class FaultyReader(KVReader):
    """The real reader, with ``fault`` done to the ``at``-th read batch that has records (once).

    ``record_bytes``: the records' payload (a flip lands inside it, not in the alignment padding).
    ``injected`` says what was done (None before)."""

    name = "faulty"

    def __init__(self, inner: KVReader, record_bytes: int, fault: str, at: int, seed: int = 0, hang_s: float = 2.0):
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.inner, self.record_bytes, self.fault, self.at, self.hang_s = inner, record_bytes, fault, at, hang_s
        self.rng = np.random.default_rng(seed)
        self.reads = 0
        self.injected: dict | None = None
        self.released = threading.Event()

    def read(self, batch: ReadBatch) -> None:
        if batch.n_records == 0 or self.injected is not None:
            return self.inner.read(batch)
        self.reads += 1
        if self.reads - 1 != self.at:
            return self.inner.read(batch)
        i = int(self.rng.integers(batch.n_records))
        fd, offset = record_location(batch, i)
        byte, bit = int(self.rng.integers(self.record_bytes)), int(self.rng.integers(8))
        self.injected = {"fault": self.fault, "record": i, "offset": offset, "byte": byte, "bit": bit}
        if self.fault == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if self.fault == "hang":
            self.released.wait(self.hang_s)
        if self.fault == "flip_disk":
            rewrite(fd, offset, self.record_bytes, _flip(byte, bit))
        if self.fault == "torn_disk":
            rewrite(fd, offset, self.record_bytes, _tear)
        if self.fault == "short":
            os.truncate(f"/proc/self/fd/{fd}", offset)
        self.inner.read(batch)
        if self.fault == "flip_memory":
            address = int(batch.addresses[i]) + byte
            ctypes.c_uint8.from_address(address).value ^= 1 << bit

    def close(self) -> None:
        self.released.set()
        self.inner.close()


class _Seen(logging.Handler):
    """Counts the engine's own words for a caught fault: a re-read that healed it, a record that failed twice."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reread = self.corrupt = 0

    def emit(self, record):
        text = record.getMessage()
        self.reread += "then read back intact" in text
        self.corrupt += "failed its checksum twice" in text


def run_campaign(trials: int, model: str = "fixture", seed: int = 0, faults=FAULTS, prompt_tokens: int = 200,
                 new_tokens: int = 6, progress: bool = True) -> dict:
    """``trials`` generations, each with one fault at a random read, against one clean run; per fault the count
    of trials, detections and wrong tokens, and what the user saw."""
    import torch
    from tqdm import tqdm

    from edgekv.runtime import Engine

    torch.set_num_threads(1)  # the campaign counts outcomes, it times nothing: one thread does not fight the others
    from edgekv.runtime.reader import open_reader

    config = {"G": 4, "M": 8, "C": 16, "max_context": prompt_tokens + new_tokens + 8, "max_batch": 2,
              "read_deadline_s": 5.0, "reader_backend": "pthread"}  # a damage fault's own rewrite + fsync stays well inside
    rng = np.random.default_rng(seed)
    root = Path(tempfile.mkdtemp(prefix="edgekv-faults-"))
    seen = _Seen()
    logger = logging.getLogger("edgekv")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(seen)
    rows = {f: {"trials": 0, "detected": 0, "wrong_tokens": 0, "errors": {}, "files_left": 0, "next_request_checked": 0,
                "next_request_ok": 0} for f in faults}
    try:
        engine = Engine.from_pretrained(model, kv_offload_path=root, config=config, policy="kvswap")
        vocab = engine.model.dims.vocab
        prompts = [rng.integers(1, vocab, prompt_tokens).tolist() for _ in range(2)]
        clean = [r.token_ids for r in engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])]
        reads_per_run = engine.model.dims.n_layers * (new_tokens - 1)  # one batch per layer and step
        inner = engine.reader
        bar = tqdm(range(trials), desc="faults", unit="trial", disable=not progress)
        for trial in bar:
            fault = faults[trial % len(faults)]
            reader = FaultyReader(inner, _record_bytes(engine), fault, int(rng.integers(reads_per_run)), seed + trial,
                                  hang_s=2 * config["read_deadline_s"])
            engine.reader = reader
            before = (seen.reread, seen.corrupt)
            row = rows[fault]
            try:
                got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])]
                wrong = sum(a != b for a, b in zip(got, clean))
                outcome = "same tokens"
            except OSError as exc:
                wrong, outcome = 0, f"{type(exc).__name__} ({errno.errorcode.get(exc.errno, exc.errno)})"
            reader.released.set()
            if reader.injected is None:  # every read of the run was a reuse hit after ``at``: nothing was done
                engine.reader = inner
                continue
            row["trials"] += 1
            row["wrong_tokens"] += wrong
            healed = (seen.reread, seen.corrupt) != before
            row["detected"] += bool(healed) if fault in DAMAGE else outcome != "same tokens"
            row["errors"][outcome] = row["errors"].get(outcome, 0) + 1
            row["files_left"] += sum(1 for _ in root.glob("edgekv-*/*"))
            engine.reader = inner
            if fault in FAILURES or row["trials"] % 10 == 1:  # a damaged run already served itself once more
                after = [r.token_ids for r in engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])]
                row["next_request_checked"] += 1
                row["next_request_ok"] += after == clean
        engine.close()
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
        time.sleep(0.1)
        shutil.rmtree(root, ignore_errors=True)
    damage = [rows[f] for f in faults if f in DAMAGE]
    return {"model": model, "trials": trials, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "damage_injected": sum(r["trials"] for r in damage), "damage_detected": sum(r["detected"] for r in damage),
            "wrong_tokens": sum(r["wrong_tokens"] for r in rows.values()), "by_fault": rows}


def _record_bytes(engine) -> int:
    from edgekv.runtime.engine import _record_layout

    return _record_layout(engine.config, engine.model.dims, engine.model.dtype).record_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1200)
    parser.add_argument("--model", default="fixture")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of " + ",".join(FAULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the totals here")
    args = parser.parse_args(argv)
    faults = tuple(args.faults.split(","))
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; choose from {FAULTS}")
    logging.getLogger().addHandler(logging.NullHandler())  # the campaign's warnings are counted, not printed
    result = run_campaign(args.trials, args.model, args.seed, faults)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
