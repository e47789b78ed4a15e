"""edgekv serve's answers when something goes wrong, over real HTTP: text UTF-8 cannot encode, an exception no
route foresaw, a KV disk that is full, read-only or failing (whole responses and streams), the absolute-form
request target, and the startup checks that name a KV path that is a file or a tokenizer.json that is missing.

Disk faults are made where the store meets the OS: ``os.pwrite`` raising the OSError the kernel gives (man 2
write: ENOSPC "the device containing the file has no room for the data", EIO "a low-level I/O error occurred"),
the reader raising EIO as tests/harness/faults.py does, and, where this machine allows it, a real tmpfs too
small for the records and a real read-only remount."""
import errno
import json
import logging
import os
import socket
import subprocess
import threading

import httpx
import pytest

from edgekv.runtime import Engine, ModelError, StoreError
from edgekv.runtime.disk_store import check_kv_path
from edgekv.runtime.engine import _record_layout
from edgekv.serve import protocol
from tests.conftest import files_under, save_chat_model
from tests.harness.faults import FaultyReader
from tests.harness.serve_fuzz import stream_text
from tests.serving import CFG, poll, post, serving, sse_events

PROMPT = list(range(5, 61))  # 56 token ids: 14 whole groups of G=4, so decode steps read records back


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("serve-errors") / "m")


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    with serving(text_model, kv) as (url, state):
        yield url, state, kv


def raw_post(url: str, path: str, body: bytes) -> httpx.Response:
    """A body sent as these bytes: JSON escapes such as \\ud800 reach the server as the client wrote them."""
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}


