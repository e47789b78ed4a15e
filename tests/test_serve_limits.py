"""What bounds a client of ``edgekv serve``: metric series, the API docs, the key, the Host, header and
body read times, the connection cap, strict request types, the served model id, and what errors show."""
import json
import socket
import uuid
from pathlib import Path

import httpx
import pytest

from edgekv.serve import ServeSettings
from edgekv.serve.limits import host_name
from edgekv.serve.server import ServeOptions, resolve, resolve_api_key
from tests.conftest import save_chat_model
from tests.serving import post, serving


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("limits") / "m")


@pytest.fixture(scope="module")
def keyed(text_model, tmp_path_factory):
    """A server with a key, short header and body deadlines and a cap of 4 connections."""
    with serving(text_model, tmp_path_factory.mktemp("kv"), api_key="s3cret", store=False,
                 options={"header_timeout_s": 1.0, "max_connections": 4}, body_timeout_s=1.0) as (url, state):
        yield url, state


KEY = {"Authorization": "Bearer s3cret"}


# ---- /metrics stays bounded ----------------------------------------------------------------------------


def test_random_paths_do_not_grow_metrics(keyed):
    """Every path no route serves is one label; a wrong method keeps its route's.  Before, each raw path (404s and
    401s included) became a series forever: 100 random paths took /metrics from 6.7 KB to 813 KB."""
    url, _ = keyed
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            client.get(f"{url}/{uuid.uuid4().hex}")
        client.get(url + "/v1/completions", headers=KEY)  # 405: labelled by its route
        client.post(url + "/v1/completions", json={})  # 401
        client.get(url + "/metrics", headers=KEY)  # its own series, counted once answered
        before = client.get(url + "/metrics", headers=KEY).text
        for i in range(200):
            path = f"/{uuid.uuid4().hex * 8}/{i}" if i % 2 else f"/v1/{uuid.uuid4().hex}?q={i}"
            client.request("POST" if i % 3 else "GET", url + path, headers=KEY if i % 5 else {})
        client.get(url + "/v1/completions", headers=KEY)
        client.post(url + "/v1/completions", json={})
        after = client.get(url + "/metrics", headers=KEY).text
    series = [line for line in after.splitlines() if line.startswith("edgekv_requests_total{")]
    assert {line.split('endpoint="')[1].split('"')[0] for line in series} <= {
        "unmatched", "/v1/completions", "/metrics", "/health"}
    assert len(after.splitlines()) == len(before.splitlines())
    assert 'endpoint="unmatched",status="404"' in after and 'endpoint="/v1/completions",status="405"' in after


# ---- the API docs ---------------------------------------------------------------------------------------


def test_api_docs_are_off_unless_asked_for_and_then_behind_the_key(keyed, text_model, tmp_path):
    url, _ = keyed
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert httpx.get(url + path, headers=KEY).status_code == 404, path
    with serving(text_model, tmp_path, api_key="s3cret", store=False, openapi=True) as (served, _):
        assert httpx.get(served + "/openapi.json").status_code == 401
        schema = httpx.get(served + "/openapi.json", headers=KEY).json()
        assert "/v1/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
        assert httpx.get(served + "/docs", headers=KEY).status_code == 404  # the CDN-scripted pages never


# ---- the API key ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, match", [("", "is empty"), ("clé", "printable ASCII"), ("a b", "printable ASCII"),
                                        ("k\udcff", "printable ASCII"), ("tab\t", "printable ASCII")])
def test_a_key_that_cannot_work_is_refused_at_start(key, match):
    """Empty: auth would be off.  Non-ASCII: headers are latin-1 bytes, so it could never match.  Not UTF-8 (a
    surrogate from the command line): every request was a 500."""
    with pytest.raises(ValueError, match=match):
        ServeSettings(("m",), api_key=key)


