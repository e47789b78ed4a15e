"""What a correction costs a decode step, and where: the same kvswap configuration guess-only, corrected, and corrected
with its reads overlapped (``MODES``), and corrected where the guess falls short of each ``--recalls`` share only
(``correction_recall``; with ``--fixed-probes`` also without the probes' backoff, each probe skipping ``PROBE_STEPS``),
each after a few warm-up steps, ms per step in the policy's phases (wall time of
each phase on the compute thread, nested phases inside their callers).

    python -m bench.correction_cost --model smollm2 --context 8192 --kvswap G=4,M=410,C=393,sigma=8 \\
        --extra '{"reuse": false, "sink_tokens": 4, "window_tokens": 64}'
    python -m bench.correction_cost --model smollm2 --context 8192 --kvswap G=4,M=205,C=205,sigma=2 --weights int4 \\
        --extra '{"reuse": false, "klr_dtype": "int8", "score_reduce": "softmax", "correction_reads": 52}' \\
        --text builtin --recalls 0.9,0.85
"""
import argparse
import collections
import functools
import json
import statistics
import tempfile
import threading
import time

import torch
from edgekv.runtime import Engine, disk_store, guesses, offload, slots

from bench.step_profile import fields, prefilled

PHASES = {offload.OffloadedKV: ("prefetch", "take_picks", "attend", "_pick", "_wait_fetch", "_correct", "_wait",
                                "_read_misses", "_keys_values"),
          slots.PreloadSlots: ("assign", "correct", "resident"), slots.SlotTable: ("assign", "correct", "resident"),
          disk_store.DiskKVStore: ("read",)}
FIX_THREAD = "ekv-fix"  # the I/O thread of a correction's reads (runtime/offload.py): their time is a correction's floor

# the same configuration three ways: the layer-ahead guess, corrected, and corrected with the attention over what is in
# memory overlapping the correction's reads
MODES = {"guess": {"correction": "guess"}, "corrected": {"correction": "corrected"},
         "corrected-overlap": {"correction": "corrected", "correction_overlap": True}}


def timed(spent: collections.Counter) -> None:
    """Wrap each phase so its wall time adds to ``spent`` under its name."""
    for cls, names in PHASES.items():
        for name in names:
            inner = getattr(cls, name)

            @functools.wraps(inner)
            def wrapper(*args, _inner=inner, _key=f"{cls.__name__}.{name}", **kwargs):
                started = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    fix = _key == "DiskKVStore.read" and threading.current_thread().name.startswith(FIX_THREAD)
                    spent[f"{_key} (correction's, {FIX_THREAD})" if fix else _key] += time.perf_counter() - started

            setattr(cls, name, wrapper)


def _text_ids(args) -> list[int]:
    """The eval text's token ids (evals/scoring.py), enough for the prompt and every step."""
    from edgekv.evals.scoring import load_text, tokenize
    from edgekv.runtime.checkpoints import resolve_checkpoint

    ids, _ = tokenize(resolve_checkpoint(args.model), load_text(args.text)[0])
    if len(ids) < args.context + args.warmup + args.steps:
        raise SystemExit(f"--text {args.text} holds {len(ids)} tokens; --context plus the steps need "
                         f"{args.context + args.warmup + args.steps}: pass a longer text")
    return ids


