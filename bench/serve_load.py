"""Load test of `edgekv serve` (issue 18), side by side with `edgekv bench` in one run.

    .venv/bin/python -m bench.serve_load --model fixture --clients 16 --duration-s 60 --batch 4 \\
        --prompt-tokens 2048 --max-tokens 256 --json docs/results/serve-load.json

1. ``edgekv bench``'s kvswap row at (batch, context = prompt + max_tokens / 2: the mean context a request decodes
   at), budget ``--budget``: its decode tok/s and the configuration the solver chose for it.
2. ``edgekv serve`` (the CLI, a child process) with that configuration, ``max_batch`` = batch, on 127.0.0.1.
3. ``--clients`` clients, each sending streamed completions back to back (random token ids, greedy, no stop)
   for ``--duration-s``; requests in flight then finish.  Every request must end with its usage and ``[DONE]``:
   anything else is an error, a request never answered is lost.
Reported: throughput (completion tokens / seconds from the first send to the last answer) against the bench's
decode rate, TTFT (send to first token, queue wait included) and inter-token latency percentiles (client
side), and the server's own /metrics (I/O stall share, reuse rate).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.model import ModelDims, read_model_config


def bench_row(model: str, kv: Path, batch: int, context: int, budget: str, steps: int) -> dict:
    from edgekv import bench

    runs, _ = bench.run(resolve_checkpoint(model), kv, [batch], [context], [budget], steps, 4, 5.0, [bench.TUNED_ROW],
                        quiet=True)
    row = next(r for r in runs if r.policy == bench.TUNED_ROW)
    return row.__dict__


def server_config(row: dict, batch: int, max_context: int) -> dict:
    keys = ("G", "M", "C", "sigma", "sink_tokens", "window_tokens", "klr_dtype", "kv_record_dtype")
    return {**{k: row[k] for k in keys if row.get(k) is not None}, "max_batch": batch, "max_context": max_context,
            "io_queue_depth": 32}


def start_server(model: str, kv: Path, port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    """``edgekv serve`` as a user runs it (the CLI, a child process) on 127.0.0.1, its output in ``log_path``."""
    command = [sys.executable, "-m", "edgekv.cli", "serve", "--model", model, "--kv-path", str(kv), "--host",
               "127.0.0.1", "--port", str(port), *extra]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, server: subprocess.Popen, log_path: Path, limit_s: float = 600.0) -> None:
    """Until /health answers 200; a server that exits or never gets there ends the run with its log's tail."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not come up: {Path(log_path).read_text()[-2000:]}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(client: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int) -> dict:
    sent = time.perf_counter()
    times, usage, done = [], None, False
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        first = True
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if first:  # the opening chunk carries no token
                first = False
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                times.append(time.perf_counter())
    if not done or usage is None:
        return {"error": "stream ended without usage and [DONE]"}
    return {"sent": sent, "ended": time.perf_counter(), "token_times": times, "tokens": usage["completion_tokens"]}


