"""Where a decode step makes the host wait for the GPU: every synchronizing call torch's sync debug mode reports
in three steps of kvswap on the fixture, grouped by its Python stack (needs a GPU).

    python -m tests.harness.cuda_syncs
"""
import collections
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

import torch

from tests.test_cuda import _one_batch

STEPS = 3


def sync_stacks(extra: dict) -> tuple[collections.Counter, int]:
    seen = collections.Counter()

    def keep(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                      if "warnings" not in f.filename]
            seen[(threading.current_thread().name, tuple(frames[-5:]))] += 1

    with tempfile.TemporaryDirectory() as kv:
        engine, batch = _one_batch(Path(kv), extra)
        tokens = torch.tensor([5, 6])
        with batch:
            batch.step(tokens)  # warm-up: allocations, first touch
            torch.cuda.synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = keep
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(STEPS):
                        batch.step(tokens)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        engine.close()
    return seen, engine.model.dims.n_layers


def main() -> None:
    for extra in ({}, {"correction": "corrected"}):
        seen, layers = sync_stacks(extra)
        print(f"== kvswap {extra or ''}: {sum(seen.values()) / STEPS:.1f} syncs per step, {layers} layers")
        for (thread, frames), n in seen.most_common():
            print(f"  {n / STEPS:.1f} per step [{thread}]: " + " <- ".join(reversed(frames)))


if __name__ == "__main__":
    main()
