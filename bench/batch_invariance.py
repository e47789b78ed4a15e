"""Batch invariance at temperature 0: one fixed greedy request beside rows that join, finish and are cancelled at
random steps, as a server's continuous batching runs them; its tokens against its run alone.

    .venv/bin/python -m bench.batch_invariance --model smollm2 --config deploy/local/config.json --trials 20 \\
        --json docs/results/serving/batch-invariance-smollm2.json

Each trial (seeded) puts the fixed request in a random row, joining at one of the first steps; every free row takes
a random prompt (1 token up to ``--others-tokens``) with even odds at each step boundary and leaves after 1 to 12
steps (a cancel and a finish are the same leave to the batch).  A trial whose fixed tokens differ anywhere counts as
changed (the report gives the first token that differs), and one whose logits differ in any bit is counted apart:
bits that differ are a token that may flip on another prompt.  The step time of the runs alone and beside others is
reported beside, so what invariance costs is seen in the same run.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from edgekv.runtime import Engine

MAX_LIFE_STEPS = 12  # a row beside the fixed one leaves after 1 to this many steps


@dataclass
class Trial:
    """What a trial ran: the fixed request's tokens and the logits each came from, its row and join step, and the
    rows' joins and leaves."""

    tokens: list[int]
    logits: list[torch.Tensor]
    row: int
    join_step: int
    joins: int = 0
    leaves: int = 0
    step_s: list[float] = field(default_factory=list)


def run_trial(engine: Engine, rows: int, context: int, fixed: list[int], new_tokens: int, rng: random.Random | None,
              others_tokens: int) -> Trial:
    """The fixed prompt's ``new_tokens`` greedy tokens in a batch of ``rows``; ``rng`` None: alone in row 0 from the
    first step, else beside random joins and leaves drawn from ``rng``."""
    batch = engine.open_batch(rows, context)
    vocab = engine.model.dims.vocab
    row = 0 if rng is None else rng.randrange(rows)
    trial = Trial([], [], row, 0 if rng is None else rng.randrange(4))
    last: dict[int, int] = {}  # row -> its latest token
    leave_at: dict[int, int] = {}  # a row beside the fixed one -> the step it leaves
    step = 0
    try:
        while len(trial.tokens) < new_tokens:
            for other in [r for r, at in leave_at.items() if at <= step]:
                batch.leave(other)
                del leave_at[other], last[other]
                trial.leaves += 1
            joined = False
            if step == trial.join_step:
                logits = batch.join(row, fixed).logits
                last[row] = int(logits.argmax())
                trial.tokens.append(last[row])
                trial.logits.append(logits.float().clone())
                joined = True
            for other in batch.free_rows() if rng is not None else ():
                if (other == row and not trial.tokens) or rng.random() >= 0.5:
                    continue
                ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, others_tokens + 1))]
                last[other] = int(batch.join(other, ids).logits.argmax())
                leave_at[other] = step + rng.randrange(1, MAX_LIFE_STEPS + 1)
                trial.joins += 1
                joined = True
            if joined:
                batch.end_prefill()
            if last:
                tokens = torch.zeros(rows, dtype=torch.long)
                for r, token in last.items():
                    tokens[r] = token
                started = time.perf_counter()
                logits = batch.step(tokens)
                trial.step_s.append(time.perf_counter() - started)
                for r in last:
                    last[r] = int(logits[r].argmax())
                if row in last and len(trial.tokens) < new_tokens:
                    trial.tokens.append(last[row])
                    trial.logits.append(logits[row].float().clone())
            step += 1
    finally:
        batch.close()
    return trial


def first_difference(a: list, b: list) -> int | None:
    """The first position where two runs' tokens (or logits, bit for bit) differ; None where none does."""
    same = [x == y if isinstance(x, int) else torch.equal(x, y) for x, y in zip(a, b)]
    return next((i for i, equal in enumerate(same) if not equal), None if len(a) == len(b) else min(len(a), len(b)))


def measure(engine: Engine, trials: int, rows: int, context: int, fixed_tokens: int, new_tokens: int,
            others_tokens: int, seed: int = 0, progress: bool = True) -> dict:
    """``trials`` seeded trials against the fixed request alone; the report (changed trials and where)."""
    engine.pin_adapter()  # as the server does: no batch's prompts shape the projection
    rng = random.Random(seed)
    fixed = [rng.randrange(engine.model.dims.vocab) for _ in range(fixed_tokens)]
    alone = run_trial(engine, rows, context, fixed, new_tokens, None, others_tokens)
    changed, changed_logits, step_s = [], [], []
    for t in tqdm(range(trials), desc="batch invariance", unit="trial", disable=not progress):
        trial = run_trial(engine, rows, context, fixed, new_tokens, random.Random(seed * 1_000_003 + t + 1),
                          others_tokens)
        step_s += trial.step_s
        where = first_difference(trial.tokens, alone.tokens)
        if where is not None:
            changed.append({"trial": t, "row": trial.row, "join_step": trial.join_step, "first_changed_token": where})
        if first_difference(trial.logits, alone.logits) is not None:
            changed_logits.append(t)
    return {"trials": trials, "changed_trials": len(changed), "changed_logits_trials": len(changed_logits),
            "changed": changed, "rows": rows,
            "fixed_prompt_tokens": fixed_tokens, "new_tokens": new_tokens, "others_max_tokens": others_tokens,
            "alone_step_ms": 1e3 * sum(alone.step_s) / len(alone.step_s),
            "beside_step_ms": 1e3 * sum(step_s) / max(1, len(step_s))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model name or path (default: the config's model, else fixture)")
    p.add_argument("--config", default=None, help="a config file, e.g. deploy/local/config.json (default: defaults)")
    p.add_argument("--policy", default="kvswap", help="the KV policy (default: %(default)s)")
    p.add_argument("--trials", type=int, default=20, help="trials beside random rows (default: %(default)s)")
    p.add_argument("--rows", type=int, default=4, help="the batch's rows (default: %(default)s)")
    p.add_argument("--context", type=int, default=4096, help="the context the batch is built for (default: %(default)s)")
    p.add_argument("--fixed-tokens", type=int, default=1200, help="the fixed prompt's tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens the fixed request decodes (default: %(default)s)")
    p.add_argument("--others-tokens", type=int, default=1600,
                   help="the longest prompt of a row beside it (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the report here (default: print it only)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model or (json.loads(Path(args.config).read_text()).get("model") if args.config else None) or "fixture"
    with tempfile.TemporaryDirectory() as kv, Engine.from_pretrained(model, kv_path=kv, config=args.config,
                                                                       policy=args.policy, device="cpu") as engine:
        report = measure(engine, args.trials, args.rows, args.context, args.fixed_tokens, args.new_tokens,
                         args.others_tokens)
        report["meta"] = {"model": model, "config": args.config, "policy": args.policy,
                          "run_config": {k: v for k, v in engine.batch_config(args.rows, args.context).to_dict().items()
                                         if k in ("G", "M", "C", "sigma", "kv_record_dtype", "klr_dtype",
                                                  "score_reduce", "correction", "prompt_adapter")}}
    print(json.dumps({k: v for k, v in report.items() if k != "changed"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["changed_trials"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
