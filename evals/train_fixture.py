"""Train the shipped fixture model: a small Llama that really retrieves from long contexts.

    python -m edgekv.evals.train_fixture --out runtime/fixture --max-context 2048 --seed 0

A 4-layer GQA Llama (4 query heads of 64 over 2 KV heads, RoPE) learns the tasks of
edgekv.evals.tasks.  Two things make it learn on two CPU cores:
- layer 0, head 0 starts as a previous-token head: constant q/k biases whose RoPE product
  peaks at distance 1, the half of an induction circuit that random init takes longest to find;
- a length curriculum (32 tokens upward, advancing when answer accuracy reaches 95 %),
  with PoSE-style position jumps so that relative distances beyond the trained length are
  seen too.
The loss is on answer tokens only.  Seeded; prints progress and writes the checkpoint
(safetensors, fp16) with a train_log.json of the curriculum and the wall time.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .tasks import PAD, TASKS, VOCAB_SIZE, make_instance


# multiquery (4 answers per instance) carries most of the supervision
TASK_WEIGHTS = [0.1, 0.15, 0.2, 0.35, 0.2]


def fixture_config(max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=True,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=PAD,
        # Llama-3's base: the slow RoPE planes stay nearly unrotated over 16K tokens, room for content matching
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


def init_previous_token_head(model, strength: float = 6.0, planes: int = 12) -> None:
    """Make layer 0's query head 0 attend to the previous token from the start.

    With zero q/k weights and biases q, k, the RoPE score depends only on the distance D:
    sum_i |q_i||k_i| cos(D*theta_i - phi_i).  Putting k_i one rotation step (phi_i = theta_i)
    from q_i over the fastest planes makes all terms peak together at D = 1.
    """
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    inv_freq = model.model.rotary_emb.inv_freq.float()
    q_bias = torch.zeros(d)
    k_bias = torch.zeros(d)
    for i in range(planes):
        theta = float(inv_freq[i])
        q_bias[i] = strength
        k_bias[i] = strength * math.cos(theta)
        k_bias[i + d // 2] = strength * math.sin(theta)
    if _distance_scores(model, q_bias, k_bias).argmax() != 1:  # the other rotation sense
        k_bias[d // 2 : d // 2 + planes] *= -1
    with torch.no_grad():
        attn.q_proj.weight[:d].zero_()
        attn.q_proj.bias[:d] = q_bias
        attn.k_proj.weight[:d].zero_()
        attn.k_proj.bias[:d] = k_bias


def _distance_scores(model, q_bias, k_bias, span: int = 8) -> torch.Tensor:
    """Score of a query at position `span` against keys at distances 0..span-1 (RoPE applied)."""
    from edgekv.runtime.model import _rotate, rope_pair

    pos = torch.arange(span + 1)[None]
    cos, sin = rope_pair(*model.model.rotary_emb(torch.zeros(1), pos))
    q = _rotate(q_bias.expand(1, 1, span + 1, -1), cos, sin)[0, 0, -1]
    k = _rotate(k_bias.expand(1, 1, span + 1, -1), cos, sin)[0, 0]
    return (k @ q).flip(0)[: span]


def make_batch(rng, context: int, batch: int, max_positions: int, pose: bool, weights=TASK_WEIGHTS):
    """Token ids [B, T], label positions, labels, position ids (with an optional PoSE jump)."""
    seqs, label_rows, label_cols, labels = [], [], [], []
    for b in range(batch):
        task = TASKS[rng.choice(len(TASKS), p=weights)]
        inst = make_instance(task, context, rng)
        tokens, label_pos = inst.training_sequence()
        seqs.append(tokens)
        label_rows += [b] * len(label_pos)
        label_cols += label_pos
        labels += [tokens[p + 1] for p in label_pos]
    width = max(len(s) for s in seqs)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    positions = torch.arange(width).expand(batch, -1).clone()
    if pose and max_positions > width:
        for b in range(batch):
            cut = int(rng.integers(1, width))
            positions[b, cut:] += int(rng.integers(0, max_positions - width))
    return ids, torch.tensor(label_rows), torch.tensor(label_cols), torch.tensor(labels), positions


def train(out: Path, max_context: int, max_positions: int, seed: int, minutes: float, lr: float,
          resume: Path | None = None, start_context: int = 32, target: float = 0.95, weights=TASK_WEIGHTS) -> dict:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if resume:  # continue a finished stage from its checkpoint (optimizer state restarts, with warm-up)
        model = LlamaForCausalLM.from_pretrained(resume, dtype=torch.float32)
        previous = json.loads((Path(resume) / "train_log.json").read_text())
    else:
        model = LlamaForCausalLM(fixture_config(max_positions))
        init_previous_token_head(model)
        previous = None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    lengths = [n for n in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if start_context <= n <= max_context]
    stage, history, recent = 0, [], []
    start = time.perf_counter()
    step = 0
    while True:
        context = lengths[stage]
        batch = max(4, min(64, 16384 // context))
        for group in opt.param_groups:  # smaller steps on longer contexts: fewer, noisier batches
            group["lr"] = lr * min(1.0, (256 / context) ** 0.5) * min(1.0, (step + 1) / 100)
        ids, rows, cols, labels, positions = make_batch(rng, context, batch, max_positions, pose=stage > 0 or resume is not None, weights=weights)
        logits = model(input_ids=ids, position_ids=positions).logits
        picked = logits[rows, cols]
        loss = F.cross_entropy(picked, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent = (recent + [(picked.argmax(-1) == labels).float().mean().item()])[-20:]
        elapsed = time.perf_counter() - start
        if step % 10 == 0:
            print(f"step {step:5d} ctx {context:5d} loss {loss.item():.3f} acc {np.mean(recent):.3f} {elapsed:6.0f}s", flush=True)
        done_stage = len(recent) == 20 and np.mean(recent) >= target
        if done_stage:
            history.append({"context": context, "step": step, "seconds": round(elapsed, 1), "target": target})
            print(f"-- context {context} reached {target:.0%} at step {step} ({elapsed:.0f} s)", flush=True)
            _save(model, out, _log(seed, step, start, history, max_positions, lr, previous, weights))
            if stage + 1 == len(lengths):
                break
            stage, recent = stage + 1, []
        if elapsed > minutes * 60:
            print(f"-- time budget of {minutes} min reached at context {context}", flush=True)
            break
    log = _log(seed, step, start, history, max_positions, lr, previous, weights)
    _save(model, out, log)
    return log


def _log(seed, step, start, history, max_positions, lr, previous, weights=TASK_WEIGHTS) -> dict:
    log = {"seed": seed, "steps": step, "wall_s": round(time.perf_counter() - start, 1), "curriculum": history,
           "trained_context": history[-1]["context"] if history else None, "max_positions": max_positions,
           "torch_threads": torch.get_num_threads(), "lr": lr, "task_weights": list(weights)}
    if previous:
        log = {**log, "resumed_from": previous, "steps": step + previous["steps"],
               "wall_s": round(log["wall_s"] + previous["wall_s"], 1),
               "curriculum": previous["curriculum"] + history,
               "trained_context": log["trained_context"] or previous["trained_context"]}
    return log


def _save(model, out: Path, log: dict) -> None:
    """fp16 safetensors + train_log.json; written after every finished stage, so a run can stop any time."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = None  # answers are read at fixed positions, never stopped early
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runtime/fixture")
    ap.add_argument("--max-context", type=int, default=2048, help="longest curriculum stage (tokens)")
    ap.add_argument("--max-positions", type=int, default=16384, help="position range seen through PoSE jumps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--resume", type=Path, help="continue from this checkpoint (its train_log.json is kept)")
    ap.add_argument("--start-context", type=int, default=32, help="first curriculum stage (with --resume)")
    ap.add_argument("--target", type=float, default=0.95, help="answer accuracy (last 20 steps) that ends a stage")
    ap.add_argument("--task-weights", default=",".join(map(str, TASK_WEIGHTS)), help=f"sampling weights of {TASKS}")
    args = ap.parse_args(argv)
    log = train(Path(args.out), args.max_context, args.max_positions, args.seed, args.minutes, args.lr,
                args.resume, args.start_context, args.target, [float(w) for w in args.task_weights.split(",")])
    print(json.dumps(log))


if __name__ == "__main__":
    main()
