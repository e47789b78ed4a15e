"""Probes of `edgekv serve` as a hostile client would send them (odd sampling beside a running stream, random paths,
missing or non-ASCII keys, slow headers and bodies, too many connections, bad fields and bodies), against the CLI
server; each row says what was sent and what came back (docs/results/faults/serve.md).

    .venv/bin/python -m tests.harness.serve_probe --model smollm2 --json docs/results/faults/serve-probe-smollm2.json

The server runs with a key from a file, ``--header-timeout-s 2 --body-timeout-s 2 --max-connections 16`` (short
deadlines so the probe is quick; the defaults are 10, 60 and 128).
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench.serve_load import free_port, start_server, wait_healthy
from tests.harness.serve_fuzz import stream_text

SERVER_FLAGS = ["--header-timeout-s", "2", "--body-timeout-s", "2", "--max-connections", "16"]


def _raw(url: str, data: bytes, dribble: bytes = b"", limit_s: float = 30) -> tuple[str, float]:
    """Send ``data``, then ``dribble`` a byte per 0.25 s; (the status line or 'closed', seconds until the server
    answered or closed)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=limit_s) as sock:
        sock.sendall(data)
        sock.settimeout(0.25)
        received, i = b"", 0
        while time.monotonic() - start < limit_s:
            try:
                if dribble:
                    sock.send(dribble[i % len(dribble) : i % len(dribble) + 1])
                    i += 1
                chunk = sock.recv(65536)
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
        took = time.monotonic() - start
    line = received.split(b"\r\n", 1)[0].decode("latin-1") if received else "closed, no answer"
    return line, round(took, 2)