async def clients(url: str, model: str, n_clients: int, duration_s: float, prompt_tokens: int, max_tokens: int,
                  vocab: int, seed: int) -> tuple[list[dict], int]:
    rng = random.Random(seed)
    results, sent = [], 0
    stop_at = time.perf_counter() + duration_s
    bar = tqdm(total=int(duration_s), desc="load", unit="s", bar_format="{l_bar}{bar}| {n}/{total} s [{elapsed}<{remaining}]")

    async def client_loop(client):
        nonlocal sent
        while time.perf_counter() < stop_at:
            ids = [rng.randrange(vocab) for _ in range(prompt_tokens)]
            sent += 1
            try:
                results.append(await one_request(client, url, model, ids, max_tokens))
            except httpx.HTTPError as exc:
                results.append({"error": f"{type(exc).__name__}: {exc}"})

    async def ticker():
        start = time.perf_counter()
        while time.perf_counter() < stop_at:
            await asyncio.sleep(1)
            bar.n = min(int(time.perf_counter() - start), int(duration_s))
            bar.refresh()

    limits = httpx.Limits(max_connections=n_clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tick = asyncio.ensure_future(ticker())
        await asyncio.gather(*(client_loop(client) for _ in range(n_clients)))
        tick.cancel()
    bar.close()
    return results, sent


def percentiles(values, qs=(50, 99)) -> dict:
    if not len(values):
        return {f"p{q}": None for q in qs}
    return {f"p{q}": round(float(np.percentile(values, q)) * 1000, 2) for q in qs}


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def server_side(text: str, batch: int, bench_tok_s: float) -> dict:
    """The server's own split: decode steps alone (tokens after each request's first / decode seconds) beside the
    bench's decode rate, and how full its batch was (tokens per step / rows); prefill is the rest of the wall time."""
    steps, seconds = metric(text, "edgekv_decode_steps_total"), metric(text, "edgekv_decode_seconds_total")
    tokens = metric(text, "edgekv_generation_tokens_total") - metric(text, "edgekv_time_to_first_token_seconds_count")
    rate = tokens / seconds if seconds else 0.0
    return {"server_decode_tok_s": round(rate, 2), "server_decode_ratio_to_bench": round(rate / bench_tok_s, 3),
            "server_decode_s": round(seconds, 2), "batch_occupancy": round(tokens / steps / batch, 3) if steps else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="fixture")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--budget", default="1/13", help="the bench row's KV budget (fraction of the full cache)")
    ap.add_argument("--bench-steps", type=int, default=32)
    ap.add_argument("--kv-path", default=None)
    ap.add_argument("--no-context-store", action="store_true", help="the server keeps no prompt KV")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="edgekv-load-", dir=args.kv_path) as tmp:
        tmp = Path(tmp)
        context = args.prompt_tokens + args.max_tokens // 2
        print(f"edgekv bench: kvswap, batch {args.batch}, context {context}, budget {args.budget}", flush=True)
        row = bench_row(args.model, tmp, args.batch, context, args.budget, args.bench_steps)
        config = server_config(row, args.batch, args.prompt_tokens + args.max_tokens + 8)
        (tmp / "config.json").write_text(json.dumps(config))
        (tmp / "kv").mkdir()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(args.model, tmp / "kv", port, tmp / "serve.log",
                              ["--config", str(tmp / "config.json"), *(["--no-context-store"] if args.no_context_store else [])])
        try:
            wait_healthy(url, server, tmp / "serve.log")
            model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            vocab = ModelDims.from_config(read_model_config(resolve_checkpoint(args.model))).vocab
            results, sent = asyncio.run(clients(url, model_id, args.clients, args.duration_s, args.prompt_tokens,
                                                args.max_tokens, vocab, args.seed))
            metrics_text = httpx.get(url + "/metrics").text
        finally:
            server.send_signal(signal.SIGTERM)
            code = server.wait(120)
        leftover = [p for p in (tmp / "kv").rglob("*") if p.is_file() and "contexts" not in p.parts]

    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    span_s = max(r["ended"] for r in ok) - min(r["sent"] for r in ok) if ok else 0.0
    ttft = [r["token_times"][0] - r["sent"] for r in ok if r["token_times"]]
    itl = np.concatenate([np.diff(r["token_times"]) for r in ok if len(r["token_times"]) > 1] or [np.zeros(0)])
    throughput = tokens / span_s if span_s else 0.0
    report = {
        "command": "python -m bench.serve_load " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "clients": args.clients, "duration_s": args.duration_s, "batch": args.batch,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "context_store": not args.no_context_store,
        "requests_sent": sent, "requests_ok": len(ok), "errors": len(errors), "lost": sent - len(results),
        "error_examples": errors[:5], "completion_tokens": tokens, "span_s": round(span_s, 2),
        "throughput_tok_s": round(throughput, 2), "bench_decode_tok_s": round(row["decode_tok_s"], 2),
        "ratio_to_bench": round(throughput / row["decode_tok_s"], 3) if row["decode_tok_s"] else None,
        "ttft_ms": percentiles(ttft), "inter_token_ms": percentiles(itl),
        **server_side(metrics_text, args.batch, row["decode_tok_s"]),
        "server_io_stall_share": metric(metrics_text, "edgekv_io_stall_share"),
        "server_reuse_rate": metric(metrics_text, "edgekv_reuse_rate"),
        "server_exit_code": code, "kv_files_left": len(leftover),
        "bench_row": {k: row[k] for k in ("G", "M", "C", "sigma", "budget", "context", "step_ms", "reuse_rate",
                                          "io_stall_share")},
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if not errors and report["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
