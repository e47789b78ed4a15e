"""The quality lookup table (hardware-independent, cached per model like the reuse table).

Each point is one kvswap configuration (G, M*G, sigma, sinks S, window W, K_lr format, correction) at one context, with
its measured loss against ``full``: the perplexity ratio and the top-1 agreement of the decode
path, teacher-forced over calibration text that the evaluation never scores.  The solver reads
it to meet a quality target before it spends memory on anything else; KVSwap's fixed
M*G = mg_const is what it falls back to without a table.

The record table is the loss of each disk record format (``kv_record_dtype``) alone: ``flexgen`` reads every
group, so it computes exactly what ``full`` does with exact records, and its perplexity ratio with fp16, int8
or int4 records is what that format costs, per G (keys are scaled per channel over a group).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from edgekv.runtime.config import picked_groups
from edgekv.runtime.choices import CORRECTIONS  # noqa: F401  (the selections a table measures: profile, eval)
from edgekv.runtime.store.files import write_json_atomic

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "profiles" / "quality"  # tables shipped as data (``shipped``)

MG_SHARES = (0.05, 0.1, 0.2)  # M*G candidates as shares of the context (KVSwap's 400 tokens is 5 % at 8K)
# the eval's grid also measures a share between the last two, where picks and K_lr's rank trade evenly at tight
# budgets (SmolLM2 at 4K, 1/34: M*G 616 with int4 K_lr at rank 50 was the least loss on calibration, 1.012 / 0.945,
# and found all 16 needles where the 20 % share's choice found 11).  The deploy's shipped tables predate it
FINE_SHARES = (0.15,)
SINK_WINDOW = ((0, 0), (4, 64))  # (S, W): none (KVSwap as published), and one sink group with a 64-token window
# narrower windows for tight budgets, where a 64-token window is a quarter of the bytes (SmolLM2 at 8K, 1/34) and the
# picks' rank pays for it: at 4K, 1/34 the best (4, 16) point measured 1.020 / top-1 0.933 on calibration, the best
# (4, 64) one 1.077 / 0.870.  The eval's rule measures them; the deploy's shipped tables predate them
NARROW_WINDOWS = ((4, 16), (4, 32))
KLR_DTYPES = ("bfloat16", "int8")  # K_lr formats: int8 rows cost half, so a sigma half as large fits the same memory
# int4 rows (twice int8's rank in its bytes) are measured beside a family's best where that best keeps at most
# 1/16 of the key dimensions: there rank, not precision, is what the keys lack (the fixture at 1/34 of its KV: int8
# sigma 32 relative accuracy 0.939, int4 sigma 16 0.979, the same bytes)
LEAN_KLR, LEAN_FROM_SIGMA = "int4", 16.0
GROUP_SIZES = (4, 16)  # quality at a small and a large group; the solver picks among the measured ones
WINDOWS = 2  # calibration windows per context
RECORD_DTYPES = ("fp16", "int8", "int4")  # record formats measured against exact records
RECORD_GROUP_SIZES = (1, 4, 16)  # per-token keys (G < 4), per channel over a small and a large group
# a corrected point may read this share of its picks again per step (the cap on a correction's reads): the guess
# misses ~10 % of the picks on SmolLM2, and the extra preload slots a cap costs stay a small part of the budget
CORRECTION_SHARE = 0.25


def continuation(context: int) -> int:
    """Tokens teacher-forced through the decode path per window (the rest is the prompt)."""
    return min(128, context // 4)


@dataclass(frozen=True)
class QualityPoint:
    context: int
    G: int
    mg_tokens: int
    sigma: float
    sink_tokens: int
    window_tokens: int
    ppl_ratio: float
    top1_agreement: float
    klr_dtype: str = "bfloat16"
    correction: str = "guess"  # the runtime's 'correction': the layer-ahead picks, or rescored with the own query
    guess_recall: float | None = None  # corrected: the share of the corrected picks the guess had (the rest are read)

    @property
    def M(self) -> int:
        return math.ceil(self.mg_tokens / self.G)


def correction_fields(point: dict) -> dict:
    """The runtime fields of a point's selection.  ``guess``: KVSwap's layer-ahead picks, heads' logits summed.
    ``corrected``: rescored with the layer's own query, at most ``CORRECTION_SHARE`` of its picks read again per
    step, each head's softmax one vote (with the true query every head's distribution is its own, and the votes
    measured better than summed logits on SmolLM2: top-1 0.961 against 0.921 at 1/13)."""
    correction = point.get("correction", "guess")
    if correction == "guess":
        return {"correction": "guess", "correction_reads": None}  # scores as the run sets them (default: summed)
    G = point["G"]
    picked = picked_groups(math.ceil(point["mg_tokens"] / G), G, point["sink_tokens"], point["window_tokens"])
    return {"correction": correction, "correction_reads": max(1, math.ceil(CORRECTION_SHARE * picked)),
            "score_reduce": "softmax"}


def share_tokens(share: float, context: int, G: int) -> int:
    """M*G for a share of the context, in whole groups (at least one)."""
    return max(G, round(share * context / G) * G)


def candidates(context: int, group_sizes, sigmas, corrections=("guess",), sink_windows=SINK_WINDOW,
               shares=MG_SHARES) -> list[dict]:
    """The grid measured at one context: every G, M*G share of ``shares``, sigma, (S, W) of ``sink_windows`` that
    leaves the predictor a pick, K_lr format and selection (``corrections``)."""
    out = []
    for G in group_sizes:
        for share in shares:
            mg = share_tokens(share, context, G)
            for S, W in sink_windows:
                if mg - S - W < G:
                    continue
                out += [{"G": G, "mg_tokens": mg, "sigma": float(s), "sink_tokens": S, "window_tokens": W, "klr_dtype": k,
                         "correction": c} for s in sigmas for k in KLR_DTYPES for c in corrections]
    return out


def frontier(grid: list[dict], bytes_of, budget_bytes: float) -> list[dict]:
    """Per family (G, M*G, S, W, selection), the smallest sigma whose leanest form fits ``budget_bytes``, in bf16 where
    that fits, else in int8: the best a family can do under the budget (a smaller sigma never predicts worse,
    and int8 rows of twice the rank beat bf16 rows in the same bytes).  Where that best is rank-starved (sigma >=
    ``LEAN_FROM_SIGMA``), the same family with int4 rows of half its sigma is measured beside it."""
    best: dict[tuple, dict] = {}
    order = lambda p: (p["sigma"], p["klr_dtype"] != "bfloat16")  # noqa: E731
    for p in grid:
        key = _family(p)
        if bytes_of(p) <= budget_bytes and (key not in best or order(p) < order(best[key])):
            best[key] = p
    lean = [{**p, "sigma": p["sigma"] / 2, "klr_dtype": LEAN_KLR} for p in best.values()
            if p["sigma"] >= LEAN_FROM_SIGMA]
    return list(best.values()) + [p for p in lean if bytes_of(p) <= budget_bytes]


def rank_filled(points: list[dict], bytes_of, budget_bytes: float, key_dims: int) -> list[dict]:
    """Per corrected family of ``points``, int4 K_lr at the largest rank that fits ``budget_bytes`` (sigma
    ``key_dims`` / rank, so the rank is exact), where the sigma ladder's rank leaves up to half of K_lr's bytes
    unused.  Rank is what retrieval lacks at tight budgets: at SmolLM2 4K, 1/34, M*G 408 with W=16 found 15 of 16
    needles at rank 46 and 11 at the ladder's rank 24 beside more picks.  Guess families
    are left out: at every budget measured the corrected family of the same geometry had the lower loss."""
    out, seen = [], {point_key(p) for p in points}
    for p in {_family(p): p for p in points if p.get("correction", "guess") != "guess"}.values():
        at = lambda rank: {**p, "sigma": key_dims / rank, "klr_dtype": LEAN_KLR}  # noqa: E731
        lo, hi = 0, key_dims
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if bytes_of(at(mid)) <= budget_bytes else (lo, mid - 1)
        if lo and point_key(at(lo)) not in seen:
            seen.add(point_key(at(lo)))
            out.append(at(lo))
    return out


def _family(p: dict) -> tuple:
    """What a point's sigma and K_lr format leave: its geometry and selection."""
    return p["G"], p["mg_tokens"], p["sink_tokens"], p["window_tokens"], p.get("correction", "guess")