def _prompted(engine: Engine, context: int, room: int, ids: list[int] | None):
    """A batch of one sequence ready to decode, ``room`` positions left: the text's first ``context`` tokens, or
    synthetic ids."""
    if ids is None:
        return prefilled(engine, context + room, room=room)
    batch = engine.open_batch(1, context + room)
    batch.join(0, ids[:context])
    batch.end_prefill()
    return batch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kvswap", default="G=4,M=410,C=393,sigma=8")
    ap.add_argument("--extra", default='{"reuse": false, "sink_tokens": 4, "window_tokens": 64}', help="JSON fields")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--kv-path", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="runs of every mode, interleaved; the median is reported")
    ap.add_argument("--recalls", default="", help="correction_recall thresholds, each a mode (e.g. 0.9,0.85)")
    ap.add_argument("--fixed-probes", action="store_true", help="each --recalls mode also with every passed probe "
                    "skipping PROBE_STEPS steps (no backoff: what ProbeSchedule's doubling saves)")
    ap.add_argument("--from-before", action="store_true", help="each --recalls mode with guess_from_before off, "
                    "and again on (a ',from before' mode)")
    ap.add_argument("--modes", default=",".join(MODES), help="which of MODES run (guess always does: the reference)")
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the CPU's, float32)")
    ap.add_argument("--text", default="synthetic", help="the prompt: synthetic ids (bench.step_profile.prefilled), or "
                    "builtin / a text file: its first --context tokens, each step fed the next one (a guess's recall, "
                    "so what correction_recall skips, depends on the text)")
    args = ap.parse_args(argv)
    ids = None if args.text == "synthetic" else _text_ids(args)
    spent = collections.Counter()
    timed(spent)
    room = max(64, args.warmup + args.steps)  # every decode step's token has its place
    cfg = {**fields(args.kvswap), **json.loads(args.extra), "max_batch": 1, "max_context": args.context + room}
    step_ms_of = collections.defaultdict(list)
    floor_of = collections.defaultdict(list)  # ms a step of rescoring and of the correction's reads
    asked = {"guess", *args.modes.split(",")}
    if asked - set(MODES):
        raise SystemExit(f"--modes {args.modes}: each is one of {', '.join(MODES)}")
    modes = {m: overrides for m, overrides in MODES.items() if m in asked}
    for r in filter(None, args.recalls.split(",")):
        skipping = {"correction": "corrected", "correction_recall": float(r)}
        modes[f"corrected,recall={r}"] = {**skipping, "guess_from_before": False} if args.from_before else skipping
        if args.fixed_probes:
            modes[f"corrected,recall={r},fixed probes"] = modes[f"corrected,recall={r}"]
        if args.from_before:
            modes[f"corrected,recall={r},from before"] = {**skipping, "guess_from_before": True}
    probes_max = guesses.PROBE_STEPS_MAX
    for mode, overrides in [item for _ in range(args.repeat) for item in modes.items()]:
        guesses.PROBE_STEPS_MAX = guesses.PROBE_STEPS if mode.endswith("fixed probes") else probes_max
        with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
                args.model, kv_offload_path=kv, policy="kvswap", device="cpu", dtype=args.dtype, weights=args.weights,
                config={**cfg, **overrides}) as engine, _prompted(engine, args.context, room, ids) as batch:
            tokens = iter(ids[args.context :] if ids else [42] * (args.warmup + args.steps))
            for _ in range(args.warmup):
                batch.step(torch.tensor([next(tokens)]))
            spent.clear()
            policy = batch.policy
            before = (policy.correction_records.sum(), policy.bytes_read.sum(), policy.guess_recall_counts.copy(),
                      policy.corrected_layer_steps.copy())
            started = time.perf_counter()
            for _ in range(args.steps):
                batch.step(torch.tensor([next(tokens)]))
            step_ms = (time.perf_counter() - started) / args.steps * 1e3
            extra = (policy.correction_records.sum() - before[0]) / args.steps
            read_mib = (policy.bytes_read.sum() - before[1]) / args.steps / 2**20
            recalled, corrected = policy.guess_recall_counts - before[2]
            corrected_layers, attended = policy.corrected_layer_steps - before[3]
            share = corrected_layers / max(1, attended)
        step_ms_of[mode].append(step_ms)
        recall = f", guess recall {recalled / corrected:.3f}, layers corrected {share:.2f}" if corrected else ""
        print(f"== {mode}: {step_ms:.1f} ms a step ({1e3 / step_ms:.2f} tok/s), {extra:.0f} extra records and "
              f"{read_mib:.1f} MiB read a step{recall}")
        for key, seconds in spent.most_common():
            print(f"  {key:28s} {seconds / args.steps * 1e3:7.2f} ms a step")
        floor_of[mode].append(sum(spent[key] for key in (f"DiskKVStore.read (correction's, {FIX_THREAD})",
                                                         "OffloadedKV._pick")) / args.steps * 1e3)
    guesses.PROBE_STEPS_MAX = probes_max
    guess = statistics.median(step_ms_of["guess"])
    for mode, runs in step_ms_of.items():
        print(f"{mode:40s} median {statistics.median(runs):6.1f} ms a step, {guess / statistics.median(runs):.2f} x "
              f"guess's tok/s (runs: {', '.join(f'{ms:.1f}' for ms in runs)})")
    for mode in [m for m in step_ms_of if m != "guess"]:  # what a correction adds that no bookkeeping cut removes
        print(f"{mode}: rescoring + waiting on the correction's reads (their time on {FIX_THREAD}) "
              f"{statistics.median(floor_of[mode]):.1f} ms a step")


if __name__ == "__main__":
    main()
