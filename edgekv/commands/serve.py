"""`edgekv serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import logging

from edgekv.commands import common
from edgekv.commands.common import KV_PATHS_HELP, POLICY_HELP

NAME = "serve"


def add(sub) -> None:
    from edgekv.runtime.checkpoints import MODEL_HELP

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching over the deployed config)")
    where = srv.add_mutually_exclusive_group()
    where.add_argument("--platform", help="serve deploy/PLATFORM/config.json (auto: the platform detected here)")
    where.add_argument("--config", help="a deployed config.json (its model and KV folders are the defaults)")
    srv.add_argument("--model", help=MODEL_HELP + " (default: the config's model)")
    srv.add_argument("--kv-path", help="folder on the disk that holds the KV cache (default: the config's, else a "
                                       "temporary one)")
    srv.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help=KV_PATHS_HELP)
    srv.add_argument("--policy", default="kvswap", help=POLICY_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8080)
    keys = srv.add_mutually_exclusive_group()
    keys.add_argument("--api-key-file", metavar="FILE",
                      help="require 'Authorization: Bearer KEY' on every endpoint but /health, KEY being FILE's first "
                           "line (printable ASCII); or set $EDGEKV_API_KEY (default: no key)")
    keys.add_argument("--api-key", metavar="KEY", help="as --api-key-file, with the key on the command line, where "
                                                       "the process list shows it: prefer the file or the variable")
    srv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a batch row; more get 429")
    srv.add_argument("--max-body-mib", type=float, default=4.0, help="largest request body; larger get 413")
    srv.add_argument("--no-context-store", action="store_true",
                     help="do not keep prompts' KV in KV_PATH/contexts (multi-turn chats then prefill every turn whole)")
    srv.add_argument("--chunk-tokens", type=int, default=256, help="context store chunk size for a new store")
    srv.add_argument("--store-max-mib", type=float, default=1024.0, help="context store cap (least recently used "
                                                                          "chunks go first)")
    srv.add_argument("--served-model-name", nargs="+", metavar="NAME",
                     help="the model ids requests may name; the first is the one /v1/models lists (default: the "
                          "model's name, or its folder's)")
    srv.add_argument("--shutdown-grace-s", type=float, default=30.0,
                     help="on SIGTERM/SIGINT, seconds requests in flight get to finish")
    srv.add_argument("--max-connections", type=int, default=128,
                     help="open connections beyond this get 503 (a reverse proxy in front should cap per client)")
    srv.add_argument("--header-timeout-s", type=float, default=10.0,
                     help="a connection whose request headers take longer is closed")
    srv.add_argument("--body-timeout-s", type=float, default=60.0,
                     help="a request whose body takes longer to arrive gets 408")
    srv.add_argument("--allowed-hosts", metavar="NAME,...",
                     help="Host header names answered, '*' for any (default: localhost, 127.0.0.1, ::1 on a loopback "
                          "--host, else any)")
    srv.add_argument("--openapi", action="store_true", help="serve the OpenAPI schema at /openapi.json (behind the key)")
    common.add_compute_flags(srv)
    srv.set_defaults(func=run)


def run(args) -> int:
    from edgekv.serve import ServeOptions
    from edgekv.serve import run as serve

    config = args.config
    if args.platform:
        from edgekv.platforms.detect import detect_platform
        from edgekv.serve.server import deployed_config

        config = str(deployed_config(detect_platform() if args.platform in ("", "auto") else args.platform))
    kv_paths = common.kv_paths(args)
    logging.getLogger("edgekv").setLevel(logging.INFO)
    return serve(ServeOptions(
        model=args.model, config=config, kv_paths=kv_paths, policy=args.policy, host=args.host, port=args.port,
        api_key=args.api_key, api_key_file=args.api_key_file, max_queue=args.max_queue, max_body_mib=args.max_body_mib,
        context_store=not args.no_context_store, chunk_tokens=args.chunk_tokens, store_max_mib=args.store_max_mib,
        served_model_name=args.served_model_name, shutdown_grace_s=args.shutdown_grace_s,
        max_connections=args.max_connections, header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s, openapi=args.openapi, device=args.device, dtype=args.dtype,
        allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()] if args.allowed_hosts else None))