def squeezed(context: int, G: int, sigmas, bytes_of, budget_bytes: float, corrections=("guess",),
             sink_windows=SINK_WINDOW) -> list[dict]:
    """When no share of the grid fits the budget: per (S, W), the most tokens that fit at the largest sigma
    (in bf16 where that fits, else int8), as KVSwap's rule shrinks M·G under a tight budget, so a tight
    budget still gets a measured choice instead of none; beside each, rank-starved as it is, the most tokens that
    fit with int4 rows of half that sigma."""
    sigma = float(max(sigmas))
    top = share_tokens(MG_SHARES[0], context, G)
    out = []
    for (S, W), c in ((sw, c) for sw in sink_windows for c in corrections):
        for forms in ([(sigma, k) for k in KLR_DTYPES], [(sigma / 2, LEAN_KLR)]):
            for mg in range(top, S + W + G - 1, -G):
                fits = [p for p in ({"G": G, "mg_tokens": mg, "sigma": s, "sink_tokens": S, "window_tokens": W,
                                     "klr_dtype": k, "correction": c} for s, k in forms) if bytes_of(p) <= budget_bytes]
                if fits:
                    out.append(fits[0])
                    break
    return out


def run_config(point: dict, context: int) -> dict:
    """The runtime config that measures ``point``: shared preload buffers, no reuse (quality does not depend on C)."""
    return {"G": point["G"], "M": math.ceil(point["mg_tokens"] / point["G"]), "C": 1, "reuse": False,
            "sigma": point["sigma"], "sink_tokens": point["sink_tokens"], "window_tokens": point["window_tokens"],
            "klr_dtype": point.get("klr_dtype", "bfloat16"), "max_context": context + 64, "io_align_bytes": 512,
            **correction_fields(point)}


