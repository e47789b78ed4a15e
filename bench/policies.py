"""Decode throughput of every policy on one model, one prompt set, one run.

    python bench/policies.py --context 8192 --batch 4 --steps 32

Builds (once, cached under --work) a random-weight Llama-shaped checkpoint of the given
size, then runs full / flexgen / token / kvswap (and kvswap without reuse) on the same
prompts and prints decode tok/s, the ratio to full, bytes read per token, reuse rate and
I/O stall share.  Reads are O_DIRECT where the filesystem allows (stated in the output).
Random weights give near-uniform attention, so reuse rates here are a lower bound.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from edgekv.runtime import Engine


def build_model(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, max_pos: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per policy (after 1 warm-up token)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--M", type=int, default=100)
    ap.add_argument("--C", type=int, default=200)
    ap.add_argument("--sigma", type=float, default=8)
    ap.add_argument("--policies", default="full,flexgen,token,kvswap,kvswap-noreuse")
    ap.add_argument("--work", default="/var/tmp/edgekv-bench")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    work = Path(args.work)
    kv_dir = work / "kv"
    kv_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(
        work / f"llama-h{args.hidden}-l{args.layers}-q{args.heads}-kv{args.kv_heads}",
        args.hidden, args.layers, args.heads, args.kv_heads, 32000, max(args.context * 2, 4096),
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 32000, (args.context - 8 * i,), generator=g).tolist() for i in range(args.batch)]
    base = {"G": args.G, "M": args.M, "C": args.C, "sigma": args.sigma,
            "max_context": args.context + args.steps + 8, "max_batch": args.batch}
    rows = []
    for name in args.policies.split(","):
        policy, _, variant = name.partition("-")
        config = {**base, "reuse": variant != "noreuse"}
        with Engine.from_pretrained(model, kv_offload_path=kv_dir, config=config, policy=policy) as engine:
            t0 = time.perf_counter()
            out = engine.generate(prompts, max_new_tokens=args.steps + 1, stop_token_ids=[])
            wall = time.perf_counter() - t0
        s = out[0].stats
        tokens = sum(len(r.token_ids) - 1 for r in out)
        rows.append({
            "policy": name, "batch": args.batch, "context": args.context,
            "decode_tok_s": tokens / s["decode_s"],
            "read_bytes_per_token": sum(r.stats["kv_bytes_read"] for r in out) / tokens,
            "reuse_rate": sum(r.stats["reuse_rate"] for r in out) / len(out),
            "io_stall_share": s["io_stall_share"],
            "kv_resident_mib": s["kv_resident_bytes"] / 2**20,
            "prefill_s": sum(r.stats["prefill_s"] for r in out), "wall_s": wall,
            "reader": s["reader"], "o_direct": s["o_direct"],
        })
        print(json.dumps(rows[-1]), flush=True)
    full = next((r["decode_tok_s"] for r in rows if r["policy"] == "full"), None)
    print(f"\ncontext {args.context}, batch {args.batch}, {args.steps} decode steps, model {model.name}")
    print(f"{'policy':16} {'tok/s':>8} {'x full':>7} {'KiB/tok':>9} {'reuse':>6} {'stall':>6} {'KV MiB':>8}")
    for r in rows:
        ratio = f"{r['decode_tok_s'] / full:.2f}" if full else "-"
        print(f"{r['policy']:16} {r['decode_tok_s']:8.2f} {ratio:>7} {r['read_bytes_per_token'] / 1024:9.1f} "
              f"{r['reuse_rate']:6.2f} {r['io_stall_share']:6.2f} {r['kv_resident_mib']:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows}, indent=1))


if __name__ == "__main__":
    main()
