"""The crash target at CI size: processes SIGKILLed mid-prefill and mid-save leave no corrupt context that
reads back as valid, no debris, and a store that still generates the tokens a run without it does.

The trials and the checks are tests/harness/crash_trials.py's (``python -m tests.harness.crash_trials --trials 60``
is the full campaign); the checker is first shown to catch a half-written blob renamed into place and flipped bits.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.crash_trials import Setup, checker_self_test, load_base, run_campaign

REPO = Path(__file__).resolve().parents[1]
PREFILL_PHASES = {"save.prefill", "gen.prefill", "gen.load"}
SAVE_WRITE_PHASES = {"save.put", "save.blob", "save.publish", "save.rename", "save.dirsync", "save.ctxfile",
                     "save.ctxfile.done", "save.index"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    engine = load_base(Setup(workdir=tmp_path_factory.mktemp("crash-base")))
    yield engine
    engine.close()


def test_the_checker_catches_a_half_written_blob_and_flipped_bits(tmp_path, base):
    out = checker_self_test(tmp_path, base)
    assert out["clean"]["chunks_checked"] == 3 and out["clean"]["problems"] == []
    for case in ("zero_tail", "truncated"):  # never served as valid: refused or dropped by the store, or flagged
        r = out[case]
        assert r["detected"] + r["corrupt_read_as_valid"] >= 1 or r["chunks_checked"] < 3, (case, r)
    # without the store's checksums in the way, the comparison alone flags the damage
    assert out["zero_tail_read"]["corrupt_read_as_valid"] == 1 and "layer 2" in out["zero_tail_read"]["problems"][0]
    assert out["flipped_bit"]["corrupt_read_as_valid"] == 1 and "layer 1" in out["flipped_bit"]["problems"][0]
    assert out["ok"]


def test_sigkill_mid_prefill_and_mid_save_leaves_nothing_corrupt(tmp_path, base):
    setup = Setup(workdir=tmp_path, window_s=0.6)
    run = run_campaign(setup, trials=6, seed=1717, targeted_every=2, progress=False, base=base,
                       targets=("save.blob", "save.prefill", "save.index"))
    rows, t = run["trials"], run["totals"]
    assert t["errors"] == 0, [r["errors"] for r in rows if r["errors"]]
    assert t["killed_by_sigkill"] == 6 and all(r["exit"] == -signal.SIGKILL for r in rows)
    assert {r["phase"] for r in rows} & SAVE_WRITE_PHASES, [r["phase"] for r in rows]
    assert {r["phase"] for r in rows} & PREFILL_PHASES, [r["phase"] for r in rows]
    assert t["contexts_checked"] > 0 and t["chunks_checked"] > 0
    assert t["corrupt_read_as_valid"] == 0, [r["problems"] for r in rows if r["corrupt_read_as_valid"]]
    assert t["detected_by_store"] == 0, [r["problems"] for r in rows if r["detected"]]
    assert t["debris_left"] == 0, [(r["tmp_after_open"], r["dead_kv_after"]) for r in rows if r["debris_left"]]
    assert t["generations_checked"] >= 3 and t["generation_mismatch"] == 0
    assert t["generations_from_store"] >= 1  # a torn listing (below) has its new ids, not stored: computed
    # inconsistent listings are reported, not asserted here: see test_a_name_saved_again_and_killed_... below


REPRO = """
import hashlib, os, signal, sys
from pathlib import Path
import torch
from edgekv.runtime.disk_store import RecordLayout
from edgekv.runtime.store import ContextStore
from edgekv.runtime.store import context_store as cs

H, D, L = 2, 16, 3
FP = {"id": hashlib.sha256(b"model").hexdigest(), "name": "model", "model_type": "llama", "n_layers": L,
      "n_kv_heads": H, "head_dim": D, "dtype": "float32"}


def open_store(root):
    return ContextStore.open(root, FP, RecordLayout(4, H, D, torch.float32), L, chunk_tokens=8)


def save(store, n):
    gen = torch.Generator().manual_seed(n)
    kv = [(torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)) for _ in range(L)]
    store.put(list(range(n, 2 * n)), kv, name="doc")


if __name__ == "__main__":
    store = open_store(sys.argv[1])
    write_atomic = cs.write_atomic

    def killed_after_the_context_file(path, *a, **k):
        write_atomic(path, *a, **k)
        if Path(path).parent.name == "contexts":  # the new ids are in place, index.json not yet
            os.kill(os.getpid(), signal.SIGKILL)

    cs.write_atomic = killed_after_the_context_file
    save(store, 40)  # "doc" again, 40 other tokens
"""


def test_a_name_saved_again_and_killed_before_the_index_is_listed_as_what_it_holds(tmp_path):
    from tests.harness.crash_trials import tmp_debris

    repro = {}
    exec(compile(REPRO, "repro", "exec"), repro)  # the same helpers in this process (not __main__: nothing runs)
    repro["save"](repro["open_store"](tmp_path), 20)  # "doc": 20 tokens
    proc = subprocess.run([sys.executable, "-c", REPRO, str(tmp_path)], cwd=REPO, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    store = repro["open_store"](tmp_path)  # the next process
    assert tmp_debris(tmp_path) == []
    (entry,) = store.contexts()
    ids = store.context_ids("doc")
    matched = store.match(ids + [0])
    found = {"listed_tokens": entry["tokens"], "complete": entry["complete"], "usable": entry["usable_tokens"],
             "ids": len(ids), "matched": matched.n_tokens if matched else 0}
    # old or new, but one save: the listing describes the ids the context gives, and their KV is there
    assert found["listed_tokens"] == found["ids"], found
    assert not found["complete"] or found["matched"] == found["usable"], found
