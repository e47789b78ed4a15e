"""The `edgekv` command: generate with any policy, build the native reader, smoke-deploy."""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

from edgekv.runtime.checkpoints import MODEL_HELP
from edgekv.runtime.config import utf8_text

KV_PATHS_HELP = ("folders on several disks, comma-separated, instead of --kv-path: the KV records are spread over "
                 "them and read through one queue per disk")
POLICY_HELP = "the KV policy: a name registered in runtime/policies/ (kvswap, full, flexgen, token, hillinfer, arkv)"
PROMPT_HELP = "plain text, or a JSON list of token ids when it starts with '['"
# whole-number flags (by dest): (least, most or None); argparse only checks that they are numbers
WHOLE_FLAGS = {"max_new_tokens": (1, None), "top_k": (0, None), "chunk_tokens": (1, None), "max_context": (2, None),
               "new_tokens": (1, None), "samples": (1, None), "ppl_tokens": (2, None), "group_size": (1, None),
               "steps": (1, None), "warmup": (0, None), "port": (0, 65535), "max_queue": (1, None),
               "max_connections": (1, None),
               "seed": (0, 2**63 - 1)}  # torch's generator takes 64-bit seeds; numpy's none below 0
# number flags (by dest): (low, high, low allowed, high allowed); NaN and infinities are never meant
REAL_FLAGS = {"temperature": (0, math.inf, True, False), "top_p": (0, 1, False, True), "drop_at": (0, 1, False, False),
              "max_mib": (0, math.inf, False, False), "disk_seconds": (0, math.inf, False, False),
              "path_limit_mib_s": (0, math.inf, False, False), "rate_hz": (0, math.inf, False, False),
              "max_body_mib": (0, math.inf, False, False), "store_max_mib": (0, math.inf, False, False),
              "shutdown_grace_s": (0, math.inf, True, False), "header_timeout_s": (0, math.inf, False, False),
              "body_timeout_s": (0, math.inf, False, False)}
# what each command's memory grows with: named when it runs out
MEMORY_FLAGS = {"generate": "the prompts or --config's max_context / max_batch", "context": "the context file",
                "eval": "--contexts or --samples", "bench": "--contexts or --batches", "ttft": "--contexts"}


class UsageError(ValueError):
    """A flag's value cannot work; the message names the flag and what to pass instead."""


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _kv_paths(args, must_exist: bool = True) -> list[str] | None:
    """--kv-path DIR or --kv-paths DIR1,DIR2,... (not both) -> the KV folders in order, None when neither is given.

    Checked here, not in the engine, so a bad folder is named as the user typed it (the flag, the path)."""
    from edgekv.install.profile import check_kv_paths

    single, several = getattr(args, "kv_path", None), getattr(args, "kv_paths", None)
    if single is not None and several is not None:
        raise UsageError(f"--kv-path {single} and --kv-paths {several} both name the KV folders; pass one of them "
                         "(--kv-paths DIR1,DIR2,... for several disks)")
    if single is None and several is None:
        return None
    flag, given = ("--kv-path", [single]) if single is not None else (
        "--kv-paths", [p.strip() for p in several.split(",")])
    try:
        paths = list(check_kv_paths(given, flag))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    missing = [user for user, path in zip(given, paths) if not os.path.isdir(path)]
    if must_exist and missing:
        raise UsageError(f"{flag}: no folder {', '.join(missing)}; create it on the disk that should hold the KV cache")
    return paths


@contextlib.contextmanager
def _scratch_kv(paths: list[str] | None):
    """A temporary KV folder under each of the user's KV folders (the system temp dir without any), removed after."""
    with contextlib.ExitStack() as stack:
        yield [Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgekv-kv-", dir=p)))
               for p in paths or [None]]


def _generate(args) -> int:
    from edgekv.runtime import Engine

    prompts = list(args.prompt or [])  # read and parsed by _check_args
    prompts += [[{"role": "user", "content": c}] for c in args.chat or []]
    prompts = prompts or [""]  # --context alone: continue the stored context
    kv_paths = _kv_paths(args)
    if args.context and not (kv_paths or args.store):
        raise ValueError(f"--context {args.context} needs the store it was saved to: pass the same --kv-path (or --store)")
    with contextlib.ExitStack() as stack:
        kv = kv_paths or stack.enter_context(_scratch_kv(None))
        engine = stack.enter_context(Engine.from_pretrained(args.model, kv_offload_path=kv, config=args.config,
                                                            policy=args.policy))
        if args.context or args.store:
            engine.open_context_store(_store_location(args))
        results = engine.generate(
            prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, context=args.context,
        )
    for result in results:
        if args.json:
            print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason, "stats": result.stats}))
        else:
            print(result.text)
    return 0