def measure(scorer, grid: list[dict], context: int, target: float | None, known=(),
            top1_min: float | None = None) -> list[QualityPoint]:
    """Every grid point through ``scorer`` (an edgekv.evals.perplexity.ConfigScorer on calibration windows
    of ``context`` tokens).  With a ``target`` (a ppl ratio, and ``top1_min`` beside it when given), points that
    differ only in sigma are measured from the largest sigma down, stopping at the first that meets it (a smaller
    sigma costs more memory for a loss already met), after the family's smallest sigma, its best prediction: a
    family whose best misses the target is not measured further (on SmolLM2 at 8K this halves the table's time;
    most families of a small M*G miss at every sigma).
    ``known``: points measured before with the same model, calibration and adapters (a shipped table): given
    again, not measured, and kept where this sweep passes them over."""
    points = []
    before = {_key(q): q for q in known if q.context == context}
    families: dict[tuple, list[dict]] = {}
    for p in grid:
        families.setdefault((p["G"], p["mg_tokens"], p["sink_tokens"], p["window_tokens"], p["klr_dtype"],
                             p.get("correction", "guess")), []).append(p)

    def run(p: dict) -> QualityPoint:
        point = QualityPoint(context, p["G"], p["mg_tokens"], p["sigma"], p["sink_tokens"], p["window_tokens"], 0, 0,
                             p["klr_dtype"], p.get("correction", "guess"))
        if _key(point) in before:
            points.append(before[_key(point)])
            return points[-1]
        row = scorer("kvswap", run_config(p, context))
        points.append(QualityPoint(context, p["G"], p["mg_tokens"], p["sigma"], p["sink_tokens"], p["window_tokens"],
                                   round(row["ppl_ratio"], 4), round(row["top1_agreement"], 4), p["klr_dtype"],
                                   p.get("correction", "guess"),
                                   None if row.get("guess_recall") is None else round(row["guess_recall"], 4)))
        return points[-1]

    def meets(q: QualityPoint) -> bool:
        return target is not None and meets_target(q.ppl_ratio, q.top1_agreement, target, top1_min)

    for family in families.values():
        ordered = sorted(family, key=lambda p: -p["sigma"])
        if target is not None and len(ordered) > 1 and not meets(run(ordered.pop())):
            continue
        for p in ordered:
            if meets(run(p)):
                break
    for twin in lacking_twins(points, target, top1_min):
        run(twin)
    visited = {_key(q) for q in points}
    return points + [q for key, q in before.items() if key not in visited]  # a table measured before loses nothing


def twins(points: list[QualityPoint], target: float | None, top1_min: float | None = None) -> list[dict]:
    """The int4 K_lr twin (``LEAN_KLR`` at the same sigma: the same rank in half int8's bytes) of each family's
    point that meets the target at the largest sigma, where that point's rows are wider: the bytes it frees can hold
    a reuse buffer instead.  SmolLM2 8K at 1/13: its only point within the target (M*G 820, sigma 2, int8 rows,
    corrected) fits no reuse buffer, its int4 twin measured the same on held-out text (ppl 1.013 against 1.014, top-1
    0.926 against 0.930) and fits one.  None without a target."""
    if target is None:
        return []
    best: dict[tuple, QualityPoint] = {}
    for q in points:
        family = (q.context, *_family(asdict(q)), q.klr_dtype)
        if meets_target(q.ppl_ratio, q.top1_agreement, target, top1_min) and q.klr_dtype != LEAN_KLR and (
                family not in best or q.sigma > best[family].sigma):
            best[family] = q
    out = {}
    for q in best.values():
        twin = {**{k: v for k, v in asdict(q).items() if k in POINT_FIELDS}, "klr_dtype": LEAN_KLR}
        out.setdefault(point_key(twin), twin)
    return list(out.values())


