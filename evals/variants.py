"""The eval's experiment design: which variants (policy x budget x switches) a command line asks for, and the
ablations that take kvswap's loss apart.  Policies are asked for their traits, never told apart by name."""
from __future__ import annotations

from edgekv.runtime import policies

from .harness import Variant

SKIP_RECALL = 0.85  # the correction_recall of the stage that corrects only where the guess falls short (local.yaml's)


def policy_variants(policy: str, budgets: list[float], main: dict, rule: str, records: list[str]) -> list[Variant]:
    """One policy's rows: unbudgeted ones once (per record format when on disk), in-memory ones per budget, disk
    selectors per budget and record format (a fixed-G policy by KVSwap's rule: its cells cost G times more to
    measure by quality)."""
    spec = policies.get(policy)
    formats = records if spec.on_disk else ["auto"]
    if not spec.budgeted:
        return [Variant(policy, record_dtype=r) for r in formats]
    if not spec.on_disk:
        return [Variant(policy, b) for b in budgets]
    rule = rule if spec.tunable else "mg_const"
    return [Variant(policy, b, **main, rule=rule, record_dtype=r) for b in budgets for r in formats]


def loss_stages(budget: float, main: dict, rule: str) -> list[Variant]:
    """The loss of kvswap's main row taken apart, each row changing one thing of the chosen configuration:
    top-k by the layer's true attention (oracle: exact query and keys), the layer-ahead prediction with exact
    keys (sigma=1), the guess corrected by the layer's own query over the same K_lr (what is left is the low-rank
    keys'), corrected only at layers whose guess held less than ``SKIP_RECALL`` of the corrected picks, head votes
    by softmax, no sinks or window, and KVSwap's own rule (M*G = 400)."""
    stage = lambda name, **over: Variant("kvswap", budget, **main, rule=rule, ablation=name,  # noqa: E731
                                         overrides=tuple(over.items()))
    rows = [stage("oracle", selector="oracle", score_reduce="softmax", sigma=1), stage("sigma=1", sigma=1),
            stage("corrected", correction="corrected"),
            stage(f"corrected,recall={SKIP_RECALL}", correction="corrected", correction_recall=SKIP_RECALL),
            stage("no-sinks-window", sink_tokens=0, window_tokens=0)]
    if main["score_reduce"] == "sum":
        rows.append(stage("softmax-votes", score_reduce="softmax"))
    if rule == "quality":
        rows.append(Variant("kvswap", budget, **main, rule="mg_const", ablation="mg=400"))
    return rows


def task_ablations(budget: float, main: dict, group_size: int, score_reduce: str) -> list[Variant]:
    """With retrieval tasks, at the last budget: no rolling buffer, reuse forced off and on, the other head vote,
    and other group sizes."""
    other = "softmax" if score_reduce == "sum" else "sum"
    return [Variant("kvswap", budget, **main, rolling_buffer=False, ablation="no-rb"),
            Variant("kvswap", budget, **main, reuse=False, ablation="reuse=off"),
            Variant("kvswap", budget, **main, reuse=True, ablation="reuse=on"),
            Variant("kvswap", budget, G=group_size, score_reduce=other, ablation=f"scores={other}")] + \
        [Variant("kvswap", budget, G=g, score_reduce=score_reduce, ablation=f"G={g}")
         for g in (1, 2, 4, 8, 16) if g != group_size]


def eval_variants(policy_names: list[str], budgets: list[float], main: dict, rule: str, records: list[str],
                  ablations: bool, tasks: bool) -> list[Variant]:
    """Every row of an eval, the reference policy first (what each row's loss is measured against)."""
    variants = [v for policy in policy_names for v in policy_variants(policy, budgets, main, rule, records)]
    if ablations:
        variants += loss_stages(budgets[-1], main, rule)
    if ablations and tasks:
        variants += task_ablations(budgets[-1], main, main["G"], main["score_reduce"])
    if tasks and not any(v.policy == policies.reference() for v in variants):
        variants.insert(0, Variant(policies.reference()))
    return variants