def _store_location(args) -> str:
    """--store (a folder, file:// or http(s):// URL; other schemes refused), else the store folder under the (first)
    KV path: contexts live on the KV disk beside the running KV."""
    from edgekv.runtime.store import store_location

    if args.store:
        return str(store_location(args.store))
    kv_paths = _kv_paths(args, must_exist=False)
    if not kv_paths:
        raise ValueError("which context store? pass --kv-path (the store is KV_PATH/contexts) or --store")
    return str(Path(kv_paths[0]) / "contexts")


def _context(args) -> int:
    from edgekv.runtime.store import ContextStore

    if args.action == "save":
        from edgekv.runtime import Engine

        context = _read_prompt("context save FILE", args.file, from_file=True)
        with Engine.from_pretrained(args.model, config={"max_context": args.max_context}, policy="full") as engine:
            engine.open_context_store(_store_location(args), chunk_tokens=args.chunk_tokens,
                                      max_bytes=int(args.max_mib * 2**20) if args.max_mib else None)
            stored = engine.save_context(context, name=args.name)
        print(json.dumps({"name": args.name, "stored_tokens": stored.n_tokens, "chunks": len(stored.chunks)}))
        return 0
    store = ContextStore.open_existing(_store_location(args))
    if args.action == "list":
        for row in store.contexts():
            print(json.dumps(row))
    elif getattr(args, "all", False):
        store.remove_all()
    elif args.name:
        store.remove(args.name)
    else:
        raise ValueError("context rm needs NAME (or --all)")
    return 0


def _ttft(args) -> int:
    from edgekv import ttft_bench

    rates = [float(r) for r in args.link_mib_s.split(",") if r]
    costs = _cost_model(args.costs) if args.costs else None
    contexts = [int(c) for c in args.contexts.split(",")]
    meta = {"model": args.model, "contexts": contexts, "link_mib_s": rates, "drop_at": args.drop_at,
            "chunk_tokens": args.chunk_tokens, "costs": args.costs}
    runs = ttft_bench.run(args.model, contexts, rates, args.drop_at, args.kv_path, chunk_tokens=args.chunk_tokens,
                          new_tokens=args.new_tokens, costs=costs, quiet=args.quiet, text=args.text, meta=meta)
    print(ttft_bench.table(runs))
    if args.json:
        ttft_bench.write_json(Path(args.json), runs, meta)
    if args.png:
        ttft_bench.plot(runs, Path(args.png))
    return 0


def _build_native(args) -> int:
    from edgekv.runtime.native_build import build_all

    for backend, where in build_all().items():
        print(f"{backend}: {where}")
    return 0


def _deploy(args) -> int:
    from edgekv.deploy import run

    result = run(args.platform, args.model, _kv_paths(args, must_exist=False), reprofile=args.reprofile,
                 profile_only=args.profile_only, disk_seconds=args.disk_seconds, calibration=args.calibration)
    if result.get("stats"):
        print(json.dumps(result["stats"]))  # the last line: the smoke generation's stats
    return 0


def _serve(args) -> int:
    from edgekv.serve import ServeOptions, run

    config = args.config
    if args.platform:
        from edgekv.platforms.detect import detect_platform
        from edgekv.serve.server import deployed_config

        config = str(deployed_config(detect_platform() if args.platform in ("", "auto") else args.platform))
    kv_paths = _kv_paths(args)
    logging.getLogger("edgekv").setLevel(logging.INFO)
    return run(ServeOptions(
        model=args.model, config=config, kv_paths=kv_paths, policy=args.policy, host=args.host, port=args.port,
        api_key=args.api_key, api_key_file=args.api_key_file, max_queue=args.max_queue, max_body_mib=args.max_body_mib,
        context_store=not args.no_context_store, chunk_tokens=args.chunk_tokens, store_max_mib=args.store_max_mib,
        served_model_name=args.served_model_name, shutdown_grace_s=args.shutdown_grace_s,
        max_connections=args.max_connections, header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s, openapi=args.openapi,
        allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()] if args.allowed_hosts else None))


def _bench(args) -> int:
    from edgekv import bench
    from edgekv.runtime.checkpoints import resolve_checkpoint

    checkpoint = resolve_checkpoint(args.model)
    kv_paths = _kv_paths(args)
    with _scratch_kv(kv_paths) as kvs:
        runs, meta = bench.run(checkpoint, kvs[0], [int(b) for b in args.batches.split(",")],
                               [int(c) for c in args.contexts.split(",")], args.budgets.split(","), args.steps,
                               args.warmup, args.disk_seconds, args.policies.split(","), quiet=args.quiet,
                               chosen_from=args.quality_configs, record_dtypes=_record_dtypes(args.record_dtype),
                               kv_paths=kvs if args.kv_paths else None, path_limit_mib_s=args.path_limit_mib_s,
                               prompt_source=args.prompts)
    meta.update(model=args.model, checkpoint=str(checkpoint), command=args.command_line)
    print(bench.table(runs))
    if "paths" in meta:
        print(bench.notes(meta))
    print(f"reproduce: {meta['command']}  (decode only; {args.warmup} warm-up steps excluded; "
          f"O_DIRECT={all(r.o_direct for r in runs if r.o_direct is not None)})")
    if args.json:
        bench.write_json(args.json, runs, meta)
    if args.png:
        bench.plot(runs, args.png)
    return 0


