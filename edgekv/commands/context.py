"""`edgekv context save|list|rm`: the context store."""
from __future__ import annotations

import json

from edgekv.commands import common

NAME = "context"
MEMORY = "the context file"  # what its memory grows with: named when it runs out
KV_FOLDERS = "created"  # the store's folder is created on save


def add(sub) -> None:
    from edgekv.runtime.checkpoints import MODEL_HELP

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
        p.set_defaults(func=run)


def run(args) -> int:
    from edgekv.runtime.store import ContextStore

    if args.action == "save":
        from edgekv.runtime import Engine

        context = common.read_prompt("context save FILE", args.file, from_file=True)
        with Engine.from_pretrained(args.model, config={"max_context": args.max_context}, policy="full") as engine:
            engine.open_context_store(common.store_location(args), chunk_tokens=args.chunk_tokens,
                                      max_bytes=int(args.max_mib * 2**20) if args.max_mib else None)
            stored = engine.save_context(context, name=args.name)
        print(json.dumps({"name": args.name, "stored_tokens": stored.n_tokens, "chunks": len(stored.chunks)}))
        return 0
    store = ContextStore.open_existing(common.store_location(args))
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
