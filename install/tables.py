"""Hardware-independent lookup tables (KVSwap Appendix A.1), cached per model.

- reuse rate vs reuse-buffer capacity C, per group size G: the predictor's picks over
  calibration prompts are recorded once per G (the ``groups_selected`` events of a real
  kvswap run) and replayed through the runtime's own FIFO slot table at every C.  The picks
  do not depend on C, so the replay is exact;
- sigma -> low-rank adapter: one SVD per layer of the calibration keys, saved as safetensors.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from edgekv.runtime import Engine, LowRankAdapter, RuntimeConfig
from edgekv.runtime.adapter import collect_keys
from edgekv.runtime.prompt_cache import PromptKVCache
from edgekv.runtime.slots import replay_hit_rate
from edgekv.runtime.store.files import write_json_atomic

C_RATIOS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)  # C / M


def record_selections(engine: Engine, prompts: list[list[int]], steps: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(layer, groups, valid) of every prediction of a greedy run, in order."""
    picks = []

    def keep(event):
        if event.kind == "groups_selected":
            picks.append((event.info["layer"], event.info["groups"].copy(), event.info["valid"].copy()))

    engine.events.subscribe(keep)
    try:
        engine.generate(prompts, max_new_tokens=steps, stop_token_ids=[])
    finally:
        engine.events.unsubscribe(keep)
    return picks


def reuse_table(model, kv_path, prompts: list[list[int]], group_sizes, mg_const: int, adapter_path: str,
                steps: int = 32) -> dict:
    """{G: {C/M ratio: reuse rate}} with M = ceil(mg_const / G) groups per step, predicting with ``adapter_path``.
    The prompts are computed once: every G's run takes their KV from one prompt cache (the prefill is most of a
    run's time on a CPU; the predictor's picks only start at the decode steps)."""
    out = {}
    cache = PromptKVCache()
    max_context = max(len(p) for p in prompts) + steps + 16
    adapter = LowRankAdapter.load(adapter_path)
    for G in group_sizes:
        M = math.ceil(mg_const / G)
        cfg = RuntimeConfig.load({"G": G, "M": M, "C": M, "sigma": None, "adapter_path": adapter_path,
                                  "max_context": max_context, "max_batch": len(prompts), "io_align_bytes": 512})
        with Engine(model, cfg, "kvswap", kv_path, adapter=adapter) as engine:
            engine.prompt_cache = cache
            picks = record_selections(engine, prompts, steps)
        out[G] = {r: replay_hit_rate(picks, model.dims.n_layers, len(prompts), max(M, round(r * M)), max_context // G + 1,
                                     "fifo") for r in C_RATIOS}
    return out


def reuse_rate(table: dict, G: int, capacity: int, picked_groups: int) -> float:
    """The table's rate for (G, C), linear in C / picked_groups between recorded ratios; 0 without reuse data for G."""
    rows = table.get(G) or table.get(str(G))
    if not rows:
        return 0.0
    ratios = sorted((float(r), v) for r, v in rows.items())
    return float(np.interp(capacity / max(1, picked_groups), [r for r, _ in ratios], [v for _, v in ratios]))


def build_adapters(model, prompts: list[list[int]], sigmas, out_dir: Path) -> dict[float, str]:
    """One adapter per sigma from one pass of calibration keys; {sigma: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = collect_keys(model, prompts)
    dims = model.dims
    paths = {}
    for sigma in sigmas:
        path = out_dir / f"adapter-sigma{sigma:g}.safetensors"
        LowRankAdapter.fit_sigma(keys, dims.n_kv_heads, dims.head_dim, sigma).save(path)
        paths[sigma] = str(path)
    return paths


def save_tables(path: Path, fingerprint: dict, reuse: dict, adapters: dict, meta: dict) -> None:
    payload = {"fingerprint": fingerprint, "meta": meta, "adapters": {str(s): p for s, p in adapters.items()},
               "reuse": {str(g): {str(r): v for r, v in rows.items()} for g, rows in reuse.items()}}
    write_json_atomic(path, payload)


def load_tables(path: Path) -> tuple[dict, dict, dict]:
    data = json.loads(path.read_text())
    reuse = {int(g): {float(r): v for r, v in rows.items()} for g, rows in data["reuse"].items()}
    return reuse, {float(s): p for s, p in data["adapters"].items()}, data["meta"]
