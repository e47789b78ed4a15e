"""`edgekv serve` fuzzed from its own OpenAPI schema beside running streams, and /metrics under random paths,
with the server run as a user runs it (the CLI, a child process).

    .venv/bin/python -m tests.harness.serve_fuzz --model smollm2 --requests 2000 --paths 10000 \\
        --json docs/results/faults/serve-fuzz-smollm2.json
    .venv/bin/python -m tests.harness.serve_fuzz --config deploy/local/config.json ...   (what users serve)

1. The server starts with a key (from a file), ``--openapi`` and 6 batch rows of 1024 tokens (or the ``--config``
   given); the schema is read from its /openapi.json.
2. Well-formed streams (a greedy completion, a seeded sampled one, a greedy chat when the model has a chat
   template, and the eight greedy streams of ``CANCEL_BURST``) run alone: their texts are the reference.
3. While those streams run again and again, ``--requests`` fuzzed requests (schemathesis: schema-valid and
   schema-violating cases of every operation, half of them aimed at the served model with a short budget) go out
   from one client, the hostile list (refused fields, extreme values, malformed and oversized bodies, lone
   surrogates, prompts of 1 to 3 tokens, the absolute-form target, clients that leave early) from two more, and
   bursts of the eight streams started together, four of them closed after their first chunk, from another.
   Every fuzzed answer goes through schemathesis' checks (no 5xx; status, content type and body as declared;
   schema-violating data refused; the key never skipped); no body may carry a traceback; every stream's text,
   and every burst stream's left open, is compared with its lone run.
4. /metrics is read, ``--paths`` requests to random paths follow (random methods, with and without the key,
   up to 2 KB long), and /metrics is read again: its size must stay within 5 %.
5. SIGTERM: the server must exit 0 and leave no sequence's KV file.

The helpers (the schema's strategy, the checks, the hostile list, a stream's text, a cancel burst) are shared
with tests/test_serve_isolation.py, which runs a bounded version in ``make test``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.serve_load import free_port, start_server, wait_healthy

CHANGE_TOLERANCE = 0.05  # /metrics may grow by the digits of its counters, not by series
TRACEBACK = "Traceback (most recent call last)"  # what no body may carry: the server's log keeps its tracebacks
# eight greedy streams started together, half of them closed after their first chunk: the others' texts must be
# their lone runs' whatever joins, finishes and leaves beside them
SHORT_PROMPTS = ("hi", "The capital of", [1], [1, 2], [1, 2, 3])  # 1 to 3 tokens: shorter than a group of 4
CANCEL_BURST = [f"Once upon a time in a small village, there lived a {who}" for who in
                ("baker", "farmer", "king", "witch", "dragon", "sailor", "poet", "thief")]


# ---- shared with the tests -----------------------------------------------------------------------------


def fuzz_strategy(schema: dict):
    """Schema-valid and schema-violating requests for every operation of an OpenAPI schema."""
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    operations = schemathesis.openapi.from_dict(schema).get_all_operations()
    return st.one_of([op.ok().as_strategy(mode) for op in operations
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])


def steer(case, model: str, max_tokens: int) -> None:
    """Point a generated body at the served model with a budget of at most ``max_tokens``, so it reaches the
    scheduler (a random model name is a 404 before it) and ends soon (a chat without one runs to max_context)."""
    if isinstance(case.body, dict):
        case.body["model"] = model
        budgets = [n for n in ("max_tokens", "max_completion_tokens")
                   if isinstance(case.body.get(n), int) and not isinstance(case.body[n], bool)]
        for name in budgets:
            case.body[name] = 1 + case.body[name] % max_tokens
        if not budgets:
            case.body["max_tokens"] = max_tokens


def fuzz_checks(case=None, steered: bool = False) -> list:
    """schemathesis' checks for a case's answer.  A schema-violating case that ``steer`` changed may have been
    repaired by it (a missing model put back): its acceptance is not checked, every other check is."""
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, ignored_auth, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              ignored_auth]
    if not (steered and case is not None and case.meta.generation.mode == GenerationMode.NEGATIVE):
        checks.append(negative_data_rejection)
    return checks


def stream_text(url: str, body: dict, path: str = "/v1/completions", headers: dict | None = None,
                timeout_s: float = 300) -> tuple[int, str]:
    """(status, the streamed text) of a request; a stream that does not end in its finish chunk and [DONE], or
    carries an error event, raises: it is not a whole text."""
    with httpx.Client(timeout=timeout_s) as client:
        r = client.post(url + path, json={**body, "stream": True}, headers=headers or {})
    if TRACEBACK in r.text:
        raise AssertionError(f"a traceback in a body: {r.text[-300:]}")
    if r.status_code != 200:
        return r.status_code, r.text
    events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
    if events[-1] != "[DONE]":
        raise AssertionError(f"a stream ended without [DONE]: {events[-2:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        raise AssertionError(f"a stream ended with an error event: {chunks[-1]}")
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return 200, "".join(ch.get("text") or ch.get("delta", {}).get("content") or "" for ch in choices)


def _ascii_json(body: dict) -> bytes:
    """A body as JSON escapes it: a lone surrogate as \\ud800 (UTF-8 cannot encode it, so no client sends it raw)."""
    return json.dumps(body, ensure_ascii=True).encode()


def hostile_requests(model: str) -> list[tuple[str, object]]:
    """(path, JSON body or raw bytes): every refused field, extreme values, malformed and oversized bodies, text
    UTF-8 cannot encode, prompts of 1 to 3 tokens (shorter than a group), requests in the absolute form (a path
    'http://{authority}/...': ``send_hostile`` fills in the server's authority, or names another one)."""
    base = {"model": model, "prompt": [5, 6, 7], "max_tokens": 3}
    refused = [{"frequency_penalty": 1.5}, {"presence_penalty": -2}, {"logprobs": 3}, {"top_logprobs": 2},
               {"logit_bias": {"5": 100}}, {"echo": True}, {"best_of": 3}, {"suffix": "x"}, {"n": 4},
               {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"response_format": {"type": "json_object"}},
               {"stream_options": {"include_usage": True}}, {"bogus": 1}, {"max_tokens": 10**30}, {"max_tokens": 0},
               {"temperature": 1e308}, {"temperature": -1e-300}, {"top_p": 0}, {"top_k": -1}, {"seed": 2**63},
               {"prompt": [10**9]}, {"prompt": [-1]}, {"prompt": ""}, {"prompt": [[]]}, {"prompt": [1, True]},
               {"stop": ["a", "b", "c", "d", "e"]}, {"model": "someone-else"}, {"n": 1.0}]
    extreme = [{"temperature": t} for t in (1e-40, 1e-300, 5e-324, 1e-5, 2)] + [
        {"top_p": 5e-324, "temperature": 1.5}, {"top_p": 1e-300}, {"top_k": 2**62, "temperature": 2},
        {"top_k": 1, "temperature": 2}, {"seed": 2**63 - 1, "temperature": 1}, {"seed": 0, "temperature": 1e-30},
        {"max_tokens": 1}, {"prompt": "\u0000\ud7ff 🙂" * 20}, {"stop": ["\x00", "🙂"]}, {"temperature": -0.0}]
    bodies = [("/v1/completions", {**base, **x}) for x in refused + extreme]
    bodies += [("/v1/completions", {**base, **x, "stream": True}) for x in extreme[:6]]
    bodies += [("/v1/chat/completions", {"model": model, "messages": m, "max_tokens": 2, "temperature": 1e-40})
               for m in ([{"role": "user", "content": "hi"}], [{"role": "wizard", "content": "x"}], [],
                         [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])]
    bodies += [("/v1/completions", raw) for raw in (b"{", b"[]", b"null", b'{"model": 1}', b"\xff\xfe",
                                                      b'{"model": "%s", "prompt": "' % model.encode() + b"a" * 5_000_000)]
    short = [{"prompt": p} for p in SHORT_PROMPTS]
    bodies += [("/v1/completions", {**base, **x, "temperature": 0}) for x in short]
    bodies += [("/v1/completions", {**base, **x, "stream": True}) for x in short[:2]]
    lone = "\ud800"
    bodies += [("/v1/completions", _ascii_json({**base, **x})) for x in (
        {"prompt": f"ab{lone}c"}, {"prompt": [f"x{lone}"]}, {"stop": [f"x{lone}"]}, {"prompt": "\udfff", "stream": True})]
    chat = {"model": model, "max_tokens": 2}
    bodies += [("/v1/chat/completions", _ascii_json({**chat, "messages": m})) for m in (
        [{"role": "user", "content": f"hello{lone}"}], [{"role": "user", "content": [{"type": "text", "text": lone}]}])]
    bodies += [("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": []}]})]
    bodies += [("http://{authority}/health", None), ("HTTP://{authority}/v1/models", None),
               ("http://{authority}/v1/completions", {**base, "prompt": "hi"}), ("http://evil.example/health", None)]
    return bodies


