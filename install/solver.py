"""The greedy parameter solver (KVSwap Appendix A.4), one (batch, context) pair at a time.

Memory side (``fit_memory``): M*G is preset to ``mg_const`` (scaled down only when even
sigma_max cannot make it fit the per-sequence budget B_max/b_max); C = M plus whatever the
reuse share of the budget buys; sigma is the smallest candidate that keeps the runtime's
own memory plan within budget.  At short contexts per-layer reuse slots can cost selected
tokens; ``quality_fit`` then takes the shared preload buffers instead (no reuse), and the
reuse buffer comes back only when the time side needs it.

Time side (``solve``): for G = 1, 2, 4, ... g_max take the first whose disk time is at least
(1 - exposed_io_share) hidden behind compute; if none, move ``reuse_step`` of the budget into the
reuse buffer (more hits, fewer reads; sigma rises to pay for it) and start again from G = 1;
stop at sigma_max / g_max with the configuration that left the least I/O exposed.

The disk record's format (``kv_record_dtype``) is one more knob: at each G the formats whose measured loss
(``Limits.record_losses``, the install step's record table: perplexity ratio to exact records, per G) is
within ``record_ppl_max`` are tried least lossy first, so exact records stay until smaller ones are needed to
hide the I/O.  With a quality target, the loss of a format multiplies the table point's.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch

from edgekv.runtime import RecordLayout, RuntimeConfig
from edgekv.runtime.config import picked_groups
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.memory import plan_memory
from edgekv.runtime.model import ModelDims
from edgekv.runtime.slots import SlotTable

from .quality import correction_fields, meets_target

SIGMAS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Limits:
    sigma_max: float = 32
    g_max: int = 16
    mg_const: int = 400
    exposed_io_share: float = 0.1  # the share of the I/O time that may stay exposed (was ``alpha``)
    reuse_step: float = 0.05
    io_align_bytes: int = 4096  # the page a record pads to at most
    block_bytes: int | None = None  # the disk's O_DIRECT unit: records shorter than a page pad to a power of two from
    # it (runtime.disk_store.record_align_bytes); None: every record pads to whole pages
    klr_dtype: str = "bfloat16"
    quality_target: float | None = None  # ppl ratio to full the configuration must stay within (quality table needed)
    quality_top1_min: float | None = None  # and the top-1 agreement with full it must keep (None: any)
    record_losses: dict = field(default_factory=dict)  # {G: {kv_record_dtype: ppl ratio to exact records}}; {}: exact only
    record_ppl_max: float = 1.01  # without a quality target: the most loss a record format may cost
    prompt_adapter: bool = False  # each sequence holds its own projections, fitted on its prompt (runtime config's)

    def record_layout(self, dims: ModelDims, kv_dtype: torch.dtype, G: int, record_dtype: str) -> RecordLayout:
        """The layout of a record of G tokens in ``record_dtype``, padded as these limits say (its ``align_bytes``
        and ``stride_bytes``)."""
        return RecordLayout.padded(G, dims.n_kv_heads, dims.head_dim, kv_dtype, record_dtype, self.io_align_bytes,
                                   self.block_bytes)

    @property
    def alpha(self) -> float:
        """The old name of ``exposed_io_share`` (KVSwap's alpha; HillInfer and ARKV use alpha for other things)."""
        return self.exposed_io_share


@dataclass(frozen=True)
class MemoryFit:
    G: int
    M: int
    C: int
    sigma: float
    rank: int
    bytes_per_sequence: int
    mg_scaled: bool  # M*G had to go below mg_const to fit
    reuse: bool = True


@dataclass(frozen=True)
class Solution:
    batch: int
    context: int
    G: int
    M: int
    C: int
    sigma: float
    reuse_rate: float
    t_io_ms: float
    t_model_ms: float
    hidden: bool  # (1 - exposed_io_share) of the I/O overlaps compute
    mg_scaled: bool
    bytes_per_sequence: int
    reuse: bool
    sink_tokens: int = 0
    window_tokens: int = 0
    ppl_ratio: float | None = None  # the quality table's measured loss of this configuration (None: no table)
    quality_met: bool | None = None  # ppl_ratio and top-1 within Limits' quality_target, quality_top1_min (None: no target)
    klr_dtype: str = "bfloat16"
    kv_record_dtype: str = "auto"
    correction: str = "guess"  # the selection (runtime 'correction'), as the quality table measured it
    correction_reads: int | None = None
    score_reduce: str = "sum"  # how heads' scores combine (corrected points: a softmax vote per head)
    t_correct_ms: float = 0.0  # the reads a correction makes per step (the picks the guess missed): never hidden
    top1_agreement: float | None = None  # the quality table's measured top-1 agreement with full (None: no table)
    io_align_bytes: int = 4096  # what its records pad to (Limits.align_bytes)
    prompt_adapter: bool = False  # its memory holds each sequence's own projections (Limits.prompt_adapter)

    def to_json(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _sequence_bytes(dims: ModelDims, kv_dtype: torch.dtype, limits: Limits, context: int, G: int, M: int, C: int,
                    sigma: float, reuse: bool, sink_tokens: int = 0, window_tokens: int = 0,
                    klr_dtype: str | None = None, record_dtype: str = "auto", correction: dict | None = None
                    ) -> tuple[int, int]:
    """(bytes, rank) of one sequence, from the runtime's own memory plan; ``correction``: its runtime fields
    (install.quality.correction_fields; None: guess)."""
    rank = LowRankAdapter.rank_for(dims.n_kv_heads, dims.head_dim, sigma)
    layout = limits.record_layout(dims, kv_dtype, G, record_dtype)
    cfg = RuntimeConfig.from_flat({"G": G, "M": M, "C": C, "sigma": sigma, "max_batch": 1, "max_context": context,
                                   "reuse": reuse, "io_align_bytes": layout.align_bytes,
                                   "klr_dtype": klr_dtype or limits.klr_dtype, "sink_tokens": sink_tokens,
                                   "window_tokens": window_tokens, "kv_record_dtype": record_dtype,
                                   "prompt_adapter": limits.prompt_adapter, **(correction or {})})
    itemsize = torch.empty(0, dtype=kv_dtype).element_size()
    return plan_memory("kvswap", cfg, dims, itemsize, rank, layout.stride_bytes).total_bytes, rank


def record_choices(limits: Limits, G: int, gated: bool = True) -> list[tuple[str, float]]:
    """(kv_record_dtype, ppl ratio to exact records) the solver may pick at G, least lossy first and exact records
    first among equals, from the measured G nearest on a log scale; a measured ratio below 1 is noise and counts
    as 1.  ``gated``: only those within ``record_ppl_max`` (a quality target judges them itself)."""
    table = {int(g): rows for g, rows in limits.record_losses.items()}
    rows = table[min(table, key=lambda g: (abs(math.log2(g / G)), g))] if table else {}
    measured = [(dt, max(1.0, float(r))) for dt, r in rows.items() if dt != "auto"]
    return sorted([("auto", 1.0)] + [c for c in measured if not gated or c[1] <= limits.record_ppl_max],
                  key=lambda c: c[1])


def fit_memory(budget_bytes: float, dims: ModelDims, kv_dtype: torch.dtype, limits: Limits, context: int, G: int,
               extra_bytes: float = 0.0, reuse: bool = True, record_dtype: str = "auto") -> MemoryFit | None:
    """(M, C, sigma) for group size G within ``budget_bytes`` per sequence; None if one group does not fit.

    ``extra_bytes`` of the budget go to reuse slots beyond M.
    """
    sigmas = [s for s in SIGMAS if s <= limits.sigma_max] or [limits.sigma_max]
    stride = limits.record_layout(dims, kv_dtype, G, record_dtype).stride_bytes
    extra_slots = int(extra_bytes // (SlotTable.n_buffers(dims.n_layers) * stride)) if reuse else 0
    M = math.ceil(limits.mg_const / G)

    def need(m, sigma):
        return _sequence_bytes(dims, kv_dtype, limits, context, G, m, m + extra_slots, sigma, reuse,
                               record_dtype=record_dtype)

    floor_bytes, _ = need(1, sigmas[-1])
    if floor_bytes > budget_bytes:
        return None
    scaled = False
    if need(M, sigmas[-1])[0] > budget_bytes:  # the largest M that fits at sigma_max
        M, scaled = _largest(1, M, lambda m: need(m, sigmas[-1])[0] <= budget_bytes), True
    for sigma in sigmas:
        total, rank = need(M, sigma)
        if total <= budget_bytes:
            return MemoryFit(G, M, M + extra_slots, sigma, rank, total, scaled, reuse)
    return None


def quality_fit(budget_bytes: float, dims: ModelDims, kv_dtype: torch.dtype, limits: Limits, context: int,
                G: int, record_dtype: str = "auto") -> MemoryFit | None:
    """The fit that selects the most tokens: per-layer reuse slots, or (when those force M*G below
    what fits) two preload buffers shared by all layers and no reuse.  Ties keep reuse."""
    fits = [f for f in (fit_memory(budget_bytes, dims, kv_dtype, limits, context, G, reuse=r, record_dtype=record_dtype)
                        for r in (True, False)) if f]
    return max(fits, key=lambda f: (f.M, f.reuse)) if fits else None


def group_sizes(g_max: int) -> list[int]:
    return [g for g in (1, 2, 4, 8, 16, 32, 64) if g <= g_max]


def solve(batch: int, context: int, budget_bytes: float, dims: ModelDims, kv_dtype: torch.dtype, limits: Limits,
          t_io_ms, t_model_ms, reuse_rate) -> Solution:
    """The greedy search for one (batch, context).

    t_io_ms(batch, picked_groups, G, hit_rate, record_dtype) -> ms of disk reads per step; t_model_ms(batch, context,
    rank, picked_groups, G, reuse) -> ms of compute per step; reuse_rate(G, C, picked_groups) -> expected hit rate.
    No sinks or window here: all M groups are picked.
    """
    best: Solution | None = None
    share = 0.0
    selected = {}  # (G, record) -> M at share 0: the reuse buffer is paid for with sigma, never with selected tokens
    while share < 1.0:
        fitted_any = False
        for G, record in ((G, r) for G in group_sizes(limits.g_max) for r, _ in record_choices(limits, G)):
            if share == 0:
                fit = quality_fit(budget_bytes, dims, kv_dtype, limits, context, G, record)
                if fit is not None:
                    selected[G, record] = fit.M
            else:
                fit = fit_memory(budget_bytes, dims, kv_dtype, limits, context, G, extra_bytes=share * budget_bytes,
                                 record_dtype=record)
            if fit is None or (share > 0 and (fit.C == fit.M or fit.M < selected.get((G, record), 0))):
                continue
            fitted_any = True
            hit = reuse_rate(G, fit.C, fit.M) if fit.reuse else 0.0
            io = t_io_ms(batch, fit.M, G, hit, record)
            model = t_model_ms(batch, context, fit.rank, fit.M, G, fit.reuse)
            hidden = (1 - limits.exposed_io_share) * io <= model
            sol = Solution(batch, context, G, fit.M, fit.C, fit.sigma, hit, io, model, hidden, fit.mg_scaled,
                           fit.bytes_per_sequence, fit.reuse, klr_dtype=limits.klr_dtype, kv_record_dtype=record,
                           io_align_bytes=limits.record_layout(dims, kv_dtype, G, record).align_bytes,
                           prompt_adapter=limits.prompt_adapter)
            if best is None or _exposed(sol) < _exposed(best) - 1e-9:
                best = sol
            if hidden:
                return sol
        if not fitted_any and share > 0:
            break
        share += limits.reuse_step
    if best is None:
        raise ValueError(
            f"no configuration fits {budget_bytes / 2**20:.2f} MiB per sequence at context {context}: even one group "
            f"with sigma_max={limits.sigma_max:g} needs more; raise memory.max_kv_mem_mib or lower max_batch/max_context"
        )
    return best


def smallest_bytes(dims: ModelDims, kv_dtype: torch.dtype, limits: Limits, context: int, point: dict) -> int:
    """Bytes per sequence of a quality-grid point in its leanest form (no reuse buffer): more never fits."""
    G = point["G"]
    M = math.ceil(point["mg_tokens"] / G)
    return _sequence_bytes(dims, kv_dtype, limits, context, G, M, 1, point["sigma"], False, point["sink_tokens"],
                           point["window_tokens"], point.get("klr_dtype"), correction=correction_fields(point))[0]


def solve_for_quality(batch: int, context: int, budget_bytes: float, dims: ModelDims, kv_dtype: torch.dtype,
                      limits: Limits, points, t_io_ms, t_model_ms, reuse_rate, log=None) -> Solution:
    """Quality first: among the quality table's configurations (``points``, one context) that meet
    ``limits.quality_target`` (and ``quality_top1_min``), those that fit the budget (with no reuse buffer, or one of C/M in
    ``C_RATIOS``, or the most reuse slots the budget holds up to the largest of those: the rest of the budget, where
    C/M = 1.25 missed it by 0.08 MiB and left 10 % unused, SmolLM2 8K at 1/13) and in each record format of
    ``record_choices`` (its measured loss multiplying the point's), the one that leaves the least I/O exposed (then the
    lower loss).  When none meets
    the target under the budget, the lowest-loss one that fits, reported through ``log`` and in the
    solution (``quality_met`` False): never silently."""
    from .tables import C_RATIOS

    target = limits.quality_target
    fitting = []
    for p in points:
        M = math.ceil(p.mg_tokens / p.G)
        picked = picked_groups(M, p.G, p.sink_tokens, p.window_tokens)
        correction = correction_fields(asdict(p))
        for record, loss in record_choices(limits, p.G, gated=target is None):
            @functools.cache  # each size's plan once: the bisection's and the solutions' (~1.3 ms a plan)
            def need(C, reuse=True):
                return _sequence_bytes(dims, kv_dtype, limits, context, p.G, M, C, p.sigma, reuse, p.sink_tokens,
                                       p.window_tokens, p.klr_dtype, record, correction)

            def fits(C):
                return need(C)[0] <= budget_bytes

            sizes = sorted({max(picked, round(r * picked)) for r in C_RATIOS})
            below = [C for C in sizes if fits(C)]  # the ratios' sizes that fit, then the gap to the next one
            if below and below[-1] < sizes[-1]:
                sizes.append(_largest(below[-1], sizes[len(below)] - 1, fits))
            for reuse, C in [(False, picked)] + [(True, C) for C in sorted(set(sizes))]:
                total, rank = need(C, reuse)
                if total > budget_bytes:
                    continue
                hit = reuse_rate(p.G, C, picked) if reuse else 0.0
                io = t_io_ms(batch, picked, p.G, hit, record)
                missed = 0.0 if p.guess_recall is None else min(correction["correction_reads"],
                                                                (1 - p.guess_recall) * picked)
                fix = t_io_ms(batch, missed, p.G, hit, record) if missed else 0.0
                model = t_model_ms(batch, context, rank, picked, p.G, reuse)
                ppl_ratio = p.ppl_ratio * loss
                met = None if target is None else meets_target(ppl_ratio, p.top1_agreement, target,
                                                               limits.quality_top1_min)
                fitting.append(Solution(batch, context, p.G, M, C, p.sigma, hit, io, model,
                                        (1 - limits.exposed_io_share) * io <= model, False, total, reuse, p.sink_tokens,
                                        p.window_tokens, ppl_ratio, met, p.klr_dtype, record, **correction,
                                        t_correct_ms=fix, top1_agreement=p.top1_agreement,
                                        io_align_bytes=limits.record_layout(dims, kv_dtype, p.G, record).align_bytes,
                                        prompt_adapter=limits.prompt_adapter))
    if not fitting:
        raise ValueError(
            f"no configuration of the quality table fits {budget_bytes / 2**20:.2f} MiB per sequence at context {context}; "
            "raise memory.max_kv_mem_mib or lower max_batch/max_context"
        )
    met = [s for s in fitting if s.quality_met is not False]
    if met:
        return min(met, key=lambda s: (_exposed(s), s.ppl_ratio, s.bytes_per_sequence))
    best = min(fitting, key=lambda s: (s.ppl_ratio, _exposed(s)))
    if log is not None:
        log(f"quality target {target_words(target, limits.quality_top1_min)} not reachable at batch {batch}, context {context} within "
            f"{budget_bytes / 2**20:.2f} MiB per sequence: best reachable {best.ppl_ratio:.3f} (G={best.G} M={best.M} "
            f"sigma={best.sigma:g} {best.klr_dtype} records {best.kv_record_dtype} S={best.sink_tokens} W={best.window_tokens}); raise the budget or "
            "the target")
    return best


def _largest(low: int, high: int, fits) -> int:
    """The largest n in [low, high] with ``fits(n)`` (true up to some n, false past it), else ``low``."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def target_words(target: float, top1_min: float | None) -> str:
    """The quality target as logs and reports say it: "ppl ratio <= 1.05 with top-1 >= 0.9"."""
    return f"ppl ratio <= {target:g}" + ("" if top1_min is None else f" with top-1 >= {top1_min:g}")


def _exposed(sol: Solution) -> float:
    return max(0.0, sol.t_io_ms - sol.t_model_ms) + sol.t_correct_ms