def lacking_twins(points: list[QualityPoint], target: float | None, top1_min: float | None = None) -> list[dict]:
    """The ``twins`` of ``points`` not among them (a table measured before twins were): measure them."""
    have = {point_key(asdict(q)) for q in points}
    return [t for t in twins(points, target, top1_min) if point_key(t) not in have]


def meets_target(ppl_ratio: float, top1_agreement: float, target: float, top1_min: float | None) -> bool:
    """A point's two measures against the quality target (a ppl ratio) and the top-1 floor beside it.  Top-1
    agreement is the steadier of the two across texts: a SmolLM2 point that met ppl 1.05 on its calibration windows
    at 0.960 measured 1.063 on held-out text, while its top-1 moved from 0.858 to 0.854."""
    return ppl_ratio <= target and (top1_min is None or top1_agreement >= top1_min)


POINT_FIELDS = ("G", "mg_tokens", "sigma", "sink_tokens", "window_tokens", "klr_dtype", "correction")


def point_key(point: dict) -> tuple:
    """What a grid point is, whatever was measured on it (a field a point predates takes QualityPoint's default)."""
    defaults = {f.name: f.default for f in fields(QualityPoint)}
    return tuple(point.get(k, defaults[k]) for k in POINT_FIELDS)


def _key(p: QualityPoint) -> tuple:
    return (p.context, *point_key(asdict(p)))


def record_config(G: int, context: int) -> dict:
    """flexgen over every group of a ``context`` window, no reuse: only the records' format differs from full."""
    return {"G": G, "M": 1, "C": 1, "reuse": False, "sigma": 8.0, "max_context": context + 64, "io_align_bytes": 512}


def record_table(scorer, context: int, group_sizes, record_dtypes=RECORD_DTYPES) -> dict[int, dict[str, float]]:
    """{G: {kv_record_dtype: perplexity ratio to exact records}} through ``scorer`` (a ConfigScorer at ``context``)."""
    return {G: {dt: round(scorer("flexgen", {**record_config(G, context), "kv_record_dtype": dt})["ppl_ratio"], 5)
                for dt in record_dtypes} for G in group_sizes}


def points_at(table: list[QualityPoint], context: int) -> list[QualityPoint]:
    """The points measured at the smallest context >= ``context`` (the loss grows with context), else the largest."""
    measured = sorted({p.context for p in table})
    if not measured:
        return []
    at = next((c for c in measured if c >= context), measured[-1])
    return [p for p in table if p.context == at]


def save(path: Path, fingerprint: dict, table: list[QualityPoint], meta: dict) -> None:
    write_json_atomic(path, {"fingerprint": fingerprint, "meta": meta, "points": [asdict(p) for p in table]})


def load(path: Path) -> list[QualityPoint]:
    return [QualityPoint(**p) for p in json.loads(Path(path).read_text())["points"]]


def shipped(model_sha256: str | None, fingerprint: dict, folder: Path | None = None):
    """(points, file, meta, corrections) of a table shipped for this model file (its GGUF's SHA-256) and measured
    with the same settings (``fingerprint`` less the machine-local model key) but perhaps fewer selections
    (``corrections``: those it measured; a table from before corrections measured ``guess`` only), else None.
    A quality table is a property of the model, the calibration text and the grid, not of the machine: a default
    deploy on a 2-core CPU takes it from ``profiles/quality/`` instead of spending most of an hour measuring it
    (``tools/ship_quality.py`` writes one; REPROFILE=1 measures it on the machine); points of selections it lacks
    are measured and the rest taken from it."""
    if model_sha256 is None:
        return None
    wanted = {k: v for k, v in fingerprint.items() if k != "corrections"}
    for path in sorted(Path(folder or SHIPPED_DIR).glob("*.json")):
        data = json.loads(path.read_text())
        theirs = data.get("fingerprint") or {}
        if data.get("gguf_sha256") == model_sha256 and {k: v for k, v in theirs.items() if k != "corrections"} == wanted:
            return ([QualityPoint(**p) for p in data["points"]], path, data.get("meta", {}),
                    tuple(theirs.get("corrections", ("guess",))))
    return None


def ship(path: Path, model_sha256: str, fingerprint: dict, table: list[QualityPoint], meta: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"gguf_sha256": model_sha256, "fingerprint": fingerprint, "meta": meta,
                             "points": [asdict(p) for p in table]})
