"""The decode step's small calls as they are against the forms they replaced, alternating every ``--steps`` decode
steps for ``--rounds`` rounds on one prefilled batch, so the files, the picks and the machine's drift are the same for
both; per form the median step.  ``--replace`` names which (default: all):

- ``block end``: a Llama block's output projection, residual, MLP norm, gate/up, SiLU, down and residual in one
  native call under ggml (ekv_ggml.c ekv_ggml_block_end), against the torch glue between the layers' calls;
- ``heads``: the packed q/k/v layer and the next layer's query cut into RoPE'd heads in the ggml call
  (ekv_ggml_heads), against torch's views and rotation;
- ``native queries``: the low-rank queries in one native call (ekv_score.c), against torch's broadcast matmul;
- ``ring``: the step's K and V into the window ring in one native call, against torch's index_put;
- ``post chain``: a posted select's scores, votes and top-M posted in one call, against a call each;
- ``glue norms``: a block's input and MLP norms taken in its projections' ggml calls (runtime/native/ekv_ggml.c),
  against torch's fused norm before them;
- ``norms``: torch's one fused RMS norm call, against Hugging Face's norm modules;
- ``q rows``: the next layer's query from q's rows alone, against q cut from the whole packed q/k/v layer;
- ``rope``: q's and k's heads rotated in one pass, against a rotation each;
- ``einsum``: the low-rank queries by a broadcast matmul, against einsum (with ``native queries``: einsum);
- ``rows once``: the scorer's K_lr arguments found once a layer, against every select;
- ``native top``: the top-M in one native call (on the helper for a posted select), against torch's topk;
- ``launch``: a posted select's queries, jobs and post in one native call (ekv_score.c ekv_score_launch), against
  a call each;
- ``fetch plan``: a layer's slots assigned and reads planned in one native call (runtime/fetch_plan.py), against
  the slot table's and the store's calls;
- ``io takes``: a layer's picks taken (slots, reads planned and started) on an I/O thread the moment the helper has
  made them, against the compute thread taking them once the layer before has attended;
- ``striped flush``: a flush's writes found for every layer at once (``DiskKVStore._striped_runs``), against layer
  by layer.

The torch-path forms (``norms``, ``q rows``, ``rope``) undo ``heads`` too, and ``norms`` ``block end``: the fused
calls bypass them.  Every replaced form but ``glue norms``, ``block end`` (glibc's exponential in SiLU against
torch's) and ``native queries`` (the sums' order) gives the same bits, so both decode the same tokens (the top-M: the
same picks but where scores tie exactly); those three differ in last bits.

    python -m bench.fused_calls --model smollm2 --context 8192 --batch 1 --weights ggml --dtype float32 \\
        --policy kvswap --kvswap G=4,M=205,C=256,sigma=2 --extra '<the deployed fields>' [--replace "glue norms"]
"""
import contextlib
from unittest import mock

import torch

from bench.deployed_batch import alternate, alternating_room, parser, print_medians, text_batch
from edgekv.runtime import model as model_module
from edgekv.runtime import weights
from edgekv.runtime.model import LayerPlan
from edgekv.runtime.aside import AsideThread
from edgekv.runtime.disk_store import DiskKVStore
from edgekv.runtime.norms import norm_call
from edgekv.runtime.selector import LowRankSelector

FORMS = ("block end", "heads", "native queries", "ring", "post chain", "glue norms", "norms", "q rows", "rope",
         "einsum", "rows once", "native top", "launch", "fetch plan", "io takes",
         "striped flush")