def probes(url: str, model: str, key: str) -> list[dict]:
    auth = {"Authorization": f"Bearer {key}"}
    rows = []

    def row(defect: str, sent: str, got: str) -> None:
        rows.append({"defect": defect, "sent": sent, "got": got})
        print(f"[{defect}] {sent}\n    -> {got}", flush=True)

    def call(method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, url + path, timeout=120, **kw)

    def error_of(r: httpx.Response) -> str:
        try:
            e = r.json()["error"]
            return f"{r.status_code} param={e['param']!r} message={e['message'][:140]!r}"
        except (ValueError, KeyError, TypeError):
            return f"{r.status_code} {r.text[:140]!r}"

    # 1. a tiny temperature beside a running stream
    victim = {"model": model, "prompt": "The river runs north and", "max_tokens": 60, "temperature": 0}
    alone = stream_text(url, victim, headers=auth)
    got = {}
    runner = threading.Thread(target=lambda: got.update(victim=stream_text(url, victim, headers=auth)))
    runner.start()
    time.sleep(0.5)
    for t in (1e-40, 1e-300):
        r = call("POST", "/v1/completions", headers=auth, json={"model": model, "prompt": [5], "max_tokens": 2,
                                                                 "temperature": t})
        row("1", f"temperature {t:g} (max_tokens 2) while a 60-token stream runs", f"{r.status_code}, "
            f"{r.json().get('usage', {}).get('completion_tokens')} tokens")
    runner.join(300)
    row("1", "the running stream", "same text as alone" if got.get("victim") == alone else f"CHANGED: {got}")

    # 2. random paths and /metrics (the first 404 and the first /metrics answer create their series: once)
    call("GET", f"/{uuid.uuid4().hex}")
    call("GET", "/metrics", headers=auth)
    before = len(call("GET", "/metrics", headers=auth).content)
    for i in range(100):
        call("POST", f"/{uuid.uuid4().hex * 8}/{i}", headers=auth if i % 2 else {})
    after = len(call("GET", "/metrics", headers=auth).content)
    row("2", "100 requests to random 256-character paths (401s and 404s)", f"/metrics {before} B -> {after} B")

    # 3. API docs
    for path in ("/docs", "/redoc", "/openapi.json"):
        row("3", f"GET {path} without the key", str(call("GET", path).status_code))
    row("3", "GET /openapi.json with the key (server started with --openapi)",
        str(call("GET", "/openapi.json", headers=auth).status_code))

    # 6. the key on the wire
    for raw in (b"Bearer s3cr\xe9t", b"Bearer \xff\xfe"):
        r = call("GET", "/v1/models", headers=[(b"Authorization", raw)])
        row("6", f"Authorization: {raw!r} (not ASCII)", str(r.status_code))

    # 7. slow clients and the connection cap
    line, took = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", dribble=b"X-Slow: aaaa")
    row("7", "request headers sent at 4 bytes/s", f"{line} after {took} s")
    line, took = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
                      key.encode() + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"20\r\n{\"model\": \"x\", \"prompt\"")
    row("7", "a chunked body that stalls after 24 bytes", f"{line} after {took} s")
    line, took = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 400\r\n\r\n{")
    row("7", "Content-Length 400, 1 byte sent", f"{line} after {took} s")
    host, port = url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(16)]
    r = call("GET", "/v1/models", headers=auth)
    for s in held:
        s.close()
    row("7", "a request while 16 idle connections are open (--max-connections 16)", str(r.status_code))

    # 8. lax coercion
    for extra in ({"prompt": [1, True]}, {"prompt": [1, "7"]}, {"max_tokens": "5"}):
        r = call("POST", "/v1/completions", headers=auth, json={"model": model, "prompt": [5, 6], "max_tokens": 2,
                                                                 **extra})
        row("8", json.dumps(extra), error_of(r))

    # 10. the served id
    r = call("GET", "/v1/models", headers=auth)
    row("10", "GET /v1/models", f"ids {[m['id'] for m in r.json()['data']]}")
    r = call("POST", "/v1/completions", headers=auth, json={"model": "gpt-4", "prompt": [5], "max_tokens": 1})
    row("10", "a completion naming model gpt-4", error_of(r))

    # 11. cosmetic
    r = call("POST", "/v1/completions", headers={**auth, "content-type": "application/json"},
             content=b'{"model": "x", "prompt": [5,,]}')
    row("11", "a body that is not JSON", error_of(r))
    r = call("POST", "/v1/completions", headers=auth, json={"model": model, "prompt": {"text": "x"}})
    row("11", "prompt of a wrong type (an object)", error_of(r))
    r = call("GET", "/health", headers={"Host": "evil.example"})
    row("11", "GET /health with Host: evil.example", error_of(r))
    return rows


def cli_probes(model: str, tmp: Path) -> list[dict]:
    """Refusals at start: the command's exit code and its last line."""
    rows = []
    (tmp / "keyfile").write_text("")
    for defect, args, env in [("6", ["--api-key", ""], {}), ("6", ["--api-key", "clé"], {}),
                              ("6", ["--api-key-file", str(tmp / "keyfile")], {}),
                              ("6", [], {"EDGEKV_API_KEY": ""})]:
        done = subprocess.run([sys.executable, "-m", "edgekv.cli", "serve", "--model", model, "--port", "0", *args],
                              capture_output=True, text=True, timeout=300, env={**_env(), **env})
        shown = " ".join(args) if args else " ".join(f"{k}={v!r}" for k, v in env.items())
        rows.append({"defect": defect, "sent": f"edgekv serve {shown}",
                     "got": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:160]}"})
        print(rows[-1], flush=True)
    return rows


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "EDGEKV_API_KEY"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edgekv-probe-") as tmp:
        tmp = Path(tmp)
        key = uuid.uuid4().hex
        (tmp / "key").write_text(key + "\n")
        (tmp / "kv").mkdir()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(args.model, tmp / "kv", port, tmp / "server.log",
                              ["--api-key-file", str(tmp / "key"), "--openapi", *SERVER_FLAGS])
        try:
            wait_healthy(url, server, tmp / "server.log")
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
            rows = probes(url, model, key)
        finally:
            server.terminate()
            server.wait(120)
        rows += cli_probes(args.model, tmp)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "server_flags": SERVER_FLAGS, "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