def streamed(url: str, body: dict) -> list[dict | str]:
    r = post(url, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200
    return [e if e == "[DONE]" else json.loads(e) for e in sse_events(r.text)]


# ---- text UTF-8 cannot encode ------------------------------------------------------------------------------

SURROGATES = [  # (endpoint, the body as sent, the field named, the character's position)
    ("/v1/completions", rb'{"model":"tiny","prompt":"ab\ud800c","max_tokens":2}', "prompt", 2),
    ("/v1/completions", rb'{"model":"tiny","prompt":["\udfff"],"max_tokens":2}', "prompt", 0),
    ("/v1/completions", rb'{"model":"tiny","prompt":"abc","stop":["x\ud800"],"max_tokens":2}', "stop[0]", 1),
    ("/v1/completions", rb'{"model":"tiny","prompt":"abc","user":"\ud800","max_tokens":2,"stream":true}', "user", 0),
    ("/v1/chat/completions", rb'{"model":"tiny","messages":[{"role":"user","content":"hello\ud800"}]}',
     "messages[0].content", 5),
    ("/v1/chat/completions", rb'{"model":"tiny","messages":[{"role":"system","content":"be brief"},{"role":"user",'
                             rb'"content":[{"type":"text","text":"a"},{"type":"text","text":"\ud83d"}]}]}',
     "messages[1].content[1].text", 0),
]


@pytest.mark.parametrize("path, body, param, at", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_position(server, path, body, param, at):
    url, _, _ = server
    r = raw_post(url, path, body)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: character {at} is a lone surrogate (U+")
    assert "UTF-8 cannot encode; send valid Unicode" in error["message"]


def test_a_surrogate_pair_is_one_character_and_served(server):
    url, _, _ = server
    r = raw_post(url, "/v1/chat/completions",
                 rb'{"model":"tiny","messages":[{"role":"user","content":"the river \ud83c\udf0a"}],"max_tokens":2}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param", [
    (rb'{"model":"tiny","prompt":"a","\ud800":1}', None),  # pydantic takes no such key
    (rb'{"model":"tiny","messages":[{"role":"user","content":"a","\ud800":1}]}', "messages[0]"),
])
def test_a_lone_surrogate_in_a_field_name_is_a_400(server, body, param):
    url, _, _ = server
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = raw_post(url, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == (f"{param or 'the body'}: a field name holds a lone surrogate that UTF-8 "
                                            "cannot encode; send valid Unicode")


def test_an_error_body_quoting_a_lone_surrogate_is_ascii_json(server):
    """A refusal may quote what the client sent; UTF-8 cannot encode a lone surrogate, so the body escapes it."""
    url, _, _ = server
    r = raw_post(url, "/v1/completions", rb'{"model":"tiny","prompt":"a","logit_bias":{"\ud800":1}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert r.content.isascii()


def test_the_engine_names_the_prompt_and_the_position(server):
    _, state, _ = server
    with pytest.raises(ValueError, match=r"^prompt 0: character 3 is a lone surrogate \(U\+DC00\)"):
        state.engine.tokenize("the\udc00")
    with pytest.raises(ValueError, match=r"^prompt 0 message 1 content: character 0 is a lone surrogate"):
        state.engine.tokenize([{"role": "user", "content": "a"}, {"role": "user", "content": "\ud800"}])


def test_an_empty_list_of_content_parts_is_a_400_naming_the_field(server):
    url, _, _ = server
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": []}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    assert "an empty list of parts" in r.json()["error"]["message"]


# ---- the last resort ---------------------------------------------------------------------------------------


def test_an_exception_no_route_foresaw_is_the_json_500_with_its_traceback_in_the_log(server, monkeypatch, caplog):
    url, state, _ = server

    def broken(prompt, chat=False):
        raise RuntimeError("injected into tokenize")
    monkeypatch.setattr(state.engine, "tokenize", broken)
    with caplog.at_level(logging.ERROR, logger="edgekv.serve"):
        r = post(url, "/v1/completions", completion(prompt="the value"))
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    message = r.json()["error"]["message"]
    assert message.startswith("the server could not answer this request; its log says why (request req-")
    assert "injected" not in r.text and "Traceback" not in r.text
    rid = message.rpartition("(request ")[2].rstrip(")")
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and "RuntimeError: injected into tokenize" in caplog.text and logged[0].exc_info is not None
    monkeypatch.undo()
    assert post(url, "/v1/completions", completion()).status_code == 200


def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event_not_a_traceback(server, monkeypatch, caplog):
    url, state, _ = server
    real = protocol.Envelope.chunk

    def chunk(self, text, finish_reason=None, usage_=None, first=False):
        if not first:
            raise RuntimeError("injected into a chunk")
        return real(self, text, finish_reason, usage_, first)
    monkeypatch.setattr(protocol.Envelope, "chunk", chunk)
    with caplog.at_level(logging.ERROR, logger="edgekv.serve"):
        events = streamed(url, completion(max_tokens=200))
    assert events[-1] == "[DONE]" and len(events) == 3
    error = events[1]["error"]
    assert error["status"] == 500 and error["message"].startswith("the server could not answer this request")
    assert "injected into a chunk" in caplog.text and "injected" not in json.dumps(events)
    poll(lambda: not state.scheduler.jobs, "the failed stream's row freed")


# ---- KV disk faults ----------------------------------------------------------------------------------------


def failing_pwrite(errno_: int, only: str = "", armed: threading.Event | None = None, failed=None):
    """os.pwrite as the kernel fails it (man 2 write), for the files whose path holds ``only``, once ``armed`` is set
    (None: from the start); ``failed()`` is called at each failure."""
    real = os.pwrite

    def pwrite(fd, data, offset):
        if (armed is None or armed.is_set()) and only in os.readlink(f"/proc/self/fd/{fd}"):
            if failed is not None:
                failed()
            raise OSError(errno_, os.strerror(errno_))
        return real(fd, data, offset)
    return pwrite


@pytest.mark.parametrize("errno_, status, fix", [
    (errno.ENOSPC, 507, "(No space left on device): free space there or pick another --kv-path"),
    (errno.EDQUOT, 507, "free space there or pick another --kv-path"),
    (errno.EIO, 503, "(Input/output error): check the device, then run again"),
    (errno.EROFS, 503, "(Read-only file system): remount it read-write or pick another --kv-path"),
])
def test_a_failed_kv_write_tells_the_client_what_the_log_says(server, monkeypatch, caplog, errno_, status, fix):
    url, state, kv = server
    monkeypatch.setattr(os, "pwrite", failing_pwrite(errno_))
    with caplog.at_level(logging.WARNING, logger="edgekv.serve"):
        r = post(url, "/v1/completions", completion())
        events = streamed(url, completion())
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    message = r.json()["error"]["message"]
    sentence, _, rid = message.rpartition(" (request ")
    assert sentence.startswith(f"writing KV records to {kv}") and sentence.endswith(fix)
    assert f"request {rid.rstrip(')')} failed ({status}): {sentence}" in caplog.text  # the same sentence
    error = events[1]["error"]
    assert error["status"] == status and error["message"].partition(" (request ")[0] == sentence
    assert events[-1] == "[DONE]"
    monkeypatch.undo()
    done = post(url, "/v1/completions", completion())
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4  # serving goes on
    assert not [f for f in files_under(kv) if os.path.isfile(f) and "contexts" not in f]


def test_a_full_disk_fails_the_joining_request_and_the_running_one_goes_on(server, monkeypatch):
    """A stream holds row 0; its first decode step waits until a second request is queued, which then joins
    row 1 and finds the disk full on its prefill writes (to its own files, seq1_*): 507 for it, while the
    stream gets every token it asked for."""
    url, state, _ = server
    scheduler, queued = state.scheduler, threading.Event()
    real_submit = scheduler.submit

    def submit(job):
        real_submit(job)
        queued.set()
    monkeypatch.setattr(scheduler, "submit", submit)
    running_at_failure = []

    def hold(event):
        if event.kind == "decode_step_start":
            queued.wait(60)
        if event.kind == "prefill_start" and event.info["seq"] == 1:
            running_at_failure.append(sorted(scheduler.jobs))
    state.engine.events.subscribe(hold)
    monkeypatch.setattr(os, "pwrite", failing_pwrite(errno.ENOSPC, only="/seq1_layer"))
    try:
        results = {}
        stream = threading.Thread(target=lambda: results.update(events=streamed(url, completion(max_tokens=40))))
        stream.start()
        poll(lambda: scheduler.jobs, "the stream is running")
        joined = post(url, "/v1/completions", completion(prompt=PROMPT[::-1]))
        stream.join(120)
    finally:
        state.engine.events.unsubscribe(hold)
    assert joined.status_code == 507 and "No space left on device" in joined.json()["error"]["message"]
    assert running_at_failure == [[0]]  # the stream was in the batch when the other request failed
    events = results["events"]
    assert "error" not in json.dumps(events) and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("failing", [0, 1], ids=["row-0-fails", "row-1-fails"])
def test_a_full_disk_at_a_decode_flush_ends_that_row_and_the_other_stream_keeps_every_token(server, monkeypatch,
                                                                                             caplog, failing):
    """Two requests join in one turn (the first one's prefill waits until the second is queued), both prompts whole
    groups, so their groups fill and flush in the same decode steps.  From the first decode step on, writes to one
    row's files (seq{failing}_*) find the disk full: at its first flush that request gets the 507 with the log's
    sentence, while the other, a stream, keeps decoding and its text is its lone run's.  Row 0 flushes first in a
    step: failing it shows the rows after a failed one still flush."""
    url, state, kv = server
    scheduler, survivor = state.scheduler, completion(prompt=PROMPT[::-1], max_tokens=40)
    alone = stream_text(url, survivor)
    submitted, both_queued, decoding = [], threading.Event(), threading.Event()
    real_submit = scheduler.submit

    def submit(job):
        real_submit(job)
        submitted.append(job)
        if len(submitted) == 2:
            both_queued.set()
    monkeypatch.setattr(scheduler, "submit", submit)

    def hold(event):
        if event.kind == "prefill_start" and event.info["seq"] == 0:
            both_queued.wait(60)
        if event.kind == "decode_step_start":
            decoding.set()
    running_at_failure = []
    monkeypatch.setattr(os, "pwrite", failing_pwrite(errno.ENOSPC, f"/seq{failing}_layer", decoding,
                                                     lambda: running_at_failure.append(sorted(scheduler.jobs))))
    state.engine.events.subscribe(hold)
    got = {}
    survive = threading.Thread(target=lambda: got.update(survivor=stream_text(url, survivor)))
    fail = threading.Thread(target=lambda: got.update(failed=post(url, "/v1/completions", completion(max_tokens=40))))
    try:
        with caplog.at_level(logging.WARNING, logger="edgekv.serve"):
            first, second = (fail, survive) if failing == 0 else (survive, fail)
            first.start()
            poll(lambda: submitted, "the first request queued")
            second.start()
            fail.join(120)
            survive.join(120)
    finally:
        state.engine.events.unsubscribe(hold)
    r = got["failed"]
    assert r.status_code == 507 and r.headers["content-type"] == "application/json"
    sentence = r.json()["error"]["message"].rpartition(" (request ")[0]
    assert sentence.startswith(f"writing KV records to {kv}") and f"/seq{failing}_layer" in sentence
    assert sentence.endswith("(No space left on device): free space there or pick another --kv-path")
    assert f"failed (507): {sentence}" in caplog.text
    assert running_at_failure and running_at_failure[0] == [0, 1]  # the stream was decoding beside it
    assert got["survivor"] == alone
    monkeypatch.undo()
    poll(lambda: not scheduler.jobs, "both rows freed")
    assert not [f for f in files_under(kv) if os.path.isfile(f) and "contexts" not in f]


def test_a_failing_kv_read_mid_stream_is_a_503_error_event(text_model, tmp_path):
    """The reader raises EIO as the kernel does on a failed read (tests/harness/faults.py); the step's rows end
    with the store's sentence and the server answers the next request."""
    kv = tmp_path / "kv"
    kv.mkdir()
    with serving(text_model, kv, store=False) as (url, state):
        engine = state.engine
        engine.reader = FaultyReader(engine.reader, _record_layout(engine.config, engine.model.dims,
                                                                   engine.model.dtype).record_bytes, "eio", 1)
        events = streamed(url, completion(max_tokens=20))
        assert engine.reader.injected is not None
        error = events[-2]["error"]
        assert error["status"] == 503 and error["type"] == "server_error"
        assert error["message"].startswith(f"reading KV records from {kv} failed (Input/output error)")
        assert "check the device" in error["message"] and "Traceback" not in json.dumps(events)
        assert post(url, "/v1/completions", completion()).status_code == 200


def test_a_kv_read_past_its_deadline_is_a_503_error_event_naming_the_deadline(text_model, tmp_path):
    """The reader hangs (tests/harness/faults.py) past read_deadline_s: the device cannot give records back, a
    503 with the sentence the log has (not the generic 500), and once the device answers the next request runs."""
    kv = tmp_path / "kv"
    kv.mkdir()
    with serving(text_model, kv, config={**CFG, "read_deadline_s": 0.5}, store=False) as (url, state):
        engine = state.engine
        engine.reader = FaultyReader(engine.reader, _record_layout(engine.config, engine.model.dims,
                                                                   engine.model.dtype).record_bytes, "hang", 1,
                                     hang_s=60)
        try:
            events = streamed(url, completion(max_tokens=20))
        finally:
            engine.reader.released.set()
        assert engine.reader.injected is not None
        error = events[-2]["error"]
        assert error["status"] == 503 and error["type"] == "server_error"
        assert error["message"].startswith("the KV read of layer ")
        assert f"did not finish within read_deadline_s=0.5 s: the KV device under {kv}" in error["message"]
        assert "raise read_deadline_s" in error["message"] and "Traceback" not in json.dumps(events)
        assert post(url, "/v1/completions", completion()).status_code == 200


def _mount_tmpfs(folder, options: str):
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")


def test_a_real_full_filesystem_is_a_507(text_model, tmp_path):
    """A KV folder on a 96 KiB tmpfs: a short prompt's records fit, a long one's do not."""
    kv = tmp_path / "small"
    kv.mkdir()
    _mount_tmpfs(kv, "size=96k")
    try:
        with serving(text_model, kv, store=False) as (url, _):
            assert post(url, "/v1/completions", completion(prompt=PROMPT[:8])).status_code == 200
            r = post(url, "/v1/completions", completion(prompt=list(range(5, 240)), max_tokens=2))
            assert r.status_code == 507, r.text
            assert f"writing KV records to {kv}" in r.json()["error"]["message"]
            assert "(No space left on device): free space there" in r.json()["error"]["message"]
            assert post(url, "/v1/completions", completion(prompt=PROMPT[:8])).status_code == 200
            assert not [f for f in files_under(kv) if os.path.isfile(f)]
    finally:
        subprocess.run(["umount", "-l", str(kv)], check=False)


def test_a_kv_folder_remounted_read_only_is_a_503_naming_it(text_model, tmp_path):
    kv = tmp_path / "ro"
    kv.mkdir()
    _mount_tmpfs(kv, "size=8m")
    try:
        with serving(text_model, kv, store=False) as (url, state):
            assert post(url, "/v1/completions", completion()).status_code == 200
            subprocess.run(["mount", "-o", "remount,ro", str(kv)], check=True)
            r = post(url, "/v1/completions", completion())
            events = streamed(url, completion())
            subprocess.run(["mount", "-o", "remount,rw", str(kv)], check=True)
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert f"{kv}" in message and "read-only" in message.lower() and "remount it read-write" in message
            assert events[1]["error"]["status"] == 503
            assert post(url, "/v1/completions", completion()).status_code == 200
    finally:
        subprocess.run(["umount", "-l", str(kv)], check=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through mode bits: the remount test covers it as root")
def test_a_kv_folder_made_read_only_by_its_mode_is_a_503_naming_it(text_model, tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    with serving(text_model, kv, store=False) as (url, _):
        assert post(url, "/v1/completions", completion()).status_code == 200
        kv.chmod(0o500)
        try:
            r = post(url, "/v1/completions", completion())
        finally:
            kv.chmod(0o700)
        assert r.status_code == 503 and f"{kv}" in r.json()["error"]["message"]
        assert "writable" in r.json()["error"]["message"]


# ---- the absolute-form request target ----------------------------------------------------------------------


def _raw_get(url: str, target: str, host: str) -> tuple[int, bytes]:
    """One request over a plain socket, its target exactly as given (clients send the origin form only)."""
    port = int(url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_the_absolute_form_is_served(server):
    url, _, _ = server
    port = url.rpartition(":")[2]
    status, body = _raw_get(url, f"http://127.0.0.1:{port}/health", f"127.0.0.1:{port}")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = _raw_get(url, f"HTTP://127.0.0.1:{port}/v1/models?x=1", "evil.example")  # the target's host
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    status, body = _raw_get(url, f"http://evil.example:{port}/health", f"127.0.0.1:{port}")
    assert status == 400 and "'evil.example:" in json.loads(body)["error"]["message"]
    assert _raw_get(url, "/health", f"127.0.0.1:{port}")[0] == 200  # the origin form as ever


# ---- startup checks ----------------------------------------------------------------------------------------


def test_a_kv_path_that_is_a_file_is_named_a_file(tmp_path):
    """What a deployed config's kv_paths meet (the CLI's --kv-path has its own check before)."""
    file = tmp_path / "kv"
    file.write_text("not a folder")
    with pytest.raises(StoreError, match=rf"^kv_path {file} is a file, not a folder: point kv_path \(--kv-path\)"):
        check_kv_path(file)
    with pytest.raises(StoreError, match=rf"^kv_path {file} is a file, not a folder"):
        Engine.from_pretrained("fixture", kv_path=file, device="cpu")
    with pytest.raises(StoreError, match=rf"kv_path {tmp_path / 'absent'} does not exist; create it"):
        check_kv_path(tmp_path / "absent")


def test_a_model_folder_without_tokenizer_json_is_named(text_model, tmp_path, kv_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(text_model, folder)
    (folder / "tokenizer.json").unlink()
    assert (folder / "tokenizer_config.json").exists()
    with pytest.raises(ModelError, match=rf"^tokenizer.json is missing from {folder} .*copy tokenizer.json"):
        Engine.from_pretrained(str(folder), kv_path=kv_path, device="cpu")