def _queries_by(product):
    """``LowRankSelector._low_rank_queries`` as it was, the heads' queries times the adapter by ``product``."""
    def queries(self, layer, q):
        b, h, _, d = q.shape
        grouped = q.reshape(b, self.n_kv_heads, h // self.n_kv_heads, d)
        adapter = self.adapter[layer].view(self.n_kv_heads, d, -1)
        if self.score_reduce == "sum":
            return torch.einsum("bgd,gdr->br", grouped.sum(dim=2).to(self.dtype), adapter)[:, None, :]
        return product(grouped.to(self.dtype), adapter).reshape(b, h, -1) * self.scaling
    return queries


_einsum_queries = _queries_by(lambda grouped, adapter: torch.einsum("bgnd,gdr->bgnr", grouped, adapter))
_matmul_queries = _queries_by(torch.matmul)  # before the native projection


def _posted_each(self, jobs, keep=()):
    """``AsideThread.post_chain`` as it was: a post a job."""
    ticket = 0
    for fn, job, units in jobs:
        ticket = self.post(fn, job, units, keep=keep)
    return ticket


_CHAIN = AsideThread.post_chain


def _rows_found_again(self, layer):
    """``LowRankSelector._native_rows`` finding the layer's K_lr arguments every select, as ``_native_job`` did."""
    self._rows_args[layer] = None
    return _ROWS_ONCE(self, layer)


_ROWS_ONCE = LowRankSelector._native_rows


def _plans(model, replaced: set[str]) -> list[LayerPlan]:
    """Each block's plan built again with the ``replaced`` of its forms as they were, its new kernels lent the
    model's helper thread."""
    with contextlib.ExitStack() as patches:
        if "glue norms" in replaced:
            patches.enter_context(mock.patch.object(weights, "rms_norm_of", lambda module: None))
        if "norms" in replaced:
            for module in (weights, model_module):
                patches.enter_context(mock.patch.object(module, "norm_call", _module_forward))
        plans = [LayerPlan(block) for block in model.layers]
        for plan, block in zip(plans, model.layers):
            if replaced & {"heads", "norms", "q rows", "rope"}:
                plan.qkv_heads = plan.q_heads = None
            if replaced & {"block end", "norms"}:
                plan.block_end = None
            if "rope" in replaced:
                plan.qkv_whole = None
            q_proj = block.self_attn.q_proj
            if "q rows" in replaced and hasattr(q_proj, "fused"):
                whole = weights.normed_call(block.input_layernorm, q_proj.fused)
                plan.q_proj = lambda x, whole=whole, cut=slice(q_proj.start, q_proj.stop): whole(x)[..., cut]
    aside = next((k.aside for k in model._shared_kernels), None)
    for layer in model.hf.modules():
        for kernel in getattr(layer, "kernels", ()):
            kernel.aside = aside
    return plans


def _no_runs(self, *args):
    """``DiskKVStore._striped_runs`` declining: the layers' runs found one by one."""
    return None


def _module_forward(module):
    """A norm module's own forward (``norm_call`` replaced)."""
    return None if module is None else module.forward


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, rounds=6)
    ap.add_argument("--policy", default="kvswap")
    ap.add_argument("--replace", default=",".join(FORMS), help=f"comma-separated, of: {', '.join(FORMS)}")
    args = ap.parse_args(argv)
    replaced = set(args.replace.split(","))
    if replaced - set(FORMS):
        ap.error(f"--replace: {', '.join(sorted(replaced - set(FORMS)))} is no form; the forms: {', '.join(FORMS)}")
    matmul, native_top = LowRankSelector._low_rank_queries, LowRankSelector._top_call
    launch = LowRankSelector._launch_posted
    striped = DiskKVStore._striped_runs
    with text_batch(args, room=alternating_room(args, 2), policy=args.policy) as (policy, step):
        model = policy.model
        plans = {True: model.plans, False: _plans(model, replaced)}
        old_norm = _module_forward if "norms" in replaced else norm_call
        final_norm = {True: model._final_norm, False: old_norm(model.norm)}

        put_rows = getattr(policy, "_put_rows", None)
        planner = getattr(policy, "_planner", None)
        queries = _einsum_queries if "einsum" in replaced else _matmul_queries

        def setting(fused: bool):
            def apply():
                model.plans, model._final_norm = plans[fused], final_norm[fused]
                for name, attr, new, old in (("native queries", "_low_rank_queries", matmul, queries),
                                             ("einsum", "_low_rank_queries", matmul, _einsum_queries),
                                             ("rows once", "_native_rows", _ROWS_ONCE, _rows_found_again),
                                             ("native top", "_top_call", native_top, lambda *_: None),
                                             ("launch", "_launch_posted", launch, lambda *_: None)):
                    if fused or name in replaced:
                        setattr(LowRankSelector, attr, new if fused else old)
                AsideThread.post_chain = _CHAIN if fused or "post chain" not in replaced else _posted_each
                DiskKVStore._striped_runs = striped if fused or "striped flush" not in replaced else _no_runs
                if put_rows is not None:
                    policy._put_rows = put_rows if fused or "ring" not in replaced else None
                if planner is not None:
                    policy._planner = planner if fused or "fetch plan" not in replaced else None
                if hasattr(policy, "_takes_on_io"):
                    policy._takes_on_io = fused or "io takes" not in replaced
            return apply

        settings = {"fused calls": setting(True), "replaced forms": setting(False)}
        try:
            ms, _ = alternate(step, settings, args.rounds, args.steps)
        finally:
            settings["fused calls"]()
    print(f"replaced: {', '.join(f for f in FORMS if f in replaced)}")
    print_medians(ms, "replaced forms", prefix=f"{args.policy} batch {args.batch} ")


if __name__ == "__main__":
    main()
