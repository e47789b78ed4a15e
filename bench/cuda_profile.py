"""Where a decode step of ``synth:llama-3.1-8b`` spends its time on a GPU: torch.profiler over two steps of full
and of kvswap at one context, batch 1, after a few unprofiled steps (their mean is printed too).

    python -m bench.cuda_profile --context 16384 --kv-path /tmp/ekv
"""
import argparse
import gc
import tempfile
import time

import torch
from edgekv.runtime import Engine
from torch.profiler import ProfilerActivity, profile

POLICIES = (("full", {}), ("kvswap", {"G": 8, "M": 50, "C": 50, "sigma": 16}))  # kvswap: the bench's 16K, 1/13 fit


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synth:llama-3.1-8b")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--kv-path", default=None, help="a folder on the KV disk (default: the system temp dir)")
    args = ap.parse_args(argv)
    prompt = [(i * 7919) % 120000 + 10 for i in range(args.context - 64)]
    for policy, cfg in POLICIES:
        with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
                args.model, kv_offload_path=kv, config={"max_context": args.context, "max_batch": 1, **cfg},
                policy=policy, device="cuda") as engine:
            batch = engine.open_batch(1, args.context)
            started = time.perf_counter()
            batch.join(0, prompt)
            batch.end_prefill()
            torch.cuda.synchronize()
            print(f"== {policy}: prefill {time.perf_counter() - started:.1f} s")
            token = torch.tensor([5])
            with batch:
                for _ in range(3):
                    batch.step(token)
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(4):
                    batch.step(token)
                torch.cuda.synchronize()
                print(f"  step {1e3 * (time.perf_counter() - started) / 4:.1f} ms (no profiler)")
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        batch.step(token)
                    torch.cuda.synchronize()
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
