"""Where a decode step spends its time: torch.profiler over two steps of full and of kvswap at one context, batch 1,
after a few unprofiled steps (their mean is printed too), on a GPU or the CPU.

    python -m bench.step_profile --context 16384 --kv-path /tmp/ekv        # synth:llama-3.1-8b on the GPU
    python -m bench.step_profile --model smollm2 --device cpu --context 8192 --kvswap G=4,M=100,C=100,sigma=32
    python -m bench.step_profile --model smollm2 --device cpu --context 8192 --kvswap G=4,M=100,C=100,sigma=32 --weights int4
    python -m bench.step_profile --model smollm2 --device cpu --context 8192 --weights int4 --dtype bfloat16 \
        --kvswap G=4,M=205,C=205,sigma=2,klr_dtype=int8,correction=corrected,correction_reads=52,score_reduce=softmax,reuse=false,correction_recall=0.85,guess_from_before=true,io_align_bytes=4096
"""
import argparse
import gc
import tempfile
import time

import torch
from edgekv.runtime import Engine
from torch.profiler import ProfilerActivity, profile

KVSWAP = "G=8,M=50,C=50,sigma=16"  # the bench's fit for synth:llama-3.1-8b at 16K, 1/13 on the H100


def fields(text: str) -> dict:
    """``G=8,M=50,sigma=16,klr_dtype=int8,reuse=false`` -> {"G": 8, "M": 50, "sigma": 16.0, "klr_dtype": "int8",
    "reuse": False}: numbers, true/false, and any other value as text."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif value.replace(".", "", 1).isdigit():
            out[key] = float(value) if "." in value or key == "sigma" else int(value)
        else:
            out[key] = value
    return out


def prefilled(engine: Engine, context: int, rows: int = 1, room: int = 64):
    """A batch of ``rows`` sequences ready to decode: prompts leaving ``room`` positions, of ids every model has (the
    fixture's vocabulary is small), a different one a row."""
    ids = min(30000, engine.model.dims.vocab - 10)
    batch = engine.open_batch(rows, context)
    for row in range(rows):
        batch.join(row, [(i * 7919 + row * 104729) % ids + 10 for i in range(context - room)])
    batch.end_prefill()
    return batch


def step_ms(batch, token: torch.Tensor, steps: int) -> float:
    """Milliseconds a decode step of ``batch``, over ``steps`` steps after one untimed one (the first after another
    row's steps or a new setting pays for the switch)."""
    batch.step(token)
    started = time.perf_counter()
    for _ in range(steps):
        batch.step(token)
    return (time.perf_counter() - started) / steps * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synth:llama-3.1-8b")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--kv-path", default=None, help="a folder on the KV disk (default: the system temp dir)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kvswap", default=KVSWAP, help="the kvswap row's geometry")
    ap.add_argument("--weights", default=None, help="the linear layers' format (runtime/weights.py; default native)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the device's, runtime/devices.py)")
    args = ap.parse_args(argv)
    gpu = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    for policy, cfg in (("full", {}), ("kvswap", fields(args.kvswap))):
        with tempfile.TemporaryDirectory(dir=args.kv_path) as kv, Engine.from_pretrained(
                args.model, kv_offload_path=kv, config={"max_context": args.context, "max_batch": 1, **cfg},
                policy=policy, device=args.device, dtype=args.dtype, weights=args.weights) as engine:
            started = time.perf_counter()
            batch = prefilled(engine, args.context)
            sync()
            print(f"== {policy}: prefill {time.perf_counter() - started:.1f} s")
            token = torch.tensor([5])
            with batch:
                for _ in range(3):
                    batch.step(token)
                sync()
                started = time.perf_counter()
                for _ in range(4):
                    batch.step(token)
                sync()
                print(f"  step {1e3 * (time.perf_counter() - started) / 4:.1f} ms (no profiler)")
                with profile(activities=activities) as prof:
                    for _ in range(2):
                        batch.step(token)
                    sync()
        for key in ("self_cuda_time_total", "self_cpu_time_total") if gpu else ("self_cpu_time_total",):
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