def send_absolute(url: str, target: str, body: dict | None, headers: dict) -> tuple[int, str]:
    """One request whose target is in the absolute form (RFC 9112 3.2.2), over a plain socket (clients send the
    origin form only): a GET, or a POST of ``body``; (status, body text)."""
    authority = url.removeprefix("http://")
    host, port = authority.split(":")
    data = b"" if body is None else json.dumps(body).encode()
    lines = [f"{'GET' if body is None else 'POST'} {target.format(authority=authority)} HTTP/1.1",
             f"Host: {authority}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, text = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), text.decode("utf-8", "replace")


def send_hostile(url: str, path: str, body, kind: int, headers: dict | None = None) -> tuple[int | None, str]:
    """One hostile request: (status, the body as far as it was read); ``kind`` 1 leaves a stream after its first
    event, 2 leaves a whole answer before it comes (None: the client left).  A request in the absolute form is sent
    whole whatever ``kind``."""
    headers = headers or {}
    if path.lower().startswith("http://"):
        return send_absolute(url, path, body, headers)
    with httpx.Client(timeout=httpx.Timeout(60, read=0.05 if kind == 2 else 60)) as client:
        if kind == 1 and not isinstance(body, bytes):
            with client.stream("POST", url + path, json={**body, "stream": True}, headers=headers) as r:
                return None, next(r.iter_lines(), "")
        raw = {"content": body, "headers": {**headers, "content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body, "headers": headers}
        try:
            r = client.post(url + path, **raw)
            return r.status_code, r.text
        except httpx.ReadTimeout:
            if kind != 2:
                raise
            return None, ""  # it left before the answer came (a malformed body's too: a loaded server answers later)


def cancel_burst(url: str, model: str, leave: set[int], headers: dict | None = None) -> dict[int, tuple[int, str]]:
    """The CANCEL_BURST streams started together; those in ``leave`` close after their first chunk (their clients
    gone), the others are read to the end: {index: (status, text)} of those, status None where the stream failed."""
    start, kept = threading.Barrier(len(CANCEL_BURST)), {}

    def one(i: int) -> None:
        body = burst_body(model, i, i in leave)
        start.wait(60)
        try:
            if i in leave:
                send_hostile(url, "/v1/completions", body, 1, headers)
            else:
                kept[i] = stream_text(url, body, headers=headers)
        except Exception as exc:  # not a whole text: what the caller counts as failed
            kept[i] = (None, f"{type(exc).__name__}: {str(exc)[:300]}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(CANCEL_BURST))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return kept


def burst_body(model: str, i: int, leaves: bool = False) -> dict:
    """A stream its client leaves asks for 200 tokens: it is still running when the client goes."""
    return {"model": model, "prompt": CANCEL_BURST[i], "max_tokens": 200 if leaves else 16, "temperature": 0}


# ---- the run ---------------------------------------------------------------------------------------------


def post(url: str, path: str, headers: dict, body: dict) -> int:
    return httpx.post(url + path, headers=headers, json=body, timeout=300).status_code


def victims(model: str, has_chat: bool) -> list[tuple[str, dict]]:
    out = [("/v1/completions", {"model": model, "prompt": "The river runs north and the key is", "max_tokens": 64,
                                "temperature": 0}),
           ("/v1/completions", {"model": model, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0.8,
                                "top_p": 0.95, "seed": 4})]
    if has_chat:
        out.append(("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Name a river."}],
                                             "max_tokens": 40, "temperature": 0}))
    return out


def fuzz(url: str, schema: dict, model: str, requests: int, seed: int, headers: dict, record) -> None:
    """``requests`` schemathesis cases sent one after another; each outcome goes to ``record(status, failure, case,
    body)``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fix_seed
    from hypothesis import strategies as st
    from schemathesis.core.failures import FailureGroup

    @fix_seed(seed)
    @settings(max_examples=requests, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=fuzz_strategy(schema), aimed=st.booleans())
    def one(case, aimed):
        if aimed:
            steer(case, model, 24)
        try:
            response = case.call(base_url=url, headers=headers, timeout=120)
        except Exception as exc:  # a hung or dropped request: recorded, the run goes on
            record(None, f"no answer: {type(exc).__name__}: {exc}", case)
            return
        try:
            case.validate_response(response, checks=fuzz_checks(case, aimed), headers=headers)
            record(response.status_code, None, case, response.text)
        except (Exception, FailureGroup) as exc:  # FailureGroup is a BaseExceptionGroup, not an Exception
            record(response.status_code, f"{type(exc).__name__}: {str(exc)[:300]}", case, response.text)

    one()


def metrics_under_random_paths(url: str, paths: int, headers: dict, rng: random.Random) -> dict:
    with httpx.Client(timeout=30) as client:
        for _ in range(3):  # every label this phase can create exists before the first reading
            client.get(f"{url}/{uuid.uuid4().hex}")
            client.get(url + "/metrics", headers=headers)
        before = len(client.get(url + "/metrics", headers=headers).content)
        for i in tqdm(range(paths), desc="random paths", unit="req"):
            path = "/".join(uuid.uuid4().hex[: rng.randint(1, 32)] for _ in range(rng.randint(1, 60)))
            client.request(rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH"]), f"{url}/{path}?i={i}",
                           headers=headers if i % 2 else {})
        after = len(client.get(url + "/metrics", headers=headers).content)
    return {"paths": paths, "before_bytes": before, "after_bytes": after, "ratio": after / before,
            "bounded": abs(after / before - 1) <= CHANGE_TOLERANCE}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="what the server serves (default: the --config's model, else fixture)")
    ap.add_argument("--config", help="serve this deployed config.json (deploy/PLATFORM/config.json: its solutions, "
                                     "rows and model) where the run's own is 6 rows of 1024 tokens")
    ap.add_argument("--requests", type=int, default=2000, help="schemathesis cases sent")
    ap.add_argument("--paths", type=int, default=10000, help="requests to random paths before /metrics is re-read")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    rng, started = random.Random(args.seed), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgekv-fuzz-") as tmp:
        tmp = Path(tmp)
        key = uuid.uuid4().hex
        (tmp / "key").write_text(key + "\n")
        headers = {"Authorization": f"Bearer {key}"}
        (tmp / "kv").mkdir()
        config = Path(args.config) if args.config else tmp / "config.json"
        if not args.config:
            config.write_text(json.dumps({"max_batch": 6, "max_context": 1024}))
        served = args.model or (json.loads(config.read_text())["model"] if args.config else "fixture")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(served, tmp / "kv", port, tmp / "server.log",
                              ["--config", str(config), "--api-key-file", str(tmp / "key"), "--openapi"])
        try:
            wait_healthy(url, server, tmp / "server.log")
            schema = httpx.get(url + "/openapi.json", headers=headers).json()
            model = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
            if post(url, "/v1/completions", headers, {"model": model, "prompt": "hi", "max_tokens": 1}) != 200:
                raise SystemExit(f"{args.model} has no tokenizer: its streams carry no text to compare; fuzz a model "
                                 "with one (smollm2, or a folder with tokenizer files)")
            has_chat = post(url, "/v1/chat/completions", headers, {
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}) == 200
            wanted = victims(model, has_chat)
            alone = [stream_text(url, body, path, headers) for path, body in wanted]
            burst_alone = [stream_text(url, burst_body(model, i), headers=headers) for i in range(len(CANCEL_BURST))]
            report = run_interleaved(url, schema, model, wanted, alone, burst_alone, args, headers)
            report["metrics"] = metrics_under_random_paths(url, args.paths, headers, rng)
            report["health_after"] = httpx.get(url + "/health").status_code
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(120)
            except Exception:
                server.kill()
                code = server.wait()
        left = [str(p) for p in (tmp / "kv").rglob("*") if p.is_file() and "contexts" not in p.parts]
        report["shutdown"] = {"exit_code": code, "kv_files_left": left}
    report.update(model=served, config=args.config or {"max_batch": 6, "max_context": 1024}, seed=args.seed,
                  wall_s=round(time.monotonic() - started, 1), machine=f"{os.cpu_count()} cores, no GPU")
    streams, bursts = report["streams"], report["cancel_bursts"]
    ok = (report["status_500"] == 0 and report["tracebacks_in_bodies"] == 0 and streams["changed"] == 0
          and streams["failed"] == 0 and bursts["changed"] == 0 and bursts["failed"] == 0
          and report["metrics"]["bounded"] and code == 0 and not left)
    report["targets_met"] = ok
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0 if ok else 1


def run_interleaved(url, schema, model, wanted, alone, burst_alone, args, headers) -> dict:
    statuses: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()
    examples: list[dict] = []
    streams = {"runs": 0, "changed": 0, "failed": 0, "changes": []}
    bursts = {"bursts": 0, "kept_streams": 0, "left_streams": 0, "changed": 0, "failed": 0, "changes": []}
    hostile_statuses: collections.Counter = collections.Counter()
    tracebacks: list[str] = []
    lock, fuzzing = threading.Lock(), threading.Event()
    fuzzing.set()
    bar = tqdm(total=args.requests, desc="fuzzed requests", unit="req")

    def record(status, failure, case, body=""):
        with lock:
            statuses[str(status)] += 1
            if TRACEBACK in body:
                tracebacks.append(f"{case.method} {case.path}: {body[-200:]}")
            if failure is not None:
                failures[failure.split(":")[0] + ": " + failure.split(":")[1][:80] if ":" in failure else failure] += 1
                if len(examples) < 20:
                    examples.append({"status": status, "failure": failure, "method": case.method, "path": case.path,
                                     "body": repr(case.body)[:300]})
        bar.update()

    def stream_loop(j):
        path, body = wanted[j]
        while fuzzing.is_set():
            try:
                got = stream_text(url, body, path, headers)
            except Exception as exc:
                with lock:
                    streams["failed"] += 1
                    streams["changes"].append({"victim": j, "error": str(exc)[:300]})
                continue
            with lock:
                streams["runs"] += 1
                if got != alone[j]:
                    streams["changed"] += 1
                    streams["changes"].append({"victim": j, "got": got[1][:200], "alone": alone[j][1][:200]})

    def hostile_loop(offset):
        hostile, i = hostile_requests(model), offset
        while fuzzing.is_set():
            path, body = hostile[i % len(hostile)]
            status, text = send_hostile(url, path, body, i % 3, headers)
            with lock:
                hostile_statuses[str(status)] += 1
                if TRACEBACK in text:
                    tracebacks.append(f"{path}: {text[-200:]}")
            i += 1

    def cancel_loop():
        rng = random.Random(args.seed)
        while fuzzing.is_set():
            leave = set(rng.sample(range(len(CANCEL_BURST)), len(CANCEL_BURST) // 2))
            kept = cancel_burst(url, model, leave, headers)
            with lock:
                bursts["bursts"] += 1
                bursts["left_streams"] += len(leave)
                for i, got in kept.items():
                    bursts["kept_streams"] += 1
                    if got[0] is None:
                        bursts["failed"] += 1
                        bursts["changes"].append({"prompt": i, "error": got[1]})
                    elif got != burst_alone[i]:
                        bursts["changed"] += 1
                        bursts["changes"].append({"prompt": i, "left": sorted(leave), "got": got[1][:200],
                                                  "alone": burst_alone[i][1][:200]})

    threads = [threading.Thread(target=stream_loop, args=(j,)) for j in range(len(wanted))]
    threads += [threading.Thread(target=hostile_loop, args=(k * 17,)) for k in range(2)]
    threads.append(threading.Thread(target=cancel_loop))
    for t in threads:
        t.start()
    try:
        fuzz(url, schema, model, args.requests, args.seed, headers, record)
    finally:
        fuzzing.clear()
        for t in threads:
            t.join(600)
        bar.close()
    fuzzed = sum(statuses.values())
    return {"fuzzed_requests": fuzzed, "hostile_requests": sum(hostile_statuses.values()),
            "statuses": dict(statuses), "hostile_statuses": dict(hostile_statuses),
            "status_500": statuses.get("500", 0) + hostile_statuses.get("500", 0),
            "check_failures": dict(failures), "failure_examples": examples, "tracebacks": tracebacks[:20],
            "tracebacks_in_bodies": len(tracebacks),
            "streams": streams, "cancel_bursts": bursts, "reference_texts": [a[1][:200] for a in alone]}


if __name__ == "__main__":
    sys.exit(main())
