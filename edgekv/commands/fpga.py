"""`edgekv fpga selftest`: the in-storage scoring kernel against the numpy reference."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

NAME = "fpga"


def add(sub) -> None:
    fp = sub.add_parser("fpga", help="the in-storage scoring kernel")
    fp_sub = fp.add_subparsers(dest="fpga_command", required=True)
    st = fp_sub.add_parser("selftest", help="random cases against the numpy reference")
    st.add_argument("--backend", default="csim", choices=["csim", "xrt"])
    st.add_argument("--cases", type=int, default=50)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--json")
    st.set_defaults(func=run)


def run(args) -> int:
    from edgekv.platforms.smartssd import selftest

    with tempfile.TemporaryDirectory() as tmp:
        result = selftest(args.backend, args.cases, args.seed, Path(tmp))
    result["bytes_ratio"] = result["bytes_to_host"] / max(1, result["bytes_host_scoring_would_read"])
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["topk_agreement"] == 1.0 else 1