def test_the_key_comes_from_a_file_the_environment_or_the_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGEKV_API_KEY", raising=False)
    assert resolve_api_key(ServeOptions()) is None
    (tmp_path / "key").write_text("from-file\n")
    assert resolve_api_key(ServeOptions(api_key_file=str(tmp_path / "key"))) == "from-file"
    monkeypatch.setenv("EDGEKV_API_KEY", "from-env")
    assert resolve_api_key(ServeOptions()) == "from-env"
    assert resolve_api_key(ServeOptions(api_key="from-flag")) == "from-flag"
    monkeypatch.setenv("EDGEKV_API_KEY", "")
    with pytest.raises(ValueError, match="EDGEKV_API_KEY: the API key is empty"):
        resolve_api_key(ServeOptions())
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="--api-key-file .*empty: the file is empty; write the key on its first"):
        resolve_api_key(ServeOptions(api_key_file=str(tmp_path / "empty")))
    (tmp_path / "blank").write_text("\nsecond-line\n")
    with pytest.raises(ValueError, match="--api-key-file .*blank: the API key is empty"):
        resolve_api_key(ServeOptions(api_key_file=str(tmp_path / "blank")))
    with pytest.raises(ValueError, match="--api-key-file .*missing: cannot read it"):
        resolve_api_key(ServeOptions(api_key_file=str(tmp_path / "missing")))


def test_cli_refuses_an_empty_key_and_says_where_keys_come_from(capsys):
    from edgekv.cli import main

    assert main(["serve", "--model", "fixture", "--api-key", ""]) == 2
    assert "--api-key: the API key is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--api-key-file FILE" in usage and "EDGEKV_API_KEY" in usage and "process list" in usage


def test_header_bytes_outside_ascii_get_401_not_500(keyed):
    url, _ = keyed
    for raw in (b"Bearer s3cr\xe9t", b"Bearer \xff\xfe", b"Bearer s3cret\x80"):
        r = httpx.get(url + "/v1/models", headers=[(b"Authorization", raw)])
        assert r.status_code == 401, raw
    assert httpx.get(url + "/v1/models", headers=KEY).status_code == 200


# ---- slow clients and the connection cap ---------------------------------------------------------------


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _closed_within(sock: socket.socket, limit_s: float, dribble: bytes = b"") -> bytes:
    """Send ``dribble`` a byte per 0.1 s for up to ``limit_s``; return what the server answered once it closed the
    connection (a liveness bound: without a deadline the server would hold it as long as bytes come)."""
    sock.settimeout(0.1)
    received = b""
    for i in range(int(limit_s / 0.1)):
        try:
            if dribble:
                sock.send(dribble[i % len(dribble) : i % len(dribble) + 1])
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the server still held the connection after {limit_s:g} s")


def test_headers_sent_a_byte_at_a_time_lose_their_connection(keyed):
    url, _ = keyed
    with _connect(url) as sock:
        sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _closed_within(sock, 30, dribble=b"X-Slow: aaaaaaaa") == b""


def test_an_idle_connection_that_sends_nothing_is_closed(keyed):
    url, _ = keyed
    with _connect(url) as sock:
        assert _closed_within(sock, 30) == b""


@pytest.mark.parametrize("framing", [b"Content-Length: 400\r\n", b"Transfer-Encoding: chunked\r\n"])
def test_a_stalled_body_gets_408_and_the_connection_closes(keyed, framing):
    url, _ = keyed
    partial = b'{"model": "tiny", "prompt": "the' if b"Length" in framing else b'20\r\n{"model": "tiny", "prompt"'
    with _connect(url) as sock:
        sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n"
                  b"Content-Type: application/json\r\n" + framing + b"\r\n" + partial)
        answer = _closed_within(sock, 30)
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in answer


def test_connections_over_the_cap_get_503(keyed):
    url, _ = keyed
    held = [_connect(url) for _ in range(4)]
    try:
        r = httpx.get(url + "/v1/models", headers=KEY)
        assert r.status_code == 503
    finally:
        for sock in held:
            sock.close()
    poll_ok = [httpx.get(url + "/v1/models", headers=KEY).status_code for _ in range(50)]
    assert 200 in poll_ok  # once they are gone, requests are served again


# ---- the Host header -----------------------------------------------------------------------------------


def test_a_host_that_is_not_the_servers_is_refused(keyed):
    url, _ = keyed
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "127.0.0.1.evil.example", "attacker.test"):
        r = httpx.get(url + "/health", headers={"Host": host})
        assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"], host


