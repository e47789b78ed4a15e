"""`make deploy`: profile -> lookup tables -> solve -> config.json + report -> smoke generation.

This is the one place that wires the three packages together: the platform is detected
(``edgekv.platforms``), its profile loaded and the machine measured (``edgekv.install``),
and the runtime (``edgekv.runtime``) launched with the solved config.  Every measurement is
cached with a fingerprint of what it measured (disk, model, device, platform, settings) and
reused only when the fingerprint matches; ``reprofile`` measures again regardless.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import platform as host
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgekv.install import compute, disk, dtypes, quality, report, solver, tables, weights
from edgekv.install.iomodel import gap_bytes, io_model
from edgekv.install.profile import Profile, check_kv_paths, load_profile
from edgekv.platforms.detect import detect_platform, jetson_module
from edgekv.platforms.devices import platform_for
from edgekv.runtime import Engine, RecordLayout
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.checkpoints import cache_root as default_cache_root
from edgekv.runtime.checkpoints import checkpoint_fingerprint, gguf_sha256, load_tokenizer, resolve_checkpoint
from edgekv.runtime.devices import DTYPES
from edgekv.runtime.errors import ModelError
from edgekv.runtime.model import ModelDims, load_model, read_model_config
from edgekv.runtime.store.files import write_atomic, write_json_atomic
from edgekv.runtime.weights import INT4_GRID_ERROR, check_weight_format

VERSION = "0.1.0"


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=True, ncols=80)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host.processor() or host.machine()


def _cached(path: Path, fingerprint: dict, reprofile: bool, what: str, log, renamed=None) -> dict | None:
    """The cached payload when its fingerprint matches; says why it is not reused otherwise.  ``renamed(data,
    where)``: the file's fields under their current names (a cache written before a rename still matches)."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if renamed is not None:
        data = renamed(data, str(path))
    if reprofile:
        log(f"{what}: REPROFILE set, measuring again")
        return None
    if data.get("fingerprint") != fingerprint:
        changed = sorted(k for k in set(fingerprint) | set(data.get("fingerprint", {}))
                         if fingerprint.get(k) != data.get("fingerprint", {}).get(k))
        log(f"{what}: cached profile is for another {', '.join(changed)}; measuring again")
        return None
    log(f"{what}: reusing {path} (same {', '.join(sorted(fingerprint))})")
    return data


def _save(path: Path, fingerprint: dict, payload: dict) -> None:
    write_json_atomic(path, {"fingerprint": fingerprint, **payload})


