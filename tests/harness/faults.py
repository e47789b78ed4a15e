"""Fault injection at the KV reader: a wrapper around a real reader that damages one read of a run, and a
campaign that counts what the engine did about it.

Faults (one per run, at a random read):
  flip_memory  one bit of a record flipped after it landed in memory (a transient: DRAM, bus, DMA)
  flip_disk    one bit of a record flipped in its file before it is read (a persistent media error)
  torn_disk    the second half of a record overwritten with zeros in its file (a torn or lost write)
  eio          the read fails with EIO
  short        the record's file truncated before it is read (the reader meets its end: a short read)
  hang         the read blocks past the engine's read deadline

    .venv/bin/python -m tests.harness.faults --trials 1200 --json faults.json

The store campaign (``--store-flips N``, ``run_store_flips``) damages a saved context store instead: one byte of
one file (store.json, index.json, the context's file, each chunk blob, in turn) XORed with a random non-zero
value, then the same request as undamaged; it must give the same tokens or an error naming that file.

    .venv/bin/python -m tests.harness.faults --store-flips 700 --json docs/results/faults/faults-store-flips.json
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
from collections import Counter
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
        if getattr(batch, "gap_counts", None) is not None:  # never a record read only to bridge a gap: none uses it
            wanted = np.flatnonzero(batch.seqs >= 0)
            i = int(wanted[i % len(wanted)])
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


def _listen(handler: logging.Handler):
    """The engine's warnings reach ``handler`` (a campaign counts them); returns what undoes it."""
    logger = logging.getLogger("edgekv")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)

    def stop() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return stop


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
                 new_tokens: int = 6, progress: bool = True, device: str | None = None) -> dict:
    """``trials`` generations, each with one fault at a random read, against one clean run; per fault the count
    of trials, detections and wrong tokens, and what the user saw.  ``device``: the engine's (None: its default)."""
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
    stop_listening = _listen(seen)
    rows = {f: {"trials": 0, "detected": 0, "wrong_tokens": 0, "errors": {}, "files_left": 0, "next_request_checked": 0,
                "next_request_ok": 0} for f in faults}
    try:
        engine = Engine.from_pretrained(model, kv_path=root, config=config, policy="kvswap", device=device)
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
        stop_listening()
        time.sleep(0.1)
        shutil.rmtree(root, ignore_errors=True)
    damage = [rows[f] for f in faults if f in DAMAGE]
    return {"model": model, "trials": trials, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "damage_injected": sum(r["trials"] for r in damage), "damage_detected": sum(r["detected"] for r in damage),
            "wrong_tokens": sum(r["wrong_tokens"] for r in rows.values()), "by_fault": rows}


class _Messages(logging.Handler):
    """The engine's warnings of one trial."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


OUTCOMES = ("same", "named_error", "wrong", "opaque")


DETECTIONS = (("trailer", "blob trailer"), ("failed their checksums", "record checksum"), ("not valid JSON", "not JSON"),
              ("checksum does not match", "file checksum"), ("carries no checksum", "file checksum"))


def _detected_by(messages: list[str]) -> str:
    """Which check named the damage first, from the messages that named the file."""
    for text in messages:
        for words, check in DETECTIONS:
            if words in text:
                return check
    return "schema" if messages else "nothing (unread bytes)"


def _store_kind(rel: str) -> str:
    return rel if rel in ("store.json", "index.json") else "context" if rel.startswith("contexts/") else "blob"


def _damaged_copy(pristine: Path, work: Path, rel: str, rng) -> tuple[int, int]:
    """``work`` made a fresh copy of the store ``pristine`` with one byte of its file ``rel`` XORed with a random
    non-zero value; returns (offset, value)."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work)
    data = bytearray((work / rel).read_bytes())
    offset, mask = int(rng.integers(len(data))), int(rng.integers(1, 256))
    data[offset] ^= mask
    (work / rel).write_bytes(bytes(data))
    return offset, mask


def _flip_row(kind: str, size: int) -> dict:
    return {"kind": kind, "bytes": size, "flips": 0, "named": 0, **dict.fromkeys(OUTCOMES, 0), "detected_by": Counter()}


def _by_kind(rows: dict) -> dict:
    kinds = {}
    for row in rows.values():
        total = kinds.setdefault(row["kind"], {**_flip_row(row["kind"], 0), "files": 0})
        total["files"] += 1
        for key in ("bytes", "flips", "named", *OUTCOMES):
            total[key] += row[key]
        total["detected_by"].update(row["detected_by"])
    return kinds