def _energy(args) -> int:
    import subprocess

    from edgekv.platforms import energy
    from edgekv.platforms.power import MeterUnavailable, open_meter

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise ValueError("no command to measure; usage: edgekv energy --json out.json -- <command> [args]")
    try:
        meter = open_meter(args.meter, args.platform, args.rate_hz)
    except MeterUnavailable as exc:
        print(f"edgekv energy: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        events_file = os.path.join(tmp, "events.jsonl")
        try:
            meter.start()
        except MeterUnavailable as exc:  # its first reading failed: nothing to measure, the command not run
            meter.close()
            print(f"edgekv energy: {exc}", file=sys.stderr)
            return 2
        try:
            rc = subprocess.run(command, env={**os.environ, "EDGEKV_EVENTS_FILE": events_file}).returncode
        finally:
            trace = meter.stop()
            meter.close()
        events = energy.read_events(events_file)
    result = energy.report(trace, events).to_json() | {"command": command, "returncode": rc}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.csv:
        energy.write_csv(args.csv, trace)
    if args.png:
        energy.plot(args.png, trace, events)
    if result.get("error"):
        print(f"edgekv energy: {result['error']}", file=sys.stderr)
        return rc or 3
    return rc


def _fpga(args) -> int:
    from edgekv.platforms.smartssd import selftest

    with tempfile.TemporaryDirectory() as tmp:
        result = selftest(args.backend, args.cases, args.seed, Path(tmp))
    result["bytes_ratio"] = result["bytes_to_host"] / max(1, result["bytes_host_scoring_would_read"])
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["topk_agreement"] == 1.0 else 1


def _parse_budget(text: str) -> float:
    """--budgets: one fraction of the full KV cache; bad input names the flag (a ValueError the CLI reports)."""
    num, _, den = text.partition("/")
    try:
        value = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        value = float("nan")
    if not 0 < value <= 1:
        raise UsageError(f"--budgets: {text!r} must be a fraction in (0, 1], e.g. 1/13")
    return value


def _record_dtypes(text: str) -> list[str]:
    """--record-dtype: the disk record formats to run, exact records ("auto") always first (the rows they are set beside)."""
    from edgekv.runtime.quant import RECORD_DTYPES

    asked = [r for r in text.split(",") if r]
    bad = [r for r in asked if r not in RECORD_DTYPES]
    if bad:
        raise UsageError(f"--record-dtype {text}: {bad} unknown; give a list of {list(RECORD_DTYPES)}, e.g. int8,int4")
    return list(dict.fromkeys(["auto", *asked]))


def _read_prompt(flag: str, source: str, from_file: bool):
    """A prompt as text or token ids: ``source`` itself, or the file it names (``-``: standard input) when
    ``from_file``.  Text that starts with '[' is a JSON list of token ids.  Errors name ``flag`` and the file, so a
    bad prompt is refused before the model loads."""
    where = f"{flag} {source}"
    if from_file:
        path = Path(source)
        if source == "-":
            raw = sys.stdin.buffer.read()
        elif path.is_dir():
            raise UsageError(f"{where} is a folder; pass the prompt's text file")
        elif not path.is_file():
            raise UsageError(f"{where}: no such file; pass a text file (or a JSON list of token ids)")
        else:
            raw = path.read_bytes()
        text = utf8_text(raw, where, "convert it (iconv -t UTF-8) or pass token ids as a JSON list", UsageError)
        if not text.strip():
            raise UsageError(f"{where} is empty; put the prompt's text (or a JSON list of token ids) in it")
    else:
        text = source
    if not text.lstrip().startswith("["):
        return text
    try:
        ids = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where if from_file else flag} starts with '[' but is not a JSON list of token ids ({exc}); "
                         "write token ids as [1, 20, 30]") from exc
    if not isinstance(ids, list):
        raise UsageError(f"{where if from_file else flag} starts with '[' but holds a JSON {type(ids).__name__}, not a "
                         "list of token ids; write token ids as [1, 20, 30]")
    return ids


def _cost_model(path: str):
    """--costs: the chunk cost model JSON ``python -m edgekv.install.chunk_profile`` writes, named when unreadable."""
    from edgekv.runtime.ttft.costs import cost_model_from_json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cost_model_from_json(data.get("predictor", data))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"--costs {path}: not a readable cost model ({type(exc).__name__}: {exc}); write one with "
                         "python -m edgekv.install.chunk_profile --json FILE, or drop --costs") from exc


