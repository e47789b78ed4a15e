"""`edgekv generate`: generate from prompts with any KV policy."""
from __future__ import annotations

import contextlib
import json
import sys

from edgekv.commands import common
from edgekv.commands.common import KV_PATHS_HELP, POLICY_HELP, PROMPT_HELP, UsageError

NAME = "generate"
MEMORY = "the prompts or --config's max_context / max_batch"  # what its memory grows with: named when it runs out
KV_FOLDERS = "existing"  # --kv-path(s) must name folders that exist
CHECK_AFTER = "names"  # the prompts are read once every name is known good, before the paths


def add(sub) -> None:
    from edgekv.runtime.checkpoints import MODEL_HELP

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
    common.add_compute_flags(gen)
    gen.set_defaults(func=run)


def check(args) -> None:
    """The prompts read and parsed (before the model loads), and something to generate from."""
    args.prompt = [common.read_prompt("--prompt", p, False) if kind == "text" else
                   common.read_prompt("--prompt-file", p, True) for kind, p in args.prompt or []]
    if not args.prompt and not args.chat and not args.context:
        raise UsageError("nothing to generate from: pass --prompt TEXT, --prompt-file FILE, --chat MESSAGE or "
                         "--context NAME")
    if any(p == "" for p in args.prompt) and not args.context:
        raise UsageError("--prompt is empty; pass the prompt's text (an empty prompt continues a stored --context)")


def run(args) -> int:
    from edgekv.runtime import Engine

    prompts = list(args.prompt or [])  # read and parsed by check
    prompts += [[{"role": "user", "content": c}] for c in args.chat or []]
    prompts = prompts or [""]  # --context alone: continue the stored context
    kv_paths = common.kv_paths(args)
    if args.context and not (kv_paths or args.store):
        raise ValueError(f"--context {args.context} needs the store it was saved to: pass the same --kv-path (or --store)")
    with contextlib.ExitStack() as stack:
        kv = kv_paths or stack.enter_context(common.scratch_kv(None))
        engine = stack.enter_context(Engine.from_pretrained(args.model, kv_path=kv, config=args.config,
                                                            policy=args.policy, device=args.device,
                                                            dtype=args.dtype))
        if args.context or args.store:
            engine.open_context_store(common.store_location(args))
        results = engine.generate(
            prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, context=args.context,
        )
    if results and results[0].stats.get("synthetic_weights"):
        print(f"edgekv generate: {args.model} has synthetic weights (random): its text means nothing; time it, "
              "do not read it", file=sys.stderr)
    for result in results:
        if args.json:
            print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason, "stats": result.stats}))
        else:
            print(result.text)
    return 0
