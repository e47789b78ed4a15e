"""`edgekv deploy`: profile this machine, solve the runtime parameters, smoke-generate."""
from __future__ import annotations

import json

from edgekv.commands import common

NAME = "deploy"
KV_FOLDERS = "created"  # deploy creates the KV folders it is given


def add(sub) -> None:
    from edgekv.runtime.checkpoints import MODEL_HELP

    dep = sub.add_parser("deploy", help="profile this machine, solve the runtime parameters, run a smoke generation")
    dep.add_argument("--platform", default="auto", help="auto (detect), local, orin, rtx, smartssd, or a profile YAML")
    dep.add_argument("--model", help=MODEL_HELP + " (default: the profile's model)")
    dep.add_argument("--kv-path", help="folder for the KV cache (default: the profile's kv.paths)")
    dep.add_argument("--kv-paths", metavar="DIR1,DIR2,...", help="folders on several disks for the KV cache, each "
                                                                 "profiled (default: the profile's kv.paths)")
    dep.add_argument("--reprofile", action="store_true", help="measure again even when a cached profile matches")
    dep.add_argument("--profile-only", action="store_true", help="profile and write the report; no solve, no smoke run")
    dep.add_argument("--disk-seconds", type=float,
                     help="time for the disk profile of each KV path (default: the profile's)")
    dep.add_argument("--calibration", metavar="TEXT_FILE",
                     help="text for the lookup tables (reuse rate, adapters); default: the retrieval-task corpus")
    dep.add_argument("--device", choices=("cpu", "cuda"),
                     help="compute on this device instead of the profile's (cpu: deploy a GPU profile on the CPU)")
    dep.set_defaults(func=run)


def run(args) -> int:
    from edgekv import deploy as deploy_impl

    result = deploy_impl.run(args.platform, args.model, common.kv_paths(args, must_exist=False),
                             reprofile=args.reprofile, profile_only=args.profile_only, disk_seconds=args.disk_seconds,
                             calibration=args.calibration, device=args.device)
    chat = result.get("chat")
    if chat:
        answer = "\\n".join(chat["answer"].splitlines())  # one line whatever the model wrote: the stats stay last
        print(f"chat (the deployed configuration): {chat['question']}\n  -> {answer}")
    if result.get("stats"):
        print(json.dumps(result["stats"]))  # the last line: the smoke generation's stats
    return 0
