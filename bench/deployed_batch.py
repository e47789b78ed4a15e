"""What the one-process benches of the deployed configuration share: their model and configuration options, and a
batch of text prompts prefilled and ready to decode (row r from token 997 r of the text), each step feeding every
row its text's next token, so the picks move as they do on real text; and the settings an A/B alternates on it."""
import argparse
import contextlib
import json
import statistics
import tempfile
import time
from typing import Callable

import torch

from edgekv.runtime import Engine

# what `make deploy` chose for SmolLM2 on the local profile (docs/results/chosen-smollm2-8k-deployed-bf16.json)
DEPLOYED = ("G=4,M=205,C=205,sigma=2", '{"reuse": false, "klr_dtype": "int8", "score_reduce": "softmax", '
            '"correction": "corrected", "correction_reads": 52, "correction_recall": 0.85, "guess_from_before": true}')


def fields(text: str) -> dict:
    """``G=8,M=50,sigma=16,klr_dtype=int8,reuse=false`` -> {"G": 8, "M": 50, "sigma": 16.0, "klr_dtype": "int8",
    "reuse": False}: numbers, true/false, and any other value as text."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif value.replace(".", "", 1).isdigit():
            out[key] = float(value) if "." in value or key == "sigma" else int(value)
        else:
            out[key] = value
    return out


def text_ids(model: str, text: str, tokens: int) -> list[int]:
    """The token ids of ``text`` (evals/scoring.py: builtin, calibration or a file), at least ``tokens`` of them."""
    from edgekv.evals.scoring import load_text, tokenize
    from edgekv.runtime.checkpoints import resolve_checkpoint

    ids, _ = tokenize(resolve_checkpoint(model), load_text(text)[0])
    if len(ids) < tokens:
        raise SystemExit(f"--text {text} holds {len(ids)} tokens; the prompts plus the steps need {tokens}: "
                         "pass a longer text")
    return ids


def parser(doc: str, batch: int, text: bool = True, rounds: int | None = None, steps: int = 8,
           setting: str = "setting") -> argparse.ArgumentParser:
    """A bench's parser, described by the first paragraph of its ``doc``, with the options below; an A/B's (``rounds``
    given) also takes ``--rounds`` and ``--steps``, the timed steps a ``setting`` takes per round."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_options(ap, batch, text)
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
        ap.add_argument("--steps", type=int, default=steps, help=f"timed decode steps a {setting} takes per round")
    return ap


def alternating_room(args: argparse.Namespace, settings: int) -> int:
    """The steps past the context an A/B of ``settings`` alternating decodes: 8 warm-up steps, then every round each
    setting's untimed first step and its ``--steps``."""
    return 8 + settings * args.rounds * (args.steps + 1)


def add_options(ap: argparse.ArgumentParser, batch: int, text: bool = True) -> None:
    """The model, context, batch, kvswap configuration, weights, dtype and KV folder (and the prompts' text)."""
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--kvswap", default=DEPLOYED[0])
    ap.add_argument("--extra", default=DEPLOYED[1], help="JSON fields")
    if text:
        ap.add_argument("--text", default="builtin", help="the prompts: this text's tokens, row r from token 997 r")
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the CPU's, float32)")
    ap.add_argument("--kv-path", default=None)


def engine_config(args: argparse.Namespace, room: int) -> dict:
    """The kvswap configuration of ``args`` for a batch of ``args.batch`` rows with ``room`` steps past the context."""
    return {**fields(args.kvswap), **json.loads(args.extra), "max_batch": args.batch, "max_context": args.context + room}


@contextlib.contextmanager
def text_batch(args: argparse.Namespace, room: int, policy: str = "kvswap"):
    """(the ``policy``, a function taking one decode step) over a prefilled batch with ``room`` steps to decode, 8 of
    them taken, the run's model and configuration printed; a hybrid model's policy is its global layers' one."""
    ids = text_ids(args.model, args.text, args.context + 997 * (args.batch - 1) + room)
    starts = [997 * row for row in range(args.batch)]
    with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
            args.model, kv_path=kv, policy=policy, device="cpu", dtype=args.dtype, weights=args.weights,
            config=engine_config(args, room)) as engine:
        batch = engine.open_batch(args.batch, args.context + room)
        for row, start in enumerate(starts):
            batch.join(row, ids[start : start + args.context])
        batch.end_prefill()
        with batch:
            made = [0]

            def step() -> None:
                batch.step(torch.tensor([ids[start + args.context + made[0]] for start in starts]))
                made[0] += 1

            for _ in range(8):
                step()
            print(f"{args.model} {args.context} tokens, batch {args.batch}, {policy}"
                  + (f" {args.kvswap} {args.extra}" if engine.spec.on_disk else ""))
            yield getattr(batch.policy, "inner", None) or batch.policy, step


def alternate(step: Callable[[], None], settings: dict[str, Callable[[], None]], rounds: int, steps: int,
              counters: Callable[[], tuple] = tuple) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Each setting applied in turn for ``rounds`` rounds (the order reversed every other round), its first step after
    the switch untimed, then ``steps`` timed: the settings share the files, the picks' spread and the machine's drift.
    Returns {setting: ms a step, per round} and {setting: the summed change of ``counters()`` over its timed steps}."""
    ms = {name: [] for name in settings}
    totals = {name: [0] * len(counters()) for name in settings}
    for r in range(rounds):
        for name in list(settings)[:: 1 if r % 2 == 0 else -1]:
            settings[name]()
            step()
            before, started = counters(), time.perf_counter()
            for _ in range(steps):
                step()
            ms[name].append((time.perf_counter() - started) / steps * 1e3)
            totals[name] = [t + b - a for t, a, b in zip(totals[name], before, counters())]
            print(f"round {r} {name}: {ms[name][-1]:.1f} ms a step", flush=True)
    return ms, totals


def print_medians(ms: dict[str, list[float]], base: str, prefix: str = "") -> None:
    """Each setting's median step over its rounds (``alternate``'s ms), and its tok/s over the ``base`` setting's."""
    base_ms = statistics.median(ms[base])
    for name, runs in ms.items():
        print(f"{prefix}{name}: median {statistics.median(runs):.1f} ms a step ({', '.join(f'{x:.1f}' for x in runs)});"
              f" {base_ms / statistics.median(runs):.3f} x the tok/s of {base}")