def calibration_prompts(model_dir: Path, context: int, n: int, seed: int = 1234, text_file: str | None = None) -> list[list[int]]:
    """``n`` prompts of ``context`` tokens: the user's text (cut into windows) when given, else retrieval-task
    prompts in the model's own tokens (the shipped fixture corpus, or words for a tokenizer)."""
    from edgekv.evals.scoring import task_format
    from edgekv.evals.tasks import TASKS, make_instance
    if text_file:
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise ValueError(f"--calibration needs a tokenizer but {model_dir} has none; drop the option to use the fixture corpus")
        ids = tokenizer(Path(text_file).read_text())["input_ids"]
        if len(ids) < context:
            raise ValueError(f"calibration text {text_file} has {len(ids)} tokens; at least {context} are needed")
        step = max(1, (len(ids) - context) // max(1, n - 1))
        return [ids[i * step : i * step + context] for i in range(n)]
    fmt = task_format(model_dir)
    rng = np.random.default_rng(seed)
    return [make_instance(TASKS[i % len(TASKS)], context, rng, fmt=fmt).context for i in range(n)]


def adapter_source(model_dir: Path, context: int, n: int, text_file: str | None) -> str:
    """What the adapters and the reuse table are fitted on (``adapter_prompts``), named without reading it: the
    lookup tables' and the quality table's cache key."""
    if text_file:
        return _file_digest(text_file)
    if load_tokenizer(model_dir) is None:
        return f"task corpus {context} x {n}"
    return f"calibration: CPython's pydoc_data.topics, last {n} x {context} tokens"


def adapter_prompts(model_dir: Path, context: int, n: int, text_file: str | None) -> list[list[int]]:
    """The prompts the adapters and the reuse table are fitted on: the user's text, else for a model with a
    tokenizer the last ``n`` windows of CPython's documentation (the quality table scores its first ones, so the
    two never share a token), else the fixture's task corpus.  Natural text, not retrieval-task word lists: adapters
    fitted on those cost SmolLM2 1.7-3x full's perplexity at 8K under every configuration of a 1/13 budget."""
    if text_file or load_tokenizer(model_dir) is None:
        return calibration_prompts(model_dir, context, n, text_file=text_file)
    from edgekv.evals.scoring import load_text, tokenize

    text, source = load_text("calibration")
    ids, _ = tokenize(model_dir, text)
    if len(ids) < 2 * n * context:
        raise ValueError(f"{source} has {len(ids)} tokens of this model, fewer than the {2 * n * context} the adapters "
                         "and the quality table need apart; pass CALIBRATION=<a longer text file>")
    return [ids[len(ids) - (i + 1) * context: len(ids) - i * context] for i in range(n)]


def _file_digest(path: str) -> str:
    return f"{path} sha256 {hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]}"


def grid(profile: Profile) -> tuple[list[int], list[int]]:
    """The (batch, context) pairs solved: every batch up to max_batch, contexts every context_step."""
    batches = list(range(1, profile.max_batch + 1))
    start = min(profile.context_min, profile.max_context)
    contexts = sorted(set(range(start, profile.max_context + 1, profile.context_step)) | {profile.max_context})
    return batches, contexts


@dataclass
class Deployment:
    """What every phase of one deploy shares: the profile, the model, where things go, and the log."""

    prof: Profile
    detected: str
    model_dir: Path
    kv_paths: tuple[Path, ...]  # the KV folders, in order: the solver plans with all of them, the smoke run uses all
    out: Path
    device: torch.device
    kv_dtype: torch.dtype  # what the deployment computes in: on the CPU, chosen by ``choose_dtype``
    reprofile: bool
    log: object
    weights: str = "native"  # the linear layers' format chosen for the compute phases, the config and the smoke run
    _model: object = None
    _model_key: tuple | None = None
    _fp: str | None = None
    adapter_source: str | None = None  # what the lookup tables' adapters were fitted on (the quality table's key)

    @property
    def table_dtype(self) -> torch.dtype:
        return table_dtype(self.prof, self.device)

    @property
    def kv_path(self) -> Path:
        """Scratch KV for measuring the model (tables, quality; hardware-independent): the first path."""
        return self.kv_paths[0]

    @property
    def dims(self) -> ModelDims:
        return ModelDims.from_config(read_model_config(self.model_dir))

    @property
    def model_fp(self) -> str:
        if self._fp is None:
            self._fp = checkpoint_fingerprint(self.model_dir)
        return self._fp

    @property
    def accelerator(self) -> dict:
        """The GPU, its driver and CUDA, a Jetson's L4T and power mode: part of every compute cache key."""
        return platform_for(self.prof).cache_facts() if self.device.type == "cuda" else {}

    @property
    def sigmas(self) -> list[float]:
        return [s for s in solver.SIGMAS if s <= self.prof.sigma_max]

    def model(self, weights: str = "native", dtype: torch.dtype | None = None):
        """The model in ``weights`` and ``dtype`` (default: the deployed one), loaded once and only by a phase that
        needs it (cached phases do not): the KV tables on the model's own weights in ``table_dtype``, the compute
        phases on the deployed format and dtype."""
        key = (weights, dtype or self.kv_dtype)
        if self._model is None or self._model_key != key:
            self._model = None  # one copy in memory at a time
            self._model = load_model(self.model_dir, self.device, key[1], self.prof.max_context + 64, weights)
            self._model_key = key
        return self._model

    def release_model(self) -> None:
        """Drop the weights before the smoke run loads its own: one copy in memory at a time."""
        self._model = None


def prepare(platform, model, kv_paths, out_root, reprofile, log, device: str | None = None) -> Deployment:
    """Detect, load the profile, check the device, the model, and create the KV folders (before anything is
    measured or written).

    ``kv_paths``: a folder or a list of them instead of the profile's ``kv.paths``; ``device``: instead of the
    profile's (a GPU profile measured on the CPU only when asked for: never silently under the GPU's name)."""
    detected = detect_platform()
    prof = load_profile(platform if platform not in (None, "", "auto") else detected)
    log(f"platform {prof.platform} ({prof.description}); detected on this machine: {detected}; profile {prof.source}")
    device = compute_device(prof, device)
    module = jetson_module()
    if module:
        log(f"Jetson module: {module}")
    model_dir = resolve_checkpoint(model or prof.model)
    given = check_kv_paths(kv_paths, "kv_paths") if kv_paths else prof.kv_paths
    for folder in given:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            named = "given to deploy" if kv_paths else f"named by the profile {prof.source}"
            raise OSError(f"cannot create the KV folder {folder} ({named}): {exc.strerror}; pass KV_PATH=<folder> or "
                          "KV_PATHS=<folder,folder,...> on the disks to use") from exc
    log(f"KV paths: {', '.join(given)}")
    out = Path(out_root) / prof.platform
    out.mkdir(parents=True, exist_ok=True)
    if device.type != prof.device:
        log(f"profile {prof.platform} computes on {prof.device}; deploying on {device.type}, as asked (--device)")
    return Deployment(prof, detected, model_dir, tuple(Path(p) for p in given), out, device,
                      table_dtype(prof, device), reprofile, log)  # on the CPU until choose_dtype measures the profile's


def table_dtype(prof: Profile, device: torch.device) -> torch.dtype:
    """What the KV tables are measured in: the profile's dtype on a GPU, float32 on the CPU (as the shipped tables
    are), whatever ``choose_dtype`` deploys there."""
    return getattr(torch, prof.dtype) if device.type == "cuda" else torch.float32


def measure_disk(d: Deployment, seconds: float) -> list[disk.DiskProfile]:
    """One profile per KV path, each measured alone for ``seconds``; paths sharing a device are said in the log."""
    fp = {"paths": [{**disk.disk_fingerprint(p), "kv_path": str(p.resolve())} for p in d.kv_paths], "seconds": seconds,
          "file_mib": d.prof.disk_file_mib, "platform": d.prof.platform}
    cached = _cached(d.out / "disk.json", fp, d.reprofile, "disk", d.log, disk.renamed_fields)
    if cached:
        profiles = [disk.DiskProfile.from_json(p) for p in cached["profiles"]]
    else:
        if len(d.kv_paths) > 1:
            d.log(f"disk: profiling {len(d.kv_paths)} KV paths one after the other, {seconds:g} s each")
        with _progress(len(disk.BLOCK_SIZES) * len(disk.QUEUE_DEPTHS) * len(d.kv_paths), "disk profile") as bar:
            profiles = [disk.profile_disk(p, seconds, d.prof.disk_file_mib, progress=bar.update) for p in d.kv_paths]
        _save(d.out / "disk.json", fp, {"profiles": [p.to_json() for p in profiles]})
    for dev, paths in disk.shared_devices(profiles).items():
        d.log(f"WARNING: KV paths {', '.join(paths)} are on one device ({dev}): no extra bandwidth; the plan counts "
              "that device once")
    disk.plot_disk(profiles, d.out / "disk.png")
    return profiles


def disk_measurements(profiles: list[disk.DiskProfile]) -> dict:
    """The disk part of ``measurements``: the rates the solver planned with (top level; one path's own figures when
    there is one), every path's profile, and the devices that hold several paths."""
    plan = disk.combine_profiles(profiles)
    return {"reference": plan.reference, "reader": plan.reader, "o_direct": plan.o_direct,
            "fingerprint": plan.fingerprint, "points": [p.__dict__ for p in plan.points],
            "paths": [p.to_json() for p in profiles], "shared_devices": disk.shared_devices(profiles)}


def rates_at(profiles: list[disk.DiskProfile], block_bytes: int, queue_depth: int) -> dict:
    """Each path's reader rate and the planned one at the chosen record size, for the report."""
    return {"block_bytes": block_bytes, "queue_depth": queue_depth,
            "paths_mib_s": [round(p.read_mib_s(block_bytes, queue_depth), 1) for p in profiles],
            "plan_mib_s": round(disk.planned_mib_s(profiles, block_bytes, queue_depth), 1)}


def lookup_tables(d: Deployment, cache_root: Path, calibration: str | None) -> tuple[dict, dict]:
    """(reuse table, {sigma: adapter path}): hardware-independent, cached per model."""
    tables_dir = cache_root / "tables" / d.model_fp
    tables_dir.mkdir(parents=True, exist_ok=True)
    context = min(4096, d.prof.max_context - 64)
    d.adapter_source = source = adapter_source(d.model_dir, context, 2, calibration)
    fp = {"model": d.model_fp, "sigmas": d.sigmas, "g_max": d.prof.g_max, "mg_const": d.prof.mg_const,
          "calibration": source, "edgekv": VERSION}
    if _cached(tables_dir / "tables.json", fp, d.reprofile, "lookup tables", d.log):
        reuse, adapters, _ = tables.load_tables(tables_dir / "tables.json")
        return reuse, adapters
    groups = solver.group_sizes(d.prof.g_max)
    d.log(f"lookup tables: reuse rate vs C for G in {groups}, adapters for sigma in {d.sigmas}")
    start = time.perf_counter()
    prompts = adapter_prompts(d.model_dir, context, 2, calibration)  # read only when the tables are measured
    model = d.model(dtype=d.table_dtype)
    adapters = tables.build_adapters(model, prompts, d.sigmas, tables_dir)
    middle = min(adapters, key=lambda s: abs(s - 8))  # the reuse pattern barely depends on sigma
    reuse = tables.reuse_table(model, d.kv_path, prompts, groups, d.prof.mg_const, adapters[middle])
    tables.save_tables(tables_dir / "tables.json", fp, reuse, adapters, {"seconds": round(time.perf_counter() - start, 1)})
    return reuse, adapters


def quality_table(d: Deployment, cache_root: Path, adapters: dict, calibration: str | None,
                  limits: solver.Limits) -> list[quality.QualityPoint]:
    """Measured loss per configuration at the profile's quality contexts (cached per model, grid and budget), in
    ``table_dtype`` as the shipped tables are: each point's loss is against ``full`` in the same dtype; empty when
    the profile sets no quality target (the solver then keeps KVSwap's M*G = mg_const)."""
    prof = d.prof
    if prof.quality_target is None:
        return []
    path = cache_root / "tables" / d.model_fp / "quality.json"
    groups = [g for g in quality.GROUP_SIZES if g <= prof.g_max] or [1]
    fp = {"model": d.model_fp, "contexts": list(prof.quality_contexts), "sigmas": d.sigmas, "groups": groups,
          "target": prof.quality_target, "budget_mib_per_sequence": prof.batch_budget_mib,
          "calibration": _file_digest(calibration) if calibration else "default", "adapters": d.adapter_source,
          "edgekv": VERSION, "corrections": list(prof.corrections)}
    cached = _cached(path, fp, d.reprofile, "quality table", d.log)
    if cached:
        return quality.load(path)
    found = None if d.reprofile else quality.shipped(gguf_sha256(d.model_dir), shipped_fingerprint(fp))
    known = []
    if found:
        known, source, meta, measured = found
        known = [p for p in known if p.correction in prof.corrections]
        d.log(f"quality table: the one measured for this model file with these settings ({source}: "
              f"{meta.get('machine', 'another machine')}, {meta.get('seconds', '?')} s); REPROFILE=1 measures it here")
        twins = quality.lacking_twins(known, prof.quality_target, prof.quality_top1_min)
        if set(prof.corrections) <= set(measured) and not twins:
            quality.save(path, fp, known, {**meta, "shipped": str(source)})
            return known
        d.log(f"quality table: it measured the selections {list(measured)} and {len(twins)} int4 twins fewer than this "
              f"edgekv measures; measuring the selections of {list(prof.corrections)} and the twins it lacks")
    budget = prof.batch_budget_mib * 2**20
    dims = d.dims
    points, start = [], time.perf_counter()
    for context in prof.quality_contexts:
        grid = [p for p in quality.candidates(context, groups, d.sigmas, prof.corrections) if solver.smallest_bytes(
            dims, d.table_dtype, limits, context, p) <= budget]
        what = f"quality table at {context}: up to {len(grid)} configurations"
        with calibration_scorer(d, adapters, calibration, context, len(grid), f"quality table {context}", what,
                                d.table_dtype) as scorer:
            points += quality.measure(scorer, grid, context, prof.quality_target, known, prof.quality_top1_min)
    quality.save(path, fp, points, {"seconds": round(time.perf_counter() - start, 1)})
    return points


@contextlib.contextmanager
def calibration_scorer(d: Deployment, adapters: dict, calibration: str | None, context: int, runs: int, desc: str,
                       what: str, dtype: torch.dtype | None = None):
    """The install step's scorer (evals ConfigScorer) on the calibration windows of ``context`` tokens, the model in
    ``dtype`` (default: the deployed one) with the calibrated adapters, under a progress bar ``desc`` of ``runs``
    configurations after full's; ``what`` is logged first with the windows' source."""
    from edgekv.evals.progress import Progress
    from edgekv.evals.scoring import Adapters, ConfigScorer, calibration_windows

    windows, source = calibration_windows(d.model_dir, context, quality.WINDOWS, calibration)
    d.log(f"{what} on {source}")
    with Progress(runs + 1, desc) as progress:
        model = d.model(dtype=dtype)
        yield ConfigScorer(model, d.kv_path, Adapters.from_files(model, adapters), windows,
                           quality.continuation(context), progress, max_batch=quality.WINDOWS, label=str(context))


def runtime_fields(sol: solver.Solution, prof: Profile, adapters: dict) -> dict:
    """A solution's runtime config fields as deployed: its selection, records and memory, the profile's correction
    settings, the calibrated adapter of its sigma."""
    corrected = sol.correction == "corrected"
    return {"G": sol.G, "M": sol.M, "C": sol.C, "sigma": sol.sigma, "reuse": sol.reuse,
            "sink_tokens": sol.sink_tokens, "window_tokens": sol.window_tokens,
            "adapter_path": adapters[float(sol.sigma)], "io_align_bytes": sol.io_align_bytes,
            "klr_dtype": sol.klr_dtype, "kv_record_dtype": sol.kv_record_dtype, "correction": sol.correction,
            "correction_reads": sol.correction_reads, "score_reduce": sol.score_reduce,
            "correction_recall": prof.correction_recall if corrected else 1.0,
            "guess_from_before": prof.guess_from_before and corrected, "prompt_adapter": sol.prompt_adapter}


def adapter_trial(d: Deployment, cache_root: Path, adapters: dict, calibration: str | None,
                  runs: dict[str, solver.Solution]) -> dict:
    """Each solution of ``runs`` ({name: solution at one context}) run as deployed on the quality table's windows:
    its ppl ratio and top-1 agreement to full and the KV bytes it read a token (cached per model, calibration and
    configurations).  Decides between the calibrated adapter and each sequence's own projection: the solver cannot
    weigh the latter, which reads fewer bytes through the same slots (its picks move less from step to step)."""
    context = next(iter(runs.values())).context
    configs = {name: {**runtime_fields(sol, d.prof, adapters), "max_context": context + 64}
               for name, sol in runs.items()}
    path = cache_root / "tables" / d.model_fp / "adapter_trial.json"
    fp = {"model": d.model_fp, "context": context, "calibration": d.adapter_source, "edgekv": VERSION,
          "configs": {name: {k: v for k, v in c.items() if k != "adapter_path"} for name, c in configs.items()}}
    cached = _cached(path, fp, d.reprofile, "adapter trial", d.log)
    if cached:
        return cached["runs"]
    out = {}
    with calibration_scorer(d, adapters, calibration, context, len(configs), f"adapter trial {context}",
                            f"adapter trial at {context}: {', '.join(configs)}", d.table_dtype) as scorer:
        for name, config in configs.items():
            row = scorer("kvswap", config)
            out[name] = {"C": config["C"], "ppl_ratio": round(row["ppl_ratio"], 4),
                         "top1_agreement": round(row["top1_agreement"], 4), "kl": round(row["kl"], 4),
                         "kv_read_bytes_per_token": row["kv_read_bytes_per_token"]}
    _save(path, fp, {"runs": out})
    return out


def choose_adapter(d: Deployment, cache_root: Path, adapters: dict, calibration: str | None, solve, limits,
                   solutions: list) -> tuple[list, dict]:
    """``solutions`` (``solve(limits)``, the calibrated adapter), or ``solve`` with each sequence's own projection
    (its memory counted: fewer reuse slots) where the adapter trial measures that at the deployed batch and context
    within the quality target and reading no more bytes a token; the trial's figures and the choice."""
    own_solutions = solve(replace(limits, prompt_adapter=True))
    top, own = deployed(solutions, d.prof), deployed(own_solutions, d.prof)
    trial = adapter_trial(d, cache_root, adapters, calibration, {"calibrated": top, "prompt": own})
    mine, theirs = trial["prompt"], trial["calibrated"]
    chosen = quality.meets_target(mine["ppl_ratio"], mine["top1_agreement"], limits.quality_target,
                                  limits.quality_top1_min) and \
        mine["kv_read_bytes_per_token"] <= theirs["kv_read_bytes_per_token"]
    words = lambda r: (f"ppl ratio {r['ppl_ratio']:.4g}, top-1 {r['top1_agreement']:.4g}, "  # noqa: E731
                       f"{r['kv_read_bytes_per_token'] / 2**20:.2f} MiB read a token")
    d.log(f"adapter: each sequence's own projection (C={own.C}: {words(mine)}) against the calibrated one (C={top.C}: "
          f"{words(theirs)}): {'the own projection' if chosen else 'the calibrated adapter'} deployed")
    if not chosen:
        return solutions, {"chosen": "calibrated", **trial}
    measured = replace(own, ppl_ratio=mine["ppl_ratio"], top1_agreement=mine["top1_agreement"], quality_met=True)
    return [measured if s is own else s for s in own_solutions], {"chosen": "prompt", **trial}


def deployed(solutions: list, prof: Profile) -> solver.Solution:
    """The solution the config deploys: the profile's largest batch and context."""
    return next(x for x in solutions if x.batch == prof.max_batch and x.context == prof.max_context)


def solver_limits(prof: Profile, record_losses: dict | None = None, block_bytes: int | None = None) -> solver.Limits:
    """The solver's limits a profile sets (with the record table's losses once measured, and the disk's smallest
    block once profiled: ``disk_block_bytes``)."""
    return solver.Limits(prof.sigma_max, prof.g_max, prof.mg_const, prof.exposed_io_share, prof.reuse_step,
                         block_bytes=block_bytes,
                         quality_target=prof.quality_target, quality_top1_min=prof.quality_top1_min,
                         record_losses=record_losses or {},
                         record_ppl_max=prof.record_ppl_max)


def disk_block_bytes(profiles: list[disk.DiskProfile]) -> int | None:
    """The smallest block every KV path's profile read (through O_DIRECT where its reader used it): a record shorter
    than a page may pad to a power of two from it (runtime.disk_store.record_align_bytes).  None without a profile."""
    sizes = [min(point.block_bytes for point in profile.points) for profile in profiles if profile.points]
    return max(sizes) if sizes and len(sizes) == len(profiles) else None


def shipped_fingerprint(fp: dict) -> dict:
    """A quality table's cache key without the machine-local model key (the file's content names the model)."""
    return {k: v for k, v in fp.items() if k != "model"}


def record_table(d: Deployment, cache_root: Path, adapters: dict, calibration: str | None) -> dict:
    """{G: {kv_record_dtype: ppl ratio to exact records}} for the profile's ``solver.record_dtypes`` (cached per
    model like the reuse table); empty when it lists none: the solver then keeps exact records."""
    prof = d.prof
    if not prof.record_dtypes:
        return {}
    path = cache_root / "tables" / d.model_fp / "records.json"
    context = min(4096, prof.max_context - 64)
    # with a quality table the solver only weighs its points' group sizes; without, every G it may choose
    sizes = quality.GROUP_SIZES if prof.quality_target is not None else quality.RECORD_GROUP_SIZES
    groups = [g for g in sizes if g <= prof.g_max]
    fp = {"model": d.model_fp, "context": context, "groups": groups, "record_dtypes": list(prof.record_dtypes),
          "dtype": str(d.kv_dtype), "calibration": _file_digest(calibration) if calibration else "default",
          "edgekv": VERSION}
    cached = _cached(path, fp, d.reprofile, "record table", d.log)
    if cached:
        return {int(g): rows for g, rows in cached["records"].items()}
    what = f"record table at {context}: {list(prof.record_dtypes)} records for G in {groups}"
    with calibration_scorer(d, adapters, calibration, context, len(groups) * len(prof.record_dtypes), "record table",
                            what) as scorer:
        table = quality.record_table(scorer, context, groups, prof.record_dtypes)
    _save(path, fp, {"records": {str(g): rows for g, rows in table.items()}})
    return table


def choose_dtype(d: Deployment, calibration: str | None) -> list[dict]:
    """On the CPU, set ``d.kv_dtype`` to the profile's dtype where, in the chosen weight format, it holds perplexity
    within ``dtype_ppl_max`` of float32 and prefills and decodes faster on this machine (install/dtypes.py), else
    float32 (cached per model, weights, machine and candidate); both trials, for the report.  On a GPU the profile's
    dtype stands."""
    if d.device.type == "cuda" or d.prof.dtype == dtypes.BASELINE:
        return []
    try:
        check_weight_format(d.weights, d.device, DTYPES[d.prof.dtype])
    except ModelError as exc:
        d.log(f"dtype: float32 (the profile's {d.prof.dtype} cannot run the weights chosen: {exc})")
        return []
    source = adapter_source(d.model_dir, weights.WINDOW_TOKENS, 2, calibration)
    fp = {"model": d.model_fp, "device": str(d.device), "weights": d.weights, "candidate": d.prof.dtype,
          "ppl_max": d.prof.dtype_ppl_max, "torch": torch.__version__, "cpu": _cpu_model(),
          "threads": torch.get_num_threads(), "context": d.prof.max_context,
          "calibration": source, "timed": "prefill and step", "scored": weights.SCORED, "edgekv": VERSION}
    cached = _cached(d.out / "dtype.json", fp, d.reprofile, "model dtype", d.log)
    if not cached:
        windows = adapter_prompts(d.model_dir, weights.WINDOW_TOKENS, 2, calibration)
        with _progress(2, "model dtype") as bar:
            chosen, trials = dtypes.choose(lambda name: d.model(d.weights, DTYPES[name]), d.prof.dtype,
                                           d.prof.dtype_ppl_max, windows, d.prof.max_context,
                                           progress=lambda: bar.update(1))
        cached = {"chosen": chosen, "trials": [t.to_json() for t in trials]}
        _save(d.out / "dtype.json", fp, cached)
    d.kv_dtype = DTYPES[cached["chosen"]]
    for t in cached["trials"]:
        d.log(f"dtype {t['dtype']}: ppl {t['ppl_ratio']}x float32's, top-1 agreement {t['top1_agreement']}, "
              f"prefill of {d.prof.max_context} tokens {t['prefill_ms']} ms, full's decode step after them "
              f"{t['step_ms']} ms" + (f" ({t['note']})" if t["note"] else ""))
    d.log(f"dtype: {cached['chosen']} (the profile's {d.prof.dtype} where within ppl {d.prof.dtype_ppl_max:g}x of "
          f"float32 with weights {d.weights} and faster here, prefill and step)")
    return cached["trials"]


def choose_weights(d: Deployment, calibration: str | None) -> list[dict]:
    """Set ``d.weights`` to the first of the profile's weight formats within its perplexity limit (cached per
    model, machine and candidates); every trial, for the report."""
    if not d.prof.weights:
        return []
    source = adapter_source(d.model_dir, weights.WINDOW_TOKENS, 2, calibration)
    fp = {"model": d.model_fp, "device": str(d.device), "dtype": str(d.kv_dtype), "torch": torch.__version__,
          "cpu": _cpu_model(), "candidates": list(d.prof.weights), "ppl_max": d.prof.weights_ppl_max,
          "int4_grid_error": INT4_GRID_ERROR, "calibration": source, "scored": weights.SCORED, "edgekv": VERSION}
    cached = _cached(d.out / "weights.json", fp, d.reprofile, "weight format", d.log)
    if not cached:
        windows = adapter_prompts(d.model_dir, weights.WINDOW_TOKENS, 2, calibration)
        with _progress(len(d.prof.weights), "weight formats") as bar:
            chosen, trials = weights.choose(d.model(), d.model, list(d.prof.weights), d.prof.weights_ppl_max, windows,
                                            progress=lambda: bar.update(1))
        cached = {"chosen": chosen, "trials": [t.to_json() for t in trials]}
        _save(d.out / "weights.json", fp, cached)
    d.weights = cached["chosen"]
    for t in cached["trials"]:
        d.log(f"weights {t['weights']}: " + (f"ppl {t['ppl_ratio']}x the model's own, top-1 agreement "
                                            f"{t['top1_agreement']}" if t["ppl_ratio"] is not None else t["note"]))
    d.log(f"weights: {d.weights} (the first of {list(d.prof.weights)} within ppl {d.prof.weights_ppl_max:g}x)")
    return cached["trials"]


def measure_compute(d: Deployment, batches: list[int], contexts: list[int]) -> compute.ComputeProfile:
    fp = {"model": d.model_fp, "device": str(d.device), "dtype": str(d.kv_dtype), "weights": d.weights, **d.accelerator,
          "torch": torch.__version__, "cpu": _cpu_model(), "threads": torch.get_num_threads(), "platform": d.prof.platform,
          "batches": batches, "contexts": contexts, "mg_const": d.prof.mg_const, "edgekv": VERSION}
    cached = _cached(d.out / "compute.json", fp, d.reprofile, "compute", d.log)
    if cached:
        return compute.ComputeProfile.from_json(cached["profile"])
    dims = d.dims
    sampled = sorted({b for b in batches if b & (b - 1) == 0} | {batches[-1]})
    ranks = sorted({LowRankAdapter.rank_for(dims.n_kv_heads, dims.head_dim, s) for s in d.sigmas})
    with _progress(compute.n_compute_samples(sampled, contexts, ranks, d.prof.mg_const), "compute profile") as bar:
        profile = compute.profile_compute(d.model(d.weights), fp, sampled, contexts, ranks, d.prof.mg_const, progress=bar.update)
    _save(d.out / "compute.json", fp, {"profile": profile.to_json()})
    return profile


def measure_chunks(d: Deployment, contexts: list[int]) -> tuple[Path, dict]:
    """The chunk compute profile (load-or-compute prefill with stored contexts): the predictor fit on it is
    written beside the config; the report keeps its and a roofline's held-out errors."""
    from edgekv.install import chunk_profile

    lengths = tuple(n for n in (256, 512) if n < d.prof.max_context) or (d.prof.max_context // 2,)
    fp = {"model": d.model_fp, "device": str(d.device), "dtype": str(d.kv_dtype), "weights": d.weights, **d.accelerator,
          "torch": torch.__version__, "cpu": _cpu_model(), "threads": torch.get_num_threads(), "chunks": lengths, "contexts": contexts,
          "edgekv": VERSION}
    path = d.out / "ttft_costs.json"
    cached = _cached(d.out / "chunks.json", fp, d.reprofile, "chunk compute", d.log)
    if cached and path.is_file():
        return path, cached["errors"]
    steps = chunk_profile.n_chunk_steps(lengths, contexts, 2)
    with _progress(steps, "chunk compute profile") as bar:
        profile = chunk_profile.profile_chunks(d.model(d.weights), chunk_tokens_list=lengths, contexts=tuple(contexts),
                                               sweeps=2, progress=bar.update, fingerprint=fp)
    fitted = chunk_profile.fit_report(profile)
    write_json_atomic(path, fitted)
    _save(d.out / "chunks.json", fp, {"profile": profile.to_json(), "errors": fitted["errors"]})
    return path, fitted["errors"]


def smartssd_scorer(d: Deployment):
    """The card's FPGA when this machine has the SmartSSD, else the kernel's C-simulation on the host CPU, said in the
    log (and, through the scorer's label, in the config and the report): its speed is the host's, not the card's."""
    from edgekv.platforms.smartssd import open_scorer

    if d.detected == "smartssd":
        return open_scorer("xrt")
    d.log(f"WARNING: no SmartSSD on this machine (detected: {d.detected}); in-storage scoring is emulated by the "
          "kernel's C-simulation on the host CPU: f_ssd and beta are host figures, not the card's, and the keys are "
          "read into host memory; deploy on the card for device figures")
    return open_scorer("csim")


def hillinfer_pools(d: Deployment, scorer, budget_bytes: float) -> tuple[float, dict]:
    """beta from the CPU and in-storage scoring throughputs; the rates name the scorer that measured f_ssd."""
    from edgekv.install.scorers import pool_ratio, scoring_throughputs

    dims = d.dims
    rates = scoring_throughputs(scorer, dims.n_kv_heads, dims.head_dim, work=d.kv_path)
    keys_bytes = d.prof.max_context * dims.n_layers * dims.n_kv_heads * dims.head_dim * 2
    beta = pool_ratio(rates["f_cpu_tok_s"], rates["f_ssd_tok_s"], budget_bytes, keys_bytes)
    d.log(f"HillInfer pools: f_cpu {rates['f_cpu_tok_s']:.3g} tok/s, f_ssd ({rates['scorer_backend']}) "
          f"{rates['f_ssd_tok_s']:.3g} tok/s, beta {beta:.3f}")
    return beta, {**rates, "beta": beta}


def run(platform: str | None = None, model: str | None = None, kv_paths: str | Path | list | None = None,
        reprofile: bool = False, profile_only: bool = False, out_root: str | Path = "deploy",
        disk_seconds: float | None = None, smoke: bool = True, cache_dir: str | Path | None = None,
        calibration: str | None = None, log=print, device: str | None = None) -> dict:
    """The whole install step; ``kv_paths`` (a folder or a list) replaces the profile's KV folders; ``device``
    ("cpu") deploys a GPU profile on the CPU, by choice."""
    started = time.perf_counter()
    d = prepare(platform, model, kv_paths, out_root, reprofile, log, device)
    prof, out, dims = d.prof, d.out, d.dims
    batches, contexts = grid(prof)
    disk_profiles = measure_disk(d, disk_seconds or prof.disk_seconds)
    cache_root = Path(cache_dir) if cache_dir else default_cache_root()
    reuse, adapters = lookup_tables(d, cache_root, calibration)
    weight_trials = choose_weights(d, calibration)  # in float32, the tables' dtype
    dtype_trials = choose_dtype(d, calibration)
    compute_profile = measure_compute(d, batches, contexts)
    ttft_costs, ttft_errors = measure_chunks(d, contexts)
    d.release_model()
    measurements = {
        "platform": platform_for(prof).facts(),
        "disk": disk_measurements(disk_profiles),
        "dtype": {"chosen": str(d.kv_dtype).removeprefix("torch."), "trials": dtype_trials,
                  "ppl_max": d.prof.dtype_ppl_max},
        "weights": {"chosen": d.weights, "trials": weight_trials, "ppl_max": d.prof.weights_ppl_max},
        "compute": {"device": str(d.device), "dtype": str(d.kv_dtype), "block_ms": compute_profile.block_ms,
                    "predict_ms": compute_profile.predict_ms, "reuse_ms": compute_profile.reuse_ms},
        "chunk_compute_errors": ttft_errors,
        "reuse_table": {str(g): rows for g, rows in reuse.items()},
        **({"window_layers": window_layers(dims, prof, d.kv_dtype)} if dims.hybrid else {}),
    }
    if profile_only:
        report.write(out, prof, d.model_dir, measurements, None, None, time.perf_counter() - started)
        log(f"profiling report: {out / 'report.txt'}")
        return {"report": str(out / "report.txt")}

    records = record_table(d, cache_root, adapters, calibration)
    measurements["record_table"] = {str(g): rows for g, rows in records.items()}
    limits = solver_limits(prof, records, disk_block_bytes(disk_profiles))
    quality_points = quality_table(d, cache_root, adapters, calibration, limits)
    measurements["quality_table"] = [p.__dict__ for p in quality_points]
    queue_depth = 32
    slot_memory = platform_for(prof).slot_memory
    h2d_gib_s = compute_profile.h2d_gib_s if slot_memory == "device" else None  # mapped slots: no copy to make
    t_io = io_model(disk_profiles, dims, d.kv_dtype, limits.io_align_bytes, queue_depth, h2d_gib_s, limits.block_bytes)
    budget = prof.batch_budget_mib * 2**20
    rate = lambda G, C, picked: tables.reuse_rate(reuse, G, C, picked)  # noqa: E731

    def solve(limits: solver.Limits) -> list[solver.Solution]:
        return [solver.solve_for_quality(b, s, budget, dims, d.kv_dtype, limits, quality.points_at(quality_points, s),
                                         t_io, compute_profile.t_model_ms, rate, log=log) if quality_points else
                solver.solve(b, s, budget, dims, d.kv_dtype, limits, t_io, compute_profile.t_model_ms, rate)
                for b in batches for s in contexts]

    solutions = solve(limits)
    if quality_points and prof.prompt_adapter:
        solutions, measurements["adapter_trial"] = choose_adapter(d, cache_root, adapters, calibration, solve, limits,
                                                                  solutions)
    d.release_model()
    top = deployed(solutions, prof)
    record_bytes = RecordLayout(top.G, dims.n_kv_heads, dims.head_dim, d.kv_dtype, top.io_align_bytes,
                                top.kv_record_dtype).stride_bytes
    measurements["disk"]["at_record"] = rates_at(disk_profiles, record_bytes, queue_depth)
    measurements["disk"]["gap_bytes"] = io_gap_bytes = gap_bytes(disk_profiles, record_bytes, queue_depth)
    config = {
        "platform": prof.platform, "model": str(d.model_dir), "kv_path": str(d.kv_path),
        "device": d.device.type, "dtype": str(d.kv_dtype).removeprefix("torch."),  # what serve, bench, eval run in
        "weights": d.weights,  # the linear layers' format (install/weights.py): what serve and generate load
        "kv_paths": [str(p) for p in d.kv_paths],
        **runtime_fields(top, prof, adapters),
        "exposed_io_share": prof.exposed_io_share, "alpha": prof.exposed_io_share,  # alpha: its old name, still read
        "max_kv_mem_mib": prof.max_kv_mem_mib, "max_batch": prof.max_batch, "max_context": prof.max_context,
        "io_queue_depth": queue_depth, "io_gap_bytes": io_gap_bytes, "slot_memory": slot_memory,
        "ttft_costs_path": str(ttft_costs),
        "solutions": [{**x.to_json(), "adapter_path": adapters[float(x.sigma)]} for x in solutions],
        "measurements": measurements, "edgekv_version": VERSION,
    }
    scorer = None
    if "smartssd" in prof.scorers:  # the smartssd profile runs HillInfer's hierarchical selector
        scorer = smartssd_scorer(d)
        config["beta"], measurements["scoring"] = hillinfer_pools(d, scorer, budget)
        config["scorer_backend"] = scorer.backend_label  # "csim (emulated)" off the card: beta is a host figure
    write_json_atomic(out / "config.json", config)
    write_service_unit(prof.platform, out)
    tuning_s = time.perf_counter() - started
    log(f"config: {out / 'config.json'}  (G={top.G} M={top.M} C={top.C} sigma={top.sigma:g} reuse={top.reuse} "
        f"S={top.sink_tokens} W={top.window_tokens} K_lr {top.klr_dtype} records {top.kv_record_dtype} in "
        f"{top.io_align_bytes} B {top.correction}"
        + (f" correction_recall {config['correction_recall']:g}" if config["correction_recall"] < 1 else "")
        + (" guess_from_before" if config["guess_from_before"] else "")
        + (" prompt_adapter" if top.prompt_adapter else "")
        + (f" ppl ratio {top.ppl_ratio:.4g}" if top.ppl_ratio is not None else "") + f" at batch {top.batch}, context {top.context}; {len(solutions)} solutions; tuning {tuning_s:.0f} s)")

    stats, chat = smoke_run(d.model_dir, d.kv_paths, out / "config.json", prof, d.device, scorer) if smoke else (None, None)
    report.write(out, prof, d.model_dir, measurements, solutions, stats, tuning_s)
    log(f"report: {out / 'report.txt'}")
    if top.ppl_ratio is not None:  # the point's ratio times its record format's (the record table's)
        log(f"quality: the deployed configuration's measured ppl ratio to full is {top.ppl_ratio:.4g}, top-1 agreement "
            f"{top.top1_agreement}, at context {top.context} (target "
            f"{solver.target_words(prof.quality_target, prof.quality_top1_min)}: {'met' if top.quality_met else 'NOT met'})")
    return {"config": str(out / "config.json"), "stats": stats, "chat": chat, "tuning_s": round(tuning_s, 1)}


def window_layers(dims: ModelDims, prof: Profile, kv_dtype: torch.dtype) -> dict:
    """What a hybrid model's sliding-window layers keep (a ring each, in memory) against what treating them as
    global would store, for ``max_batch`` sequences of ``max_context`` tokens."""
    itemsize = torch.empty(0, dtype=kv_dtype).element_size()
    local = [w for w in dims.layer_windows if w]
    per_token = 2 * dims.n_kv_heads * dims.head_dim * itemsize * prof.max_batch
    return {"local_layers": len(local), "layers": dims.n_layers, "window_tokens": sorted(set(local)),
            "ring_mib": round(dims.window_ring_bytes(prof.max_context, itemsize) * prof.max_batch / 2**20, 2),
            "as_global_mib": round(len(local) * prof.max_context * per_token / 2**20, 2),
            "global_layers_full_kv_mib": round(len(dims.global_layers) * prof.max_context * per_token / 2**20, 2)}


def compute_device(prof: Profile, device: str | None) -> torch.device:
    """The profile's compute device, or ``device``; a CUDA profile on a torch without CUDA stops here, naming the
    fix, before anything is measured or written (it would measure the CPU under the GPU profile's name)."""
    from edgekv.runtime.devices import DeviceUnavailable, cuda_fix

    if device is not None:
        return torch.device(device)
    if prof.device == "cuda" and not torch.cuda.is_available():
        why = f"torch {torch.__version__} " + ("is a CPU build" if torch.version.cuda is None else
                                                f"(CUDA {torch.version.cuda}) sees no GPU: check the driver (nvidia-smi)")
        raise DeviceUnavailable(f"profile {prof.platform} ({prof.source}) computes on CUDA, but {why}. Fix: {cuda_fix()}. "
                           "To deploy on the CPU instead, say so: --device cpu (the config then records cpu)")
    return torch.device(prof.device)


def write_service_unit(platform: str, out: Path) -> Path:
    """``out/edgekv.service``: systemd serves this deploy (``edgekv serve``) from the repository it was made in."""
    from edgekv.serve.server import service_unit

    unit = service_unit(platform, (out / "config.json").resolve(), Path.cwd().resolve(), sys.executable)
    path = out / "edgekv.service"
    write_atomic(path, unit.encode())
    return path


CHAT_QUESTION = "What is the capital of France? Answer in one sentence."


def smoke_run(model_dir: Path, kv_paths: tuple[Path, ...], config: Path, prof: Profile, device: torch.device,
              scorer=None) -> tuple[dict, dict | None]:
    """One generation with the solved config on every KV path: 2 prompts, 32 new tokens, stats as the runtime
    reports them; then, for a chat model, one question through the same configuration: (stats, {question, answer,
    tokens}) (None for a model without a chat template)."""
    context = min(4096, prof.max_context - 64)
    prompts = calibration_prompts(model_dir, context, min(2, prof.max_batch), seed=99)
    policy = "hillinfer" if scorer is not None else "kvswap"
    with Engine.from_pretrained(model_dir, kv_path=list(kv_paths), config=config, policy=policy, device=device,
                                scorer=scorer) as engine:
        results = engine.generate(prompts, max_new_tokens=32, stop_token_ids=[])
        chat = None
        if engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None):
            answer = engine.generate([[{"role": "user", "content": CHAT_QUESTION}]], max_new_tokens=48)[0]
            chat = {"question": CHAT_QUESTION, "answer": answer.text.strip(), "tokens": len(answer.token_ids)}
    s = [r.stats for r in results]
    stats = {
        "policy": policy, "batch": len(prompts), "context": context, "new_tokens": 32,
        "decode_tok_s": round(sum(x["generated_tokens"] - 1 for x in s) / max(x["decode_s"] for x in s), 2),
        "kv_resident_mib": round(s[0]["kv_resident_bytes"] / 2**20, 2),
        "reuse_rate": round(float(np.mean([x["reuse_rate"] for x in s])), 3),
        "io_stall_share": round(float(np.mean([x["io_stall_share"] for x in s])), 3),
        "prefill_s": round(sum(x["prefill_s"] for x in s), 2),
        "kv_read_mib": round(sum(x["kv_bytes_read"] for x in s) / 2**20, 1),
        "reader": s[0]["reader"], "o_direct": s[0]["o_direct"], **{k: s[0]["config"][k] for k in ("G", "M", "C", "sigma", "reuse")},
        **({"scorer_backend": scorer.backend_label} if scorer is not None else {}),
    }
    return stats, chat

