"""Crash trials: SIGKILL a process at random points of prefill and save, then check what the next one reads.

    .venv/bin/python -m tests.harness.crash_trials --trials 60 --json docs/results/faults/crash-trials.json

Each trial starts a fresh child process (``subprocess``, so a new interpreter: nothing is forked after torch
is loaded).  The child loads the model, says ``loaded`` on a status pipe and waits for ``go``; it then opens
the shared context store (``<kv>/contexts``, as the CLI does), says ``ready`` and works until it is killed:
it saves contexts of random lengths under a small pool of names (a name saved again is overwritten, or
removed first), re-saves an identical context now and then (the dedup path), removes contexts, and runs
kvswap generations (with and without a stored context) so live KV files exist under ``<kv>/edgekv-<pid>-*``.
Before each phase it writes a label to the pipe (``save.blob``, ``save.index``, ``gen.decode``, ...: see
``PHASES``); the last label the parent received is the trial's kill phase.

The parent kills the child with SIGKILL, either at a uniformly random time in its working window
(``uniform``) or a random 0-2 ms after the child enters a phase picked in turn (``targeted``: the short
windows, such as an index write, that a uniform time rarely hits).  The next child is started (and loads
its model) while the parent checks the state the killed one left, as the next process would see it:

a. the store is opened (``Engine.open_context_store``), which is where crash debris is cleaned;
b. every context ``contexts()`` lists: its ids (``context_ids``), then every chunk ``match`` returns for them
   is read back layer by layer (``ContextStore.read``) and compared bit for bit with the KV the same model
   computes from those ids in this process, the independent truth (not the store's own checksums).  A read
   that returns different bits is a *corrupt context read as valid*; a read the store refuses (an error) is
   *detected*; a listing whose ids, token count or matched prefix disagree is *inconsistent*;
c. no temp file of a dead process is left in the store after the open, and no ``edgekv-<dead pid>`` KV
   folder is left once a disk policy has opened its KV store;
d. a kvswap generation with one listed context (its prefix loaded from the store, ``load_only``) gives the
   tokens of the same prompt without the store.

``checker_self_test`` shows the checker can fail: a half-written blob renamed into place (same size, zero
tail; and truncated) must be caught, by the store or by the comparison, and a read whose bits are flipped
after the store returned them must be counted as corrupt read as valid.  tests/test_crash.py runs a few
trials and the self-test through the functions here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from edgekv.runtime.devices import intra_op_threads
from edgekv.runtime.store.files import pid_alive

REPO = Path(__file__).resolve().parents[2]
TMP_PREFIX = ".tmp-"  # the store's temp names: .tmp-<pid>-<rand>
# the labels a child writes before each phase ("<op>.<step>"); targeted trials aim at these in turn
PHASES = ("open", "ready", "idle", "save.prefill", "save.put", "save.blob", "save.publish", "save.rename",
          "save.dirsync", "save.ctxfile", "save.ctxfile.done", "save.index", "save.index.done", "save.done", "rm",
          "rm.index", "rm.index.done", "gen.prefill", "gen.index", "gen.load", "gen.decode", "gen.done")
TARGETS = ("save.blob", "save.index", "save.ctxfile", "save.ctxfile.done", "save.dirsync", "gen.prefill",
           "gen.decode", "rm.index", "save.prefill", "gen.index", "save.rename")


@dataclass
class Setup:
    """Where the trials run and what the children do; the same for every trial of a campaign."""

    workdir: Path
    model: str = "fixture"
    chunk_tokens: int = 128
    max_tokens: int = 640  # a saved context has 8..max_tokens tokens
    cap_mib: float = 16.0  # the store's cap (evictions happen too)
    names: int = 8  # contexts are saved under ctx-0..ctx-<names-1>
    max_context: int = 2048
    threads: int = 1  # torch threads in the child and for the truth
    window_s: float = 1.5  # uniform kills land in [0, window_s] after "go"

    @property
    def kv_path(self) -> Path:
        return self.workdir / "kv"

    @property
    def store_dir(self) -> Path:
        return self.kv_path / "contexts"  # the CLI's place: KV_PATH/contexts

    @property
    def max_bytes(self) -> int:
        return int(self.cap_mib * 2**20)

    def child_args(self, seed: int) -> dict:
        return {"model": self.model, "kv_path": str(self.kv_path), "store": str(self.store_dir),
                "chunk_tokens": self.chunk_tokens, "max_tokens": self.max_tokens, "max_bytes": self.max_bytes,
                "names": self.names, "max_context": self.max_context, "threads": self.threads, "seed": seed}


# ---- the child --------------------------------------------------------------------------------------------

def child_main(args: dict, status_fd: int) -> None:
    """Load, wait for "go", then save / remove / generate until killed, labelling each phase on ``status_fd``."""
    state = {"op": "open"}

    def say(label: str) -> None:
        os.write(status_fd, (label + "\n").encode())

    torch.set_num_threads(args["threads"])
    from edgekv.runtime import Engine

    engine = Engine.from_pretrained(args["model"], policy="kvswap", kv_path=args["kv_path"],
                                    config={"max_context": args["max_context"]})
    say("loaded")
    if sys.stdin.readline().strip() != "go":
        return
    say("open")
    store = engine.open_context_store(args["store"], chunk_tokens=args["chunk_tokens"], max_bytes=args["max_bytes"])
    _label_phases(engine, store, say, state)
    say("ready")
    rng = np.random.default_rng(args["seed"])
    vocab = engine.model.dims.vocab
    names = [f"ctx-{i}" for i in range(args["names"])]
    while True:
        listed = [c["name"] for c in store.contexts()]
        r = rng.random()
        if r < 0.55 or not listed:
            name = str(rng.choice(names))
            if listed and rng.random() < 0.2:  # the same ids again (maybe under another name): chunks deduplicated
                ids = store.context_ids(str(rng.choice(listed)))
            else:
                ids = rng.integers(0, vocab, int(rng.integers(8, args["max_tokens"] + 1))).tolist()
            if name in listed and rng.random() < 0.3:  # else overwritten in place
                state["op"] = "rm"
                say("rm")
                store.remove(name)
            state["op"] = "save"
            say("save.prefill")
            engine.save_context(ids, name=name)
        elif r < 0.85:
            state["op"] = "gen"
            say("gen.prefill")
            new = int(rng.integers(2, 7))
            if rng.random() < 0.6:
                question = rng.integers(0, vocab, int(rng.integers(4, 25))).tolist()
                engine.generate([question], max_new_tokens=new, context=str(rng.choice(listed)))
            else:
                engine.generate([rng.integers(0, vocab, int(rng.integers(16, 385))).tolist()], max_new_tokens=new)
            say("gen.done")
        else:
            state["op"] = "rm"
            say("rm")
            store.remove(str(rng.choice(listed)))
        state["op"] = "idle"
        say("idle")


def _label_phases(engine, store, say, state: dict) -> None:
    """Wrap the store's steps so each says its phase first.  Labels only: where an internal name has moved,
    its phase is merged into the one before, and nothing the store does changes."""
    from edgekv.runtime.store import context_store as cs

    put = store.put

    def put_(*a, **k):
        say("save.put")
        out = put(*a, **k)
        say("save.done")
        return out

    store.put = put_
    if callable(getattr(store, "_write_blob", None)):
        write_blob = store._write_blob

        def write_blob_(*a, **k):
            say("save.blob")
            out = write_blob(*a, **k)
            say("save.publish")  # the blobs are written; next: the lock, the renames, the index
            return out

        store._write_blob = write_blob_
    if callable(getattr(cs, "write_atomic", None)):
        write_atomic = cs.write_atomic

        def write_atomic_(path, *a, **k):
            p = Path(path)
            step = "index" if p.name == "index.json" else "ctxfile" if p.parent.name == "contexts" else "json"
            say(f"{state['op']}.{step}")
            out = write_atomic(path, *a, **k)
            if step == "index":  # a generation's match touched the LRU ticks: back to its prefill
                say("gen.prefill" if state["op"] == "gen" else f"{state['op']}.index.done")
            elif step == "ctxfile":  # the context's ids are replaced; index.json is not yet
                say(f"{state['op']}.ctxfile.done")
            return out

        cs.write_atomic = write_atomic_
    if callable(getattr(cs, "fsync_dir", None)):
        fsync_dir = cs.fsync_dir

        def fsync_dir_(*a, **k):
            say(f"{state['op']}.dirsync")
            return fsync_dir(*a, **k)

        cs.fsync_dir = fsync_dir_
    if getattr(cs, "os", None) is os:
        class _Os:  # the module's os, with replace labelled (the blob renames)
            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def replace(*a, **k):
                say(f"{state['op']}.rename")
                return os.replace(*a, **k)

        cs.os = _Os()
    last = {"label": None}

    def on_event(event):
        label = {"prefill_start": "gen.prefill", "prefill_from_store": "gen.load",
                 "decode_step_start": "gen.decode"}.get(event.kind)
        if label and label != last["label"] or event.kind == "prefill_start":
            last["label"] = label
            say(label)

    engine.events.subscribe(on_event)


# ---- the parent: one child ----------------------------------------------------------------------------------

class Child:
    """A child process, its status pipe read by a thread, and its kill."""

    def __init__(self, setup: Setup, seed: int, log_path: Path):
        r, w = os.pipe()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": str(setup.threads)}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.crash_trials", "--child", json.dumps(setup.child_args(seed)),
             "--status-fd", str(w)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(w,), cwd=REPO, env=env)
        os.close(w)
        self.events: list[tuple[float, str]] = []
        self.loaded = threading.Event()
        self.killed_at: float | None = None
        self.go_at: float | None = None
        self._trigger: tuple[str, int, float] | None = None
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, args=(r,), daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        seen: dict[str, int] = {}
        buf = b""
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(65536)
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    label = line.decode()
                    self.events.append((time.monotonic(), label))
                    if label == "loaded":
                        self.loaded.set()
                    trigger = self._trigger
                    if trigger is not None and label == trigger[0]:
                        seen[label] = seen.get(label, 0) + 1
                        if seen[label] == trigger[1]:
                            if trigger[2] > 0:
                                time.sleep(trigger[2])
                            self.kill()
        self.loaded.set()  # EOF: died (or was killed) before loading; wait_loaded sees it

    def wait_loaded(self, timeout: float = 300.0) -> float:
        if not self.loaded.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError(f"child {self.proc.pid} did not load (exit {self.proc.poll()}): {self.log_tail()}")
        return self.events[0][0] - self.started

    def go(self, trigger: tuple[str, int, float] | None = None) -> float:
        self._trigger = trigger
        self.go_at = time.monotonic()
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        return self.go_at

    def kill(self) -> None:
        with self._lock:
            if self.killed_at is None and self.proc.poll() is None:
                self.killed_at = time.monotonic()
                os.kill(self.proc.pid, signal.SIGKILL)

    def reap(self) -> int:
        """Wait for the exit (a zombie still counts as alive to the store's pid checks) and the pipe's last lines."""
        code = self.proc.wait()
        self._reader.join(10)
        self.log.close()
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        return code

    def log_tail(self, n: int = 1500) -> str:
        try:
            self.log.flush()
        except ValueError:
            pass
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def labels_after_go(self) -> list[str]:
        return [label for t, label in self.events if t >= self.go_at]


# ---- the checks ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def recompute_kv(model, ids: list[int]) -> torch.Tensor:
    """The truth: [layers, 2, H_kv, len(ids), d] computed from the ids by the model in this process."""
    from edgekv.runtime.forward import prefill
    from edgekv.runtime.ttft.compute import PrefixKV

    kv = PrefixKV(model, len(ids))
    prefill(model, ids, kv.put_prompt)
    return kv.kv


def read_chunk_layer(store, ref, layer: int) -> torch.Tensor:
    """One (chunk, layer) through the store's public read: records as [n_groups, 2, H_kv, G, d]."""
    from edgekv.runtime.disk_store import aligned_zeros

    lay = store.layout
    buf = aligned_zeros((ref.n_tokens // lay.group_tokens, lay.stride_bytes), lay.align_bytes)
    store.read(ref, layer, buf)
    return lay.typed(buf).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@dataclass
class StoreCheck:
    contexts_checked: int = 0
    chunks_checked: int = 0  # chunks read back, every layer of each
    tokens_checked: int = 0
    corrupt_read_as_valid: int = 0  # chunks whose bits differ from the truth, read without an error
    detected: int = 0  # chunk reads the store refused (an error instead of bytes)
    inconsistent: int = 0  # contexts whose listing, ids and matched prefix disagree
    incomplete: int = 0  # listed as not complete (an evicted chunk)
    problems: list = field(default_factory=list)
    inconsistencies: list = field(default_factory=list)  # the inconsistent listings' problems alone

    def inconsist(self, name: str, what: str) -> None:
        if not any(p.startswith(f"{name}: ") for p in self.inconsistencies):
            self.inconsistent += 1
        self.problems.append(f"{name}: {what}")
        self.inconsistencies.append(f"{name}: {what}")


def check_store(store, model, threads: int = 1, read=None) -> StoreCheck:
    """(b): every listed context's matched chunks read back and compared bit for bit with recomputed KV.

    ``read`` replaces ``read_chunk_layer`` (the self-test's way to hand the checker wrong bits)."""
    read = read or read_chunk_layer
    out = StoreCheck()
    lay = store.layout
    G = lay.group_tokens
    for entry in store.contexts():
        name = entry["name"]
        out.contexts_checked += 1
        if not entry.get("complete", True):
            out.incomplete += 1
        try:
            ids = store.context_ids(name)
        except Exception as exc:  # a listed context without its ids
            out.inconsist(name, f"listed but context_ids failed: {type(exc).__name__}: {exc}")
            continue
        stored = len(ids) // G * G
        if entry.get("tokens") != len(ids):
            out.inconsist(name, f"listed with {entry.get('tokens')} tokens, context_ids gives {len(ids)}")
        prefix = store.match(list(ids) + [0])  # + one token: the match may cover every stored token
        got = prefix.n_tokens if prefix else 0
        if entry.get("complete", True) and got < min(entry.get("usable_tokens", 0), stored):
            out.inconsist(name, f"listed complete with {entry.get('usable_tokens')} usable tokens, "
                                f"match finds {got} of its {len(ids)} ids")
        if prefix is None:
            continue
        with intra_op_threads(threads):
            truth = recompute_kv(model, list(ids))
        pos = 0
        for ref in prefix.chunks:
            if ref.start != pos:
                out.inconsist(name, f"matched chunk at {ref.start}, expected {pos}")
                break
            pos += ref.n_tokens
            out.chunks_checked += 1
            out.tokens_checked += ref.n_tokens
            n = ref.n_tokens // G
            bad = None
            for layer in range(truth.shape[0]):
                try:
                    rec = read(store, ref, layer)
                except Exception as exc:
                    out.detected += 1
                    out.problems.append(f"{name}: chunk {ref.hash[:12]} [{ref.start}, {ref.start + ref.n_tokens}) "
                                        f"layer {layer}: read refused: {type(exc).__name__}: {exc}")
                    bad = "detected"
                    break
                want = truth[layer, :, :, ref.start:ref.start + ref.n_tokens].reshape(
                    2, lay.n_kv_heads, n, G, lay.head_dim).permute(2, 0, 1, 3, 4)
                if not same_bits(rec, want):
                    bad = layer
                    break
            if bad is not None and bad != "detected":
                out.corrupt_read_as_valid += 1
                out.problems.append(f"{name}: chunk {ref.hash[:12]} [{ref.start}, {ref.start + ref.n_tokens}) "
                                    f"layer {bad}: read back without an error but differs from the recomputed KV")
    return out


def tmp_debris(root: Path, dead_only: bool = True) -> list[str]:
    """The store's temp files (``.tmp-<pid>-*``), those of processes that no longer run by default."""
    found = []
    if not root.exists():
        return found
    for path in root.rglob(f"{TMP_PREFIX}*"):
        pid = path.name[len(TMP_PREFIX):].split("-", 1)[0]
        if not dead_only or not pid.isdigit() or not pid_alive(int(pid)):
            found.append(str(path.relative_to(root)))
    return sorted(found)


def dead_kv_folders(kv_path: Path) -> list[str]:
    """``edgekv-<pid>-<id>`` KV folders of processes that no longer run."""
    out = []
    for entry in kv_path.glob("edgekv-*-*"):
        pid = entry.name.split("-")[1]
        if entry.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            out.append(entry.name)
    return sorted(out)


def generation_check(base, setup: Setup, name: str, rng: random.Random) -> dict:
    """(d): kvswap with the stored context (its prefix loaded from the store) vs the same prompt without the store,
    each in a fresh engine on the loaded model (an engine keeps the adapter its first batch fits)."""
    from edgekv.runtime import Engine
    from edgekv.runtime.ttft.prefill import TTFTOptions

    question = [rng.randrange(base.model.dims.vocab) for _ in range(rng.randint(4, 16))]
    new = 4
    with Engine(base.model, base.config, "kvswap", setup.kv_path, base.tokenizer) as engine:
        engine.open_context_store(setup.store_dir, chunk_tokens=setup.chunk_tokens, max_bytes=setup.max_bytes)
        ids = engine.context_ids(name)
        engine.ttft = TTFTOptions("load_only")
        with_store = engine.generate([question], max_new_tokens=new, context=name)[0].token_ids
        stored = engine.prefill_stats[0]["stored_tokens"] if engine.prefill_stats else 0
    with Engine(base.model, base.config, "kvswap", setup.kv_path, base.tokenizer) as plain:
        without = plain.generate([list(ids) + question], max_new_tokens=new)[0].token_ids
    return {"context": name, "stored_tokens": int(stored), "tokens_with_store": with_store,
            "tokens_without_store": without, "equal": with_store == without}


def check_after_crash(base, setup: Setup, rng: random.Random, gen_checks: int = 1) -> dict:
    """(a)-(d) on the folder a killed child left, as the next process would open it."""
    from edgekv.runtime import Engine

    res = {"tmp_before_open": tmp_debris(setup.store_dir), "dead_kv_before": dead_kv_folders(setup.kv_path),
           "errors": []}
    engine = Engine(base.model, base.config, "kvswap", setup.kv_path, base.tokenizer)
    try:
        store = engine.open_context_store(setup.store_dir, chunk_tokens=setup.chunk_tokens, max_bytes=setup.max_bytes)
        res["tmp_after_open"] = tmp_debris(setup.store_dir)
        check = check_store(store, base.model, setup.threads)
        res.update({k: v for k, v in asdict(check).items()})
        listed = [c for c in store.contexts() if c["usable_tokens"] > 0]
        res["generation"] = []
        for c in rng.sample(listed, min(gen_checks, len(listed))):
            res["generation"].append(generation_check(base, setup, c["name"], rng))
        if not res["generation"]:  # nothing stored yet: a disk-policy run opens the KV store all the same
            with Engine(base.model, base.config, "kvswap", setup.kv_path, base.tokenizer) as plain:
                plain.generate([[1, 2, 3, 4, 5]], max_new_tokens=1)
    except Exception as exc:
        res["errors"].append(f"check: {type(exc).__name__}: {exc}")
    finally:
        engine.close()
    res.setdefault("tmp_after_open", tmp_debris(setup.store_dir))
    res["dead_kv_after"] = dead_kv_folders(setup.kv_path)
    res["generation_mismatch"] = sum(not g["equal"] for g in res.get("generation", []))
    return res


# ---- the campaign -------------------------------------------------------------------------------------------

def load_base(setup: Setup):
    from edgekv.runtime import Engine

    setup.kv_path.mkdir(parents=True, exist_ok=True)
    return Engine.from_pretrained(setup.model, policy="kvswap", kv_path=setup.kv_path,
                                  config={"max_context": setup.max_context})


def _plan(trial: int, rng: random.Random, setup: Setup, targeted_every: int, targets=TARGETS) -> dict:
    if targeted_every and trial % targeted_every == targeted_every - 1:
        k = trial // targeted_every
        return {"mode": "targeted", "target": targets[k % len(targets)], "occurrence": rng.randint(1, 3),
                "delay_s": rng.uniform(0, 0.002)}
    return {"mode": "uniform", "kill_after_s": rng.uniform(0, setup.window_s)}


def run_trial_kill(child: Child, plan: dict, setup: Setup) -> None:
    if plan["mode"] == "uniform":
        child.go()
        time.sleep(plan["kill_after_s"])
    else:
        child.go((plan["target"], plan["occurrence"], plan["delay_s"]))
        deadline = time.monotonic() + setup.window_s + 3.0  # a target not reached by then: killed anyway
        while child.killed_at is None and child.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    child.kill()


def run_campaign(setup: Setup, trials: int, seed: int = 0, targeted_every: int = 2, gen_checks: int = 1,
                 progress: bool = True, base=None, targets=TARGETS) -> dict:
    """``trials`` kill-and-check trials over one store folder; returns {"trials": [...], "totals": {...}}.

    Every ``targeted_every``-th trial is killed just after the child enters the next phase of ``targets``."""
    rng = random.Random(seed)
    setup.workdir.mkdir(parents=True, exist_ok=True)
    base = base or load_base(setup)
    setup.kv_path.mkdir(parents=True, exist_ok=True)
    logs = setup.workdir / "logs"
    logs.mkdir(exist_ok=True)
    results = []
    phase_s: dict[str, list[float]] = {}  # label -> seconds until the next label, over every trial
    started = time.monotonic()
    bar = _progress(trials, progress)
    nxt = Child(setup, rng.randrange(2**31), logs / "child-0.log")
    try:
        for trial in range(trials):
            child, nxt = nxt, None
            t0 = time.monotonic()
            plan = _plan(trial, rng, setup, targeted_every, targets)
            row = {"trial": trial, **plan, "pid": child.proc.pid, "errors": []}
            try:
                row["child_load_s"] = round(child.wait_loaded(), 3)
            except RuntimeError as exc:
                row["errors"].append(str(exc))
            if not row["errors"]:
                run_trial_kill(child, plan, setup)
            else:
                child.kill()
            code = child.reap()
            labels = child.labels_after_go() if child.go_at is not None else []
            _phase_times(child, phase_s)
            row.update({
                "exit": code,
                "killed_by_sigkill": code == -signal.SIGKILL and child.killed_at is not None,
                "killed_after_go_s": round(child.killed_at - child.go_at, 4) if child.killed_at and child.go_at else None,
                "phase": labels[-1] if labels else "loading",
                "ops_done": labels.count("idle"),
                "last_phases": labels[-6:],
            })
            if code != -signal.SIGKILL:
                row["errors"].append(f"child exited {code} on its own: {child.log_tail()}")
            if trial + 1 < trials:  # the next child loads while this trial is checked
                nxt = Child(setup, rng.randrange(2**31), logs / f"child-{trial + 1}.log")
            c0 = time.monotonic()
            checked = check_after_crash(base, setup, rng, gen_checks)
            row["errors"] += checked.pop("errors")
            row.update(checked)
            before = set(results[-1].get("inconsistencies", [])) if results else set()
            arisen = set(row.get("inconsistencies", [])) - before  # with this kill (a torn listing lasts)
            row["inconsistent_new"] = len({p.split(": ", 1)[0] for p in arisen})
            row["debris_left"] = len(row["tmp_after_open"]) + len(row["dead_kv_after"])
            row["check_s"] = round(time.monotonic() - c0, 3)
            row["trial_s"] = round(time.monotonic() - t0, 3)
            results.append(row)
            totals = summarize(results, time.monotonic() - started)
            if bar is not None:
                bar.set_postfix(phase=row["phase"], corrupt=totals["corrupt_read_as_valid"],
                                debris=totals["debris_left"], errors=totals["errors"], refresh=False)
                bar.update(1)
    finally:
        if nxt is not None:
            nxt.kill()
            nxt.reap()
        if bar is not None:
            bar.close()
    phases = {label: {"n": len(v), "median_ms": round(1e3 * float(np.median(v)), 3),
                      "share_of_time": round(float(np.sum(v)) / max(1e-9, sum(map(sum, phase_s.values()))), 4)}
              for label, v in sorted(phase_s.items())}
    return {"trials": results, "totals": summarize(results, time.monotonic() - started), "phase_durations": phases}


def _phase_times(child: Child, out: dict) -> None:
    """How long each phase lasted (label to next label) in a child's working window: where a uniform kill lands."""
    events = [(t, label) for t, label in child.events if child.go_at is not None and t >= child.go_at]
    for (t0, label), (t1, _) in zip(events, events[1:]):
        out.setdefault(label, []).append(t1 - t0)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="crash trials", unit="trial", file=sys.stderr)


def summarize(rows: list[dict], wall_s: float) -> dict:
    by_phase: dict[str, int] = {}
    for r in rows:
        by_phase[r["phase"]] = by_phase.get(r["phase"], 0) + 1
    gen = [g for r in rows for g in r.get("generation", [])]
    return {
        "trials": len(rows),
        "killed_by_sigkill": sum(r["killed_by_sigkill"] for r in rows),
        "uniform": sum(r["mode"] == "uniform" for r in rows),
        "targeted": sum(r["mode"] == "targeted" for r in rows),
        "kill_phases": dict(sorted(by_phase.items())),
        "contexts_checked": sum(r.get("contexts_checked", 0) for r in rows),
        "chunks_checked": sum(r.get("chunks_checked", 0) for r in rows),
        "tokens_checked": sum(r.get("tokens_checked", 0) for r in rows),
        "corrupt_read_as_valid": sum(r.get("corrupt_read_as_valid", 0) for r in rows),
        "detected_by_store": sum(r.get("detected", 0) for r in rows),
        "inconsistent_listings": sum(r.get("inconsistent", 0) for r in rows),  # per trial it lasts
        "inconsistent_listings_new": sum(r.get("inconsistent_new", 0) for r in rows),  # per kill that made one
        "inconsistent_new_after": sorted({r["phase"] for r in rows if r.get("inconsistent_new")}),
        "incomplete_listings": sum(r.get("incomplete", 0) for r in rows),
        "tmp_files_left_by_kills": sum(len(r.get("tmp_before_open", [])) for r in rows),
        "dead_kv_folders_left_by_kills": sum(len(r.get("dead_kv_before", [])) for r in rows),
        "debris_left": sum(r.get("debris_left", 0) for r in rows),
        "generations_checked": len(gen),
        "generation_mismatch": sum(not g["equal"] for g in gen),
        "generations_from_store": sum(g["stored_tokens"] > 0 for g in gen),
        "errors": sum(len(r["errors"]) for r in rows),
        "ops_done": sum(r.get("ops_done", 0) for r in rows),
        "wall_s": round(wall_s, 1),
        "s_per_trial": round(wall_s / len(rows), 2) if rows else None,
        "child_load_s_mean": round(float(np.mean([r["child_load_s"] for r in rows if "child_load_s" in r] or [0])), 2),
        "check_s_mean": round(float(np.mean([r["check_s"] for r in rows] or [0])), 2),
    }


# ---- the checker's self-test --------------------------------------------------------------------------------

def checker_self_test(workdir: Path, base=None, model: str = "fixture", threads: int = 1) -> dict:
    """The checker must fail where it should.

    - ``clean``: a store nothing touched passes (3 chunks, nothing flagged);
    - ``zero_tail``, ``truncated``: a half-written blob renamed into place (same size with a zero tail; cut
      short) is never served as valid: the store refuses it, drops it, or the comparison flags it;
    - ``zero_tail_read``, ``flipped_bit``: the same damage handed to the comparison after the store's own read
      (a store without checksums), must be counted as corrupt read as valid: the comparison alone catches it.
    """
    workdir = Path(workdir)
    setup = Setup(workdir=workdir, model=model, threads=threads)
    base = base or load_base(setup)
    out = {}
    ids = torch.randint(0, base.model.dims.vocab, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    victim = setup.chunk_tokens  # the middle chunk of 3 (128 + 128 + 44 tokens)

    def fresh(tag: str):
        root = workdir / f"selftest-{tag}"
        shutil.rmtree(root, ignore_errors=True)
        store = base.open_context_store(root, chunk_tokens=setup.chunk_tokens)
        saved = base.save_context(ids, name="victim")
        return root, store, saved

    def reopen(root):
        return base.open_context_store(root, chunk_tokens=setup.chunk_tokens)

    def damaging(how):
        def read(store, ref, layer):
            rec = read_chunk_layer(store, ref, layer)
            if ref.start == victim:
                flat = rec.view(torch.uint8).view(-1)
                if how == "flip" and layer == 1:
                    flat[12345 % flat.numel()] ^= 1
                elif how == "zero_tail" and layer >= store.n_layers // 2:  # the second half of a layer-major blob
                    flat.zero_()
            return rec
        return read

    try:
        _, store, _ = fresh("clean")
        out["clean"] = asdict(check_store(store, base.model, threads))
        for tag, truncate in (("zero_tail", False), ("truncated", True)):
            root, store, saved = fresh(tag)
            _half_written(store.backend.blob_path(saved.chunks[1].hash), truncate)
            out[tag] = asdict(check_store(reopen(root), base.model, threads))
        for tag, how in (("zero_tail_read", "zero_tail"), ("flipped_bit", "flip")):
            _, store, _ = fresh(tag)
            out[tag] = asdict(check_store(store, base.model, threads, read=damaging(how)))
    finally:
        base.context_store = None
        for path in workdir.glob("selftest-*"):
            shutil.rmtree(path, ignore_errors=True)
    served_as_valid = lambda r: r["chunks_checked"] == 3 and r["detected"] + r["corrupt_read_as_valid"] == 0  # noqa: E731
    out["ok"] = (out["clean"]["chunks_checked"] == 3 and not out["clean"]["problems"]
                 and not served_as_valid(out["zero_tail"]) and not served_as_valid(out["truncated"])
                 and out["zero_tail_read"]["corrupt_read_as_valid"] == 1
                 and out["flipped_bit"]["corrupt_read_as_valid"] == 1)
    return out


def _half_written(blob: Path, truncate: bool) -> None:
    """Put a half-written copy of ``blob`` in its place the way a writer that skipped fsync-before-rename would:
    written to a temp name, renamed over it, only the first half of the bytes there (the rest zeros, or cut)."""
    data = blob.read_bytes()
    half = data[: len(data) // 2]
    tmp = blob.with_name(blob.name + ".half")
    tmp.write_bytes(half if truncate else half + bytes(len(data) - len(half)))
    os.replace(tmp, blob)


# ---- the command --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.harness.crash_trials", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--json", help="write the per-trial rows and totals here")
    ap.add_argument("--model", default="fixture")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--window", type=float, default=1.5, help="uniform kills land in [0, WINDOW] s after go")
    ap.add_argument("--targeted-every", type=int, default=2, help="every Nth trial kills at a targeted phase (0: none)")
    ap.add_argument("--gen-checks", type=int, default=1, help="generations checked against a run without the store, per trial")
    ap.add_argument("--cap-mib", type=float, default=16.0)
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=640)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", help="where the store and KV folders live (default: a temp folder, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--no-self-test", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--status-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child), args.status_fd)
        return 0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="edgekv-crash-"))
    setup = Setup(workdir=workdir, model=args.model, chunk_tokens=args.chunk_tokens, max_tokens=args.max_tokens,
                  cap_mib=args.cap_mib, threads=args.threads, window_s=args.window)
    try:
        base = load_base(setup)
        self_test = None if args.no_self_test else checker_self_test(workdir, base, args.model, args.threads)
        if self_test is not None and not self_test["ok"]:
            print(json.dumps(self_test, indent=1), file=sys.stderr)
            print("the checker's self-test failed: its counts cannot be trusted", file=sys.stderr)
            return 2
        run = run_campaign(setup, args.trials, args.seed, args.targeted_every, args.gen_checks, base=base)
        base.close()
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    meta = {"command": "python -m tests.harness.crash_trials " + " ".join(argv if argv is not None else sys.argv[1:]),
            "setup": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(setup).items() if k != "workdir"},
            "seed": args.seed, "targeted_every": args.targeted_every, "gen_checks": args.gen_checks,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "torch": torch.__version__}}
    result = {"meta": meta, "self_test": self_test, "totals": run["totals"],
              "phase_durations": run["phase_durations"], "trials": run["trials"]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(run["totals"], indent=1))
    t = run["totals"]
    bad = t["corrupt_read_as_valid"] + t["debris_left"] + t["errors"] + t["generation_mismatch"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
