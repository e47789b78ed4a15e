"""The decode step's small calls as they are (one fused RMS norm call, the next layer's query from q's rows alone, the
low-rank queries by a broadcast matmul, q's and k's heads rotated in one pass, the scorer's K_lr arguments found once a
layer, the top-M in one native call, on the helper for a posted select) against the forms they replaced (Hugging
Face's norm modules, q cut from the whole packed q/k/v layer, einsum, a rotation each, the arguments found every
select, torch's topk on the compute thread), alternating every ``--steps`` decode steps for ``--rounds`` rounds on one
prefilled batch, so the files, the picks and the machine's drift are the same for both; per form the median step.
Every replaced form gives the same bits, so both decode the same tokens (the top-M: the same picks but where scores
tie exactly).

    python -m bench.fused_calls --model smollm2 --context 8192 --batch 1 --weights ggml --dtype float32 \\
        --policy kvswap --kvswap G=4,M=205,C=256,sigma=2 --extra '<the deployed fields>'
"""
import torch

from bench.deployed_batch import alternate, alternating_room, parser, print_medians, text_batch
from edgekv.runtime.norms import norm_call
from edgekv.runtime.selector import LowRankSelector

NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "pre_ff_norm": "pre_feedforward_layernorm", "post_ff_norm": "post_feedforward_layernorm"}


def _einsum_queries(self, layer, q):
    """``LowRankSelector._low_rank_queries`` as it was: einsum."""
    b, h, _, d = q.shape
    grouped = q.reshape(b, self.n_kv_heads, h // self.n_kv_heads, d)
    adapter = self.adapter[layer].view(self.n_kv_heads, d, -1)
    if self.score_reduce == "sum":
        return torch.einsum("bgd,gdr->br", grouped.sum(dim=2).to(self.dtype), adapter)[:, None, :]
    return torch.einsum("bgnd,gdr->bgnr", grouped.to(self.dtype), adapter).reshape(b, h, -1) * self.scaling


def _rows_found_again(self, layer):
    """``LowRankSelector._native_rows`` finding the layer's K_lr arguments every select, as ``_native_job`` did."""
    self._rows_args[layer] = None
    return _ROWS_ONCE(self, layer)


_ROWS_ONCE = LowRankSelector._native_rows


def _forms(model, fused: bool, whole_qkv: list) -> None:
    """Each layer plan's norms, query projection and RoPE passes, and the final norm, in the fused or the replaced
    form (``whole_qkv``: each plan's packed q/k/v call, as loaded)."""
    for plan, block, whole in zip(model.plans, model.layers, whole_qkv):
        plan.qkv_whole = whole if fused else None
        for attr, module in NORMS.items():
            if hasattr(plan, attr):
                setattr(plan, attr, (norm_call if fused else (lambda m: m.forward))(getattr(block, module)))
        q_proj = block.self_attn.q_proj
        whole = getattr(q_proj, "fused", None)
        plan.q_proj = q_proj.forward if fused or whole is None else (
            lambda x, whole=whole, cut=slice(q_proj.start, q_proj.stop): whole(x)[..., cut])
    model._final_norm = norm_call(model.norm) if fused else model.norm.forward


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, rounds=6)
    ap.add_argument("--policy", default="kvswap")
    args = ap.parse_args(argv)
    matmul, native_top = LowRankSelector._low_rank_queries, LowRankSelector._top_call
    with text_batch(args, room=alternating_room(args, 2), policy=args.policy) as (policy, step):
        model = policy.model
        whole_qkv = [plan.qkv_whole for plan in model.plans]

        def setting(fused: bool):
            return lambda: (_forms(model, fused, whole_qkv),
                            setattr(LowRankSelector, "_low_rank_queries", matmul if fused else _einsum_queries),
                            setattr(LowRankSelector, "_native_rows", _ROWS_ONCE if fused else _rows_found_again),
                            setattr(LowRankSelector, "_top_call", native_top if fused else lambda *_: None))

        settings = {"fused calls": setting(True), "replaced forms": setting(False)}
        try:
            ms, _ = alternate(step, settings, args.rounds, args.steps)
        finally:
            settings["fused calls"]()
    print_medians(ms, "replaced forms", prefix=f"{args.policy} batch {args.batch} ")


if __name__ == "__main__":
    main()
