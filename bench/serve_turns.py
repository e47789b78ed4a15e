"""A multi-turn chat against `edgekv serve` through the official openai client, with and without the context store.

    .venv/bin/python -m bench.serve_turns --model smollm2 --turns 4 --json docs/results/serve-turns-smollm2.json

For each setting a fresh server (the CLI, a child process) answers the same conversation: a long first user
message (a document and a question), then short follow-ups.  Per turn: prompt tokens, tokens whose KV came from
the store (the server's /metrics), TTFT (streamed: send to first content) and the reply.  Each turn is asked
twice with one seed, streamed and whole: the two texts must be equal.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.serve_load import free_port, metric, start_server, wait_healthy

DOCUMENT = ("The river Alder rises in the northern hills and flows south for ninety kilometres. " * 40
            + "The harbour master of the town at its mouth is named Ilse Varga. ")
TURNS = ["{doc}\nWho is the harbour master of the town at the river's mouth?", "How long is the river?",
         "Where does it rise?", "Summarise the document in one sentence.", "Name one thing it does not say."]


def converse(url: str, model: str, turns: int, max_tokens: int) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages, rows = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": TURNS[i % len(TURNS)].format(doc=DOCUMENT)})
        stored_before = metric(httpx.get(url + "/metrics").text, "edgekv_prompt_tokens_from_store_total")
        ask = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0.7, seed=1234)
        sent, first, parts, usage = time.perf_counter(), None, [], None
        for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        ended = time.perf_counter()
        stored = metric(httpx.get(url + "/metrics").text, "edgekv_prompt_tokens_from_store_total") - stored_before
        whole = client.chat.completions.create(**ask)
        reply = "".join(parts)
        rows.append({"turn": i + 1, "prompt_tokens": usage.prompt_tokens, "from_store_tokens": int(stored),
                     "completion_tokens": usage.completion_tokens, "ttft_s": round(first - sent, 3) if first else None,
                     "total_s": round(ended - sent, 3), "stream_equals_whole": reply == whole.choices[0].message.content,
                     "reply": reply[:160]})
        messages.append({"role": "assistant", "content": reply})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "reply"}), flush=True)
        time.sleep(1.0)  # the store writer keeps the prompt in the background: let it land before the next turn
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--config", help="a runtime config for the server (default: the runtime's defaults)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    report = {"command": "python -m bench.serve_turns " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "runs": {}}
    for store in (True, False):
        with tempfile.TemporaryDirectory(prefix="edgekv-turns-", dir="/var/tmp") as tmp:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            extra = [*(["--config", args.config] if args.config else []), *([] if store else ["--no-context-store"])]
            server = start_server(args.model, Path(tmp), port, Path(tmp) / "serve.log", extra)
            try:
                wait_healthy(url, server, Path(tmp) / "serve.log")
                model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                print(f"context store {'on' if store else 'off'}:", flush=True)
                report["runs"]["store" if store else "no_store"] = converse(url, model_id, args.turns, args.max_tokens)
            finally:
                server.terminate()
                server.wait(120)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