def _check_args(args) -> None:
    """Every flag's value checked once, before any model loads; refusals are UsageErrors naming the flag."""
    if getattr(args, "quick", False):
        args.batches, args.contexts, args.budgets, args.steps, args.warmup, args.disk_seconds = "2", "4096", "1/13", 4, 2, 2
    for dest, (least, most) in WHOLE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and not (least <= value and (most is None or value <= most)):
            bound = f">= {least}" if most is None else f"in [{least}, {most}]"
            raise UsageError(f"{_flag(dest)} {value}: must be a whole number {bound}")
    for dest, (low, high, low_ok, high_ok) in REAL_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and not (math.isfinite(value) and (low < value or low_ok and value == low)
                                      and (value < high or high_ok and value == high)):
            span = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if high_ok else ')'}"
            raise UsageError(f"{_flag(dest)} {value:g}: must be a number in {span}")
    for dest in ("contexts", "batches"):
        if isinstance(getattr(args, dest, None), str):
            _whole_list(_flag(dest), getattr(args, dest))
    if args.command == "bench":  # bench.bench_point: prompts of context - steps - warmup - 8 - 4 * (batch - 1) tokens
        shortest, batch = min(_whole_list("--contexts", args.contexts)), max(_whole_list("--batches", args.batches))
        least = args.steps + args.warmup + 8 + 4 * (batch - 1) + 1
        if shortest < least:
            raise UsageError(f"--contexts {shortest} leaves no prompt before {args.steps} --steps, {args.warmup} "
                             f"--warmup steps at --batches {batch}; give contexts of at least {least}")
    if getattr(args, "budgets", None) is not None:
        for budget in args.budgets.split(","):
            _parse_budget(budget)
    if getattr(args, "record_dtype", None) is not None:
        _record_dtypes(args.record_dtype)
    if getattr(args, "link_mib_s", None) is not None:
        _real_list("--link-mib-s", args.link_mib_s, 0, "positive rates, e.g. 50,100,200,400")
    if getattr(args, "recall_sigmas", None) is not None:
        _real_list("--recall-sigmas", args.recall_sigmas, 1, "sigmas >= 1, e.g. 2,4,8,16", least_ok=True)
    if getattr(args, "policies", None) is not None:
        from edgekv.bench import row_names
        from edgekv.runtime.policies import names

        known = row_names() if args.command == "bench" else names()
        _names("--policies", args.policies, known)
    if getattr(args, "policy", None) is not None:
        from edgekv.runtime.policies import names

        _names("--policy", args.policy, names())
    if getattr(args, "tasks", None) not in (None, "all"):
        from edgekv.evals.tasks import TASKS

        _names("--tasks", args.tasks, TASKS, "or all")
    if args.command == "generate":
        args.prompt = [_read_prompt("--prompt", p, False) if kind == "text" else _read_prompt("--prompt-file", p, True)
                       for kind, p in args.prompt or []]
        if not args.prompt and not args.chat and not args.context:
            raise UsageError("nothing to generate from: pass --prompt TEXT, --prompt-file FILE, --chat MESSAGE or "
                             "--context NAME")
        if any(p == "" for p in args.prompt) and not args.context:
            raise UsageError("--prompt is empty; pass the prompt's text (an empty prompt continues a stored --context)")
    if getattr(args, "store", None) is not None:
        from edgekv.runtime.store import store_location

        try:
            store_location(args.store)
        except ValueError as exc:
            raise UsageError(f"--store: {exc}") from exc
    for dest in ("costs", "adapter", "configs_from", "quality_configs", "calibration", "text"):
        value = getattr(args, dest, None)
        if value is not None and not (dest == "text" and value == "builtin") and not Path(value).is_file():
            raise UsageError(f"{_flag(dest)} {value}: no such file{' (or builtin)' if dest == 'text' else ''}")
    for dest in ("configs_from", "quality_configs"):
        if getattr(args, dest, None) is not None:
            from edgekv.evals.harness import recorded_configs

            try:
                recorded_configs(getattr(args, dest))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UsageError(f"{_flag(dest)} {getattr(args, dest)}: not the JSON of an `edgekv eval --json` run "
                                 f"({type(exc).__name__}: {exc}); pass that file") from exc
    for dest in ("json", "png", "csv", "niah"):  # checked now: a long run must not fail at its last line
        value = getattr(args, dest, None)
        if isinstance(value, str):
            out = Path(value)
            if out.is_dir() or not value.strip():
                raise UsageError(f"{_flag(dest)} {value!r}: name a file to write, not a folder")
            if not out.parent.is_dir():
                raise UsageError(f"{_flag(dest)} {value}: no folder {out.parent}; create it or write elsewhere")
    if args.command in ("generate", "eval", "bench", "ttft"):
        _kv_paths(args)
    elif args.command in ("deploy", "context"):
        _kv_paths(args, must_exist=False)