def run_store_flips(trials: int, model: str = "fixture", seed: int = 0, kinds=("store.json", "index.json", "context", "blob"),
                    context_tokens: int = 100, chunk_tokens: int = 32, new_tokens: int = 8, progress: bool = True,
                    device: str | None = None) -> dict:
    """``trials`` requests on a saved context ``doc``, each against a fresh copy of its store with one byte of one
    file flipped (the files of ``kinds`` in turn, a random offset, XOR a random non-zero value).  Outcomes per file:
    ``same`` tokens as undamaged, ``named_error`` (an error whose message names the file), ``wrong`` tokens,
    ``opaque`` (any other error); ``named`` counts the flips a warning or the error named (the file, or a blob's
    hash), ``detected_by`` the check that caught them.  ``device``: the engine's (None: its default)."""
    import torch
    from tqdm import tqdm

    from edgekv.runtime import Engine
    from edgekv.runtime.ttft.prefill import TTFTOptions

    torch.set_num_threads(1)  # outcomes are counted, nothing is timed
    rng = np.random.default_rng(seed)
    root = Path(tempfile.mkdtemp(prefix="edgekv-store-flips-"))
    seen = _Messages()
    stop_listening = _listen(seen)
    config = {"G": 4, "M": 4, "C": 8, "max_context": context_tokens + new_tokens + 16, "max_batch": 1}
    try:
        (root / "kv").mkdir()
        with Engine.from_pretrained(model, kv_path=root / "kv", config=config, policy="kvswap",
                                    device=device) as engine:
            engine.ttft = TTFTOptions("load_only")  # every stored chunk is read at prefill: a damaged one meets a read
            ids, prompt = (rng.integers(3, engine.model.dims.vocab, n).tolist() for n in (context_tokens, 4))
            no_store = engine.generate([ids + prompt], max_new_tokens=new_tokens, stop_token_ids=[])[0].token_ids
            pristine, work = root / "pristine", root / "work"
            engine.open_context_store(pristine, chunk_tokens=chunk_tokens)
            engine.save_context(ids, name="doc")

            def answer() -> list[int]:
                return engine.generate([prompt], context="doc", max_new_tokens=new_tokens, stop_token_ids=[])[0].token_ids

            want = answer()
            found = sorted((str(p.relative_to(pristine)), p.stat().st_size) for p in pristine.rglob("*") if p.is_file())
            rows = {rel: _flip_row(_store_kind(rel), size) for rel, size in found if size and _store_kind(rel) in kinds}
            files, examples, unnamed = list(rows), {}, []
            for trial in tqdm(range(trials), desc="store flips", unit="flip", disable=not progress):
                rel = files[trial % len(files)]
                offset, mask = _damaged_copy(pristine, work, rel, rng)
                seen.messages.clear()
                name, message = Path(rel).name, ""
                try:
                    engine.open_context_store(work, chunk_tokens=chunk_tokens)
                    outcome = "same" if answer() == want else "wrong"
                except Exception as exc:  # every error is classified, none is let through
                    message = f"{type(exc).__name__}: {exc}"
                    outcome = "named_error" if name in str(exc) else "opaque"
                named = [m for m in seen.messages + [message] if name in m or Path(rel).stem[:16] in m]
                row = rows[rel]
                row["flips"] += 1
                row[outcome] += 1
                row["named"] += bool(named)
                row["detected_by"][_detected_by(named)] += 1
                examples.setdefault(f"{row['kind']} {outcome}", named[0] if named else message)
                if outcome != "same" and outcome != "named_error" or not named:
                    unnamed.append({"file": rel, "offset": offset, "xor": mask, "outcome": outcome, "error": message})
            engine.context_store = None
    finally:
        stop_listening()
        shutil.rmtree(root, ignore_errors=True)
    by_kind = _by_kind(rows)
    return {"model": model, "trials": trials, "seed": seed, "context_tokens": context_tokens, "chunk_tokens": chunk_tokens,
            "new_tokens": new_tokens, "undamaged_equals_no_store": want == no_store,
            "skipped": [f"{rel} (empty)" for rel, size in found if not size],
            "totals": {key: sum(k[key] for k in by_kind.values()) for key in ("flips", "named", *OUTCOMES)},
            "by_kind": by_kind, "by_file": rows, "examples": examples,
            "failures": [u for u in unnamed if u["outcome"] in ("wrong", "opaque")],
            "same_unnamed": [u for u in unnamed if u["outcome"] == "same"][:100]}


def _record_bytes(engine) -> int:
    from edgekv.runtime.engine import _record_layout

    return _record_layout(engine.config, engine.model.dims, engine.model.dtype).record_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1200)
    parser.add_argument("--model", default="fixture")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of " + ",".join(FAULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store-flips", type=int, metavar="N",
                        help="run the context-store campaign instead: N single-byte flips over every file of a store")
    parser.add_argument("--json", help="write the totals here")
    args = parser.parse_args(argv)
    faults = tuple(args.faults.split(","))
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; choose from {FAULTS}")
    logging.getLogger().addHandler(logging.NullHandler())  # the campaign's warnings are counted, not printed
    if args.store_flips is not None:
        result = run_store_flips(args.store_flips, args.model, args.seed)
    else:
        result = run_campaign(args.trials, args.model, args.seed, faults)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
