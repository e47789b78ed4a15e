"""Tokens, reads and stats keys of every policy and its main switches on the fixture: run it in two checkouts
and compare the JSON files, to show a refactor changed no token.

    .venv/bin/python -m bench.policy_tokens out.json
"""
import json
import logging
import sys
import tempfile

from edgekv.runtime import Engine

logging.disable(logging.WARNING)
CASES = [("kvswap", {}), ("kvswap", {"selector": "oracle", "sigma": 1, "score_reduce": "softmax"}),
         ("kvswap", {"selector": "random"}), ("kvswap", {"reuse": False}),
         ("kvswap", {"sink_tokens": 4, "window_tokens": 8}),
         ("kvswap", {"clustering": True, "recluster_steps": 4}), ("kvswap", {"kv_record_dtype": "int8"}),
         ("kvswap", {"replacement": "cost", "clustering": True}), ("kvswap", {"klr_dtype": "int8"}),
         ("full", {}), ("flexgen", {}), ("token", {}), ("hillinfer", {}), ("arkv", {"max_kv_mem_mib": 3}),
         ("arkv", {"max_kv_mem_mib": 6, "arkv_quant": "int4"})]


def main(path: str) -> None:
    out = []
    prompts = [[(i * 7) % 250 + 4 for i in range(300)], [(i * 13) % 250 + 4 for i in range(210)],
               [7] * 64 + [(i * 11) % 250 + 4 for i in range(200)]]
    for policy, extra in CASES:
        cfg = {"max_context": 512, "G": 4, "M": 24, "C": 48, "max_batch": 3, **extra}
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            paths = [a, b] if extra.get("clustering") else a
            with Engine.from_pretrained("fixture", kv_path=paths, config=cfg, policy=policy, device="cpu") as e:
                rs = e.generate(prompts, max_new_tokens=24, stop_token_ids=[])
        out.append({"policy": policy, "extra": extra, "tokens": [r.token_ids for r in rs],
                    "keys": sorted(rs[0].stats), "reads": [r.stats["kv_bytes_read"] for r in rs],
                    "reuse": [r.stats["reuse_hits"] for r in rs], "resident": rs[0].stats["kv_resident_bytes"],
                    "config": rs[0].stats["config"]})
    with open(path, "w") as f:
        json.dump(out, f, indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