def _whole_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag} {text!r}: give whole numbers >= 1, comma-separated, e.g. 4096,16384")
    return values


def _real_list(flag: str, text: str, least: float, example: str, least_ok: bool = False) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and (v > least or least_ok and v == least) for v in values):
        raise UsageError(f"{flag} {text!r}: give {example}")
    return values


def _names(flag: str, text: str, known, also: str = "") -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"{flag} {text!r}: {bad} unknown; pick from {list(known)}{' ' + also if also else ''}")
    return names


def _eval(args) -> int:
    import torch

    from edgekv.evals import harness
    from edgekv.evals.variants import eval_variants
    from edgekv.runtime.checkpoints import resolve_checkpoint

    model = resolve_checkpoint(args.model)
    kv_paths = _kv_paths(args)
    tasks = list(harness.TASKS) if args.tasks == "all" else args.tasks.split(",")
    budgets = [_parse_budget(b) for b in args.budgets.split(",")]
    main = {"G": args.group_size, "score_reduce": args.score_reduce}
    variants = eval_variants(args.policies.split(","), budgets, main, args.rule, _record_dtypes(args.record_dtype),
                             args.ablations, tasks=not args.ppl)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.configs_from and args.rule != "quality":
        raise ValueError("--configs-from replays the quality rule's choices; drop it or use --rule quality")
    if args.ppl:
        return _eval_ppl(args, model, variants, contexts, kv_paths)
    with _scratch_kv(kv_paths) as kv:
        results = harness.evaluate(model, kv, variants, contexts, tasks, args.samples or 20, args.seed,
                                   adapter_path=args.adapter, quiet=args.quiet, configs_from=args.configs_from)
    print(harness.table(results))
    meta = {"model": args.model, "checkpoint": str(model), "seed": args.seed, "samples": args.samples or 20,
            "command": args.command_line}
    if args.niah:
        depths = [i / 10 for i in range(11)]
        variant = next((v for v in variants if v.budget is not None and not v.ablation), variants[0])
        with _scratch_kv(kv_paths) as kv:
            grid = harness.niah_grid(model, kv, variant, contexts, depths, max(1, (args.samples or 20) // 4), args.seed,
                                     adapter_path=args.adapter)
        harness.plot_niah(args.niah, grid, contexts, depths, f"NIAH, {variant.label}")
        meta["niah"] = {"variant": variant.label, "contexts": contexts, "depths": depths, "accuracy": grid.tolist()}
        print(f"NIAH heatmap ({variant.label}) written to {args.niah}")
    if args.recall_sigmas:
        from edgekv.evals.recall import selection_recall
        from edgekv.runtime.model import load_model

        sigmas = [float(x) for x in args.recall_sigmas.split(",")]
        decoder = load_model(model, torch.device("cpu"), torch.float32, max(contexts) + 64)
        fmt = harness.task_format(model)
        calibration = [i.context for i in harness.make_set(tasks, contexts[0], 1, args.seed + 1, fmt)]
        rows = selection_recall(decoder, harness.make_set(tasks, contexts[0], max(1, (args.samples or 20) // 2), args.seed, fmt),
                                sigmas, G=4, M=max(1, contexts[0] // 34 // 4), calibration=calibration)
        meta["selection_recall"] = rows
        for row in rows:
            print(f"sigma {row['sigma']:g} (rank {row['rank']}): top-M recall {row['recall']:.3f}, "
                  f"needle group picked {row['needle_hit']:.3f}")
    if args.json:
        harness.write_json(args.json, results, meta)
    return 0


def _eval_ppl(args, model, variants, contexts, kv_paths: list[str] | None) -> int:
    from edgekv.evals import perplexity

    if args.niah or args.recall_sigmas or args.adapter:
        raise ValueError("--ppl runs perplexity only; drop --niah/--recall-sigmas/--adapter")
    text, source = perplexity.load_text(args.ppl)
    ids, tokens = perplexity.tokenize(model, text)
    with _scratch_kv(kv_paths) as kv:
        results = perplexity.evaluate_ppl(model, kv, variants, contexts, ids, args.samples or 4, args.ppl_tokens,
                                          quiet=args.quiet, configs_from=args.configs_from)
    print(perplexity.table(results))
    if args.json:
        meta = {"model": str(args.model), "checkpoint": str(model), "text": source,
                "tokens": tokens, "windows": args.samples or 4,
                "continuation_tokens": args.ppl_tokens, "command": args.command_line}
        perplexity.write_json(args.json, results, meta)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgekv", description="Long-context LLM inference with the KV cache on disk")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from prompts (text, or JSON lists of token ids)")
    gen.add_argument("--model", required=True, help=MODEL_HELP)
    gen.add_argument("--kv-path", help="folder on the disk that holds the KV cache (default: a temporary one in the system temp dir)")
    gen.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help=KV_PATHS_HELP)
    gen.add_argument("--config", help="runtime config JSON (G, M, sigma, C, max_kv_mem_mib, ...)")
    gen.add_argument("--policy", default="kvswap", help=POLICY_HELP)
    gen.add_argument("--prompt", action="append", type=lambda text: ("text", text), help=PROMPT_HELP + " (repeatable)")
    gen.add_argument("--prompt-file", action="append", dest="prompt", type=lambda path: ("file", path), metavar="FILE",
                     help="a prompt read from a UTF-8 file (- for standard input): " + PROMPT_HELP + " (repeatable, "
                          "in order with --prompt)")
    gen.add_argument("--chat", action="append", help="a user message, sent through the model's chat template (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt (token ids, text, stats) instead of the text")
    gen.add_argument("--context", help="a context saved with `edgekv context save`, put before every prompt (its KV is loaded "
                                       "or recomputed chunk by chunk, whichever is faster)")
    gen.add_argument("--store", help="the context store: a folder (or file:// URL) or an http(s):// URL of a published one (default: "
                                     "KV_PATH/contexts); prompts reuse their longest stored prefix")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching over the deployed config)")
    where = srv.add_mutually_exclusive_group()
    where.add_argument("--platform", help="serve deploy/PLATFORM/config.json (auto: the platform detected here)")
    where.add_argument("--config", help="a deployed config.json (its model and KV folders are the defaults)")
    srv.add_argument("--model", help=MODEL_HELP + " (default: the config's model)")
    srv.add_argument("--kv-path", help="folder on the disk that holds the KV cache (default: the config's, else a "
                                       "temporary one)")
    srv.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help=KV_PATHS_HELP)
    srv.add_argument("--policy", default="kvswap", help=POLICY_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8080)
    keys = srv.add_mutually_exclusive_group()
    keys.add_argument("--api-key-file", metavar="FILE",
                      help="require 'Authorization: Bearer KEY' on every endpoint but /health, KEY being FILE's first "
                           "line (printable ASCII); or set $EDGEKV_API_KEY (default: no key)")
    keys.add_argument("--api-key", metavar="KEY", help="as --api-key-file, with the key on the command line, where "
                                                       "the process list shows it: prefer the file or the variable")
    srv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a batch row; more get 429")
    srv.add_argument("--max-body-mib", type=float, default=4.0, help="largest request body; larger get 413")
    srv.add_argument("--no-context-store", action="store_true",
                     help="do not keep prompts' KV in KV_PATH/contexts (multi-turn chats then prefill every turn whole)")
    srv.add_argument("--chunk-tokens", type=int, default=256, help="context store chunk size for a new store")
    srv.add_argument("--store-max-mib", type=float, default=1024.0, help="context store cap (least recently used "
                                                                          "chunks go first)")
    srv.add_argument("--served-model-name", nargs="+", metavar="NAME",
                     help="the model ids requests may name; the first is the one /v1/models lists (default: the "
                          "model's name, or its folder's)")
    srv.add_argument("--shutdown-grace-s", type=float, default=30.0,
                     help="on SIGTERM/SIGINT, seconds requests in flight get to finish")
    srv.add_argument("--max-connections", type=int, default=128,
                     help="open connections beyond this get 503 (a reverse proxy in front should cap per client)")
    srv.add_argument("--header-timeout-s", type=float, default=10.0,
                     help="a connection whose request headers take longer is closed")
    srv.add_argument("--body-timeout-s", type=float, default=60.0,
                     help="a request whose body takes longer to arrive gets 408")
    srv.add_argument("--allowed-hosts", metavar="NAME,...",
                     help="Host header names answered, '*' for any (default: localhost, 127.0.0.1, ::1 on a loopback "
                          "--host, else any)")
    srv.add_argument("--openapi", action="store_true", help="serve the OpenAPI schema at /openapi.json (behind the key)")
    srv.set_defaults(func=_serve)

    ctx = sub.add_parser("context", help="the context store: save a context's KV once, reuse it across requests")
    ctx_sub = ctx.add_subparsers(dest="action", required=True)
    save = ctx_sub.add_parser("save", help="compute a context's KV and keep it under NAME")
    save.add_argument("name", help="the context's name")
    save.add_argument("file", help="the context's text file (or a JSON list of token ids), - for standard input")
    save.add_argument("--model", required=True, help=MODEL_HELP)
    save.add_argument("--chunk-tokens", type=int, default=512, help="tokens per stored chunk (a multiple of G)")
    save.add_argument("--max-context", type=int, default=32768, help="the longest context to accept")
    save.add_argument("--max-mib", type=float, help="size cap of the store; least recently used chunks are evicted")
    listing = ctx_sub.add_parser("list", help="every saved context, one JSON line each")
    rm = ctx_sub.add_parser("rm", help="forget a saved context (and the chunks no other context uses)")
    rm.add_argument("name", nargs="?", help="the context's name")
    rm.add_argument("--all", action="store_true", help="remove every context")
    for p in (save, listing, rm):
        p.add_argument("--kv-path", help="folder on the KV disk; the store is KV_PATH/contexts")
        p.add_argument("--kv-paths", metavar="DIR1,DIR2,...",
                       help="the KV folders generate uses; the store is DIR1/contexts")
        p.add_argument("--store", help="the store folder itself, or its file:// URL (instead of --kv-path)")
        p.set_defaults(func=_context)

    tt = sub.add_parser("ttft", help="time to first token with a stored context: full prefill, load-only, "
                                     "bidirectional (Cake) and edgekv's load-or-compute plan, per link rate")
    tt.add_argument("--model", default="fixture", help=MODEL_HELP)
    tt.add_argument("--contexts", default="8192")
    tt.add_argument("--link-mib-s", default="50,100,200,400", help="store read rates to emulate (pacing the reads)")
    tt.add_argument("--drop-at", type=float, help="halve the link rate once this fraction of the load-only time has passed")
    tt.add_argument("--kv-path", help="folder on the KV disk for the store (default: the system temp dir)")
    tt.add_argument("--chunk-tokens", type=int, default=512)
    tt.add_argument("--new-tokens", type=int, default=8, help="greedy tokens compared with full prefill's")
    tt.add_argument("--costs", help="compute cost model JSON from `python -m edgekv.install.chunk_profile` "
                                    "(default: profiled and fit here, the report in the JSON)")
    tt.add_argument("--text", default="builtin", help="the context text: builtin (license texts) or a file")
    tt.add_argument("--json", help="write {runs: [...]} here")
    tt.add_argument("--png", help="TTFT vs link rate plot")
    tt.add_argument("--quiet", action="store_true")
    tt.set_defaults(func=_ttft)

    nat = sub.add_parser("build-native", help="compile the C KV reader (io_uring and pthread backends) and arkv's quantized attention kernel")
    nat.set_defaults(func=_build_native)

    dep = sub.add_parser("deploy", help="profile this machine, solve the runtime parameters, run a smoke generation")
    dep.add_argument("--platform", default="auto", help="auto (detect), local, orin, rtx, smartssd, or a profile YAML")
    dep.add_argument("--model", help=MODEL_HELP + " (default: the profile's model)")
    dep.add_argument("--kv-path", help="folder for the KV cache (default: the profile's kv.paths)")
    dep.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help="folders on several disks for the KV cache, each "
                                                                 "profiled (default: the profile's kv.paths)")
    dep.add_argument("--reprofile", action="store_true", help="measure again even when a cached profile matches")
    dep.add_argument("--profile-only", action="store_true", help="profile and write the report; no solve, no smoke run")
    dep.add_argument("--disk-seconds", type=float,
                     help="time for the disk profile of each KV path (default: the profile's)")
    dep.add_argument("--calibration", metavar="TEXT_FILE",
                     help="text for the lookup tables (reuse rate, adapters); default: the retrieval-task corpus")
    dep.set_defaults(func=_deploy)

    ev = sub.add_parser("eval", help="RULER-style retrieval accuracy per policy and KV budget")
    ev.add_argument("--model", default="fixture", help=MODEL_HELP)
    ev.add_argument("--policies", default="full,kvswap,token")
    ev.add_argument("--budgets", default="1/13,1/34", help="fractions of the full KV cache")
    ev.add_argument("--contexts", default="4096")
    ev.add_argument("--tasks", default="all")
    ev.add_argument("--samples", type=int, help="instances per task and context (default 20); with --ppl, windows per context (default 4)")
    ev.add_argument("--ppl", metavar="TEXT_FILE|builtin",
                    help="perplexity of a text's continuation through the decode path instead of retrieval tasks")
    ev.add_argument("--ppl-tokens", type=int, default=256, help="continuation tokens per window, teacher-forced (with --ppl)")
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--rule", default="quality", choices=["quality", "mg_const"],
                    help="how a budget becomes kvswap's configuration: the lowest measured loss that fits it (quality; "
                         "measured once per model, context and budget on calibration text, then cached), or KVSwap's "
                         "M*G = 400 with the smallest sigma that fits (mg_const)")
    ev.add_argument("--configs-from", metavar="EVAL_JSON",
                    help="with --rule quality: kvswap runs the configurations an earlier eval chose (its --json, tasks "
                         "or --ppl) at the same contexts and budgets, instead of measuring the choice again")
    ev.add_argument("--ablations", action="store_true",
                    help="also, at the last budget: the loss taken apart (oracle top-k, sigma=1, softmax votes, no sinks/"
                         "window, M*G = 400); with tasks also no rolling buffer, reuse forced off/on, other G")
    ev.add_argument("--group-size", type=int, default=4, help="G of the kvswap rows (token is always G=1)")
    ev.add_argument("--score-reduce", default="sum", choices=["sum", "softmax"],
                    help="predictor: logits summed over heads (KVSwap), or each head's softmax summed")
    ev.add_argument("--adapter", help="low-rank adapter safetensors (default: one per sigma, calibrated on task prompts of another seed)")
    ev.add_argument("--kv-path", default=None, help="folder for the KV files (default: the system temp dir)")
    ev.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help=KV_PATHS_HELP)
    ev.add_argument("--niah", metavar="PNG", help="also a needle-in-a-haystack heatmap (contexts x depths)")
    ev.add_argument("--recall-sigmas", metavar="LIST", help="also the predictor's selection recall per sigma, e.g. 2,4,8,16")
    ev.add_argument("--record-dtype", default="auto", metavar="LIST",
                    help="disk record formats (fp16, int8, int4): each kvswap, token and flexgen row is run again with "
                         "them (same configuration, other records), labelled e.g. kvswap@1/13,int8")
    ev.add_argument("--json")
    ev.set_defaults(func=_eval)

    be = sub.add_parser("bench", help="decode throughput of every policy side by side (same model, prompts, budget)")
    be.add_argument("--quick", action="store_true", help="fixture, 4K context, batch 2, 4 steps, budget 1/13 (< 1 min)")
    be.add_argument("--model", default="fixture", help=MODEL_HELP)
    be.add_argument("--batches", default="1,2,4")
    be.add_argument("--contexts", default="4096,16384")
    be.add_argument("--budgets", default="1/13,1/34", help="fractions of the full KV cache of the batch")
    be.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    be.add_argument("--warmup", type=int, default=4, help="decode steps excluded from timing")
    be.add_argument("--quality-configs", metavar="EVAL_JSON",
                    help="also time kvswap-quality rows: the configurations an `edgekv eval --json` run chose by measured "
                         "quality, per context and budget, beside the solver's kvswap rows (M*G = 400)")
    be.add_argument("--policies", default="full,flexgen,token,kvswap-noreuse,kvswap,kvswap-noverify,kvswap-quality,llama.cpp",
                    help="rows; llama.cpp runs when the model is a GGUF file and llama-cpp-python is installed")
    be.add_argument("--quiet", action="store_true", help="no progress bars")
    be.add_argument("--disk-seconds", type=float, default=10, help="time for the disk profile the solver and ratios use")
    be.add_argument("--kv-path", default=None, help="folder on the disk to measure (default: the system temp dir)")
    be.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help=KV_PATHS_HELP)
    be.add_argument("--path-limit-mib-s", type=float, metavar="MIB_S",
                    help="pace each KV path's reads to this rate (several emulated disks on one)")
    be.add_argument("--prompts", choices=("random", "tasks"), default="random",
                    help="random tokens, or the eval's retrieval tasks (text with structure: what clustering and reuse "
                         "feed on)")
    be.add_argument("--record-dtype", default="auto", metavar="LIST",
                    help="disk record formats (fp16, int8, int4): each kvswap, token and flexgen row is run again with "
                         "them (same configuration, other records), labelled e.g. kvswap,int8")
    be.add_argument("--json")
    be.add_argument("--png", help="throughput vs batch and kvswap step time vs context")
    be.set_defaults(func=_bench)

    en = sub.add_parser("energy", help="energy of a command: J, average and peak W, per phase when it runs edgekv")
    en.add_argument("--meter", default="auto", choices=["auto", "rapl", "ina3221", "jtop", "nvml", "xrt"])
    en.add_argument("--platform", help="meter order for auto (default: every meter)")
    en.add_argument("--rate-hz", type=float, default=10.0)
    en.add_argument("--json")
    en.add_argument("--csv", help="the power trace")
    en.add_argument("--png", help="power over time with prefill/decode shaded")
    en.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command [args]")
    en.set_defaults(func=_energy)

    fp = sub.add_parser("fpga", help="the in-storage scoring kernel")
    fp_sub = fp.add_subparsers(dest="fpga_command", required=True)
    st = fp_sub.add_parser("selftest", help="random cases against the numpy reference")
    st.add_argument("--backend", default="csim", choices=["csim", "xrt"])
    st.add_argument("--cases", type=int, default=50)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--json")
    st.set_defaults(func=_fpga)

    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, parsed and checked: argparse exits with status 2 naming a flag it cannot parse, and a value
    that cannot work raises UsageError naming its flag.  No model is loaded here."""
    args = _parsed(argv)
    _check_args(args)
    return args


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()  # built once: parsing does not change it, and building takes tens of ms


def _parsed(argv) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    args.command_line = " ".join(["edgekv", *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parsed(argv)
    try:
        _check_args(args)
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"edgekv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # e.g. numpy's "Unable to allocate 7.28 TiB" for a context nobody can hold
        print(f"edgekv {args.command}: error: out of memory ({exc}); ask for less: "
              f"{MEMORY_FLAGS.get(args.command, 'smaller sizes')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