def test_host_names_without_their_port():
    assert [host_name(h) for h in ("127.0.0.1:8080", "[::1]:80", "[::1]", "Example.COM", "::1")] == [
        "127.0.0.1", "::1", "::1", "example.com", "::1"]


def test_any_host_when_asked_for(text_model, tmp_path):
    with serving(text_model, tmp_path, store=False, allowed_hosts=("*",)) as (url, _):
        assert httpx.get(url + "/health", headers={"Host": "anything.example"}).status_code == 200


# ---- strict types and the errors' params ----------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"prompt": [1, True]}, "prompt"), ({"prompt": [1, "7"]}, "prompt"), ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"), ({"temperature": True}, "temperature"), ({"stream": "true"}, "stream"),
    ({"seed": "1"}, "seed"), ({"prompt": {"text": "x"}}, "prompt"), ({"top_k": 1.5}, "top_k"),
])
def test_values_of_the_wrong_type_are_refused_not_coerced(keyed, extra, param):
    """Lax mode took [1, true] as [1, 1] and "5" as 5; the field is named, not ``prompt.str``."""
    url, _ = keyed
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, **extra}, headers=KEY)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_float_field_still_takes_an_integer(keyed):
    url, _ = keyed
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "temperature": 1,
                                      "top_p": 1}, headers=KEY)
    assert r.status_code == 200, r.text


def test_undecodable_json_names_no_character_offset_as_param(keyed):
    url, _ = keyed
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": [5,,]}', headers={
        **KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None and "JSON" in r.json()["error"]["message"]


# ---- the served model id and what errors show --------------------------------------------------------------


def test_the_served_id_is_short_and_other_names_get_404(text_model, tmp_path):
    folder = Path(text_model).name
    _, _, names = resolve(ServeOptions(model=str(text_model)))
    assert names[0] == folder and "/" not in names[0]
    assert resolve(ServeOptions(model="smollm2"))[2][0] == "smollm2"
    assert resolve(ServeOptions(model="/x/SmolLM2-135M-Instruct-Q4_1.gguf"))[2][0] == "SmolLM2-135M-Instruct-Q4_1"
    assert resolve(ServeOptions(model=str(text_model), served_model_name=["chat", "alias"]))[2] == ("chat", "alias")
    with serving(text_model, tmp_path, store=False, names=names) as (url, _):
        listed = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [folder]
        ok = post(url, "/v1/completions", {"model": folder, "prompt": [5], "max_tokens": 1})
        assert ok.status_code == 200
        other = post(url, "/v1/completions", {"model": "gpt-4", "prompt": [5], "max_tokens": 1})
        assert other.status_code == 404 and str(tmp_path) not in other.text and str(text_model) not in other.text


def test_cli_takes_several_served_names(capsys):
    from edgekv.cli import parse_args

    args = parse_args(["serve", "--model", "fixture", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]


def test_a_failed_load_shows_no_path_to_clients(text_model, tmp_path):
    secret = tmp_path / "private" / "weights"

    def load():
        raise FileNotFoundError(f"no model at {secret}")

    with serving(text_model, tmp_path, load=load, store=False) as (url, state):
        from tests.serving import poll

        poll(lambda: state.error is not None, "load failed")
        health = httpx.get(url + "/health")
        asked = post(url, "/v1/completions", {"model": "tiny", "prompt": [5]})
    assert health.status_code == asked.status_code == 503
    assert str(secret) not in health.text + asked.text and "FileNotFoundError" not in health.text + asked.text
    assert "log" in json.loads(health.text)["message"]


def test_refusals_name_the_served_model_not_its_folder(model_dirs, tmp_path):
    """The engine's messages name the checkpoint's folder (right for the CLI); a client sees the served id."""
    with serving(model_dirs["llama"], tmp_path, store=False) as (url, _):
        for prompt in ("text, but no tokenizer", [10**6]):
            r = post(url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400 and "tiny" in r.text, r.text
            assert str(model_dirs["llama"]) not in r.text
