"""edgekv serve: every endpoint and error code over real HTTP (uvicorn on 127.0.0.1), driven by the official
``openai`` client, curl and httpx; SSE framing; continuous batching (joins give the tokens of a lone run,
a client that leaves frees its row); shutdown leaves no KV file."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.sampling import Sampler, SamplingParams
from edgekv.serve.metrics import ServerMetrics
from edgekv.serve.scheduler import Job, Scheduler
from edgekv.serve.server import ServeOptions, deployed_config, resolve, service_unit
from edgekv.serve.text import TextStream
from tests.conftest import files_under, save_chat_model
from tests.serving import CFG, WORDS, openai_client, poll, post, serving, sse_events, steps_held

@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("serve") / "m")


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    with serving(text_model, kv) as (url, state):
        yield url, state, kv


# ---- the openai client -------------------------------------------------------------------------------------


def test_openai_client_chat_whole_and_streamed_give_the_same_text(server):
    url, _, _ = server
    client = openai_client(url)
    ask = dict(model="tiny", messages=[{"role": "user", "content": WORDS}], max_tokens=12, temperature=0.9, seed=11)
    whole = client.chat.completions.create(**ask)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text.strip()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # include_usage: the last chunk
    other = client.chat.completions.create(**{**ask, "seed": 12})
    assert other.choices[0].message.content != text  # the seed is honoured


def test_openai_client_completions_text_prompt_and_stop(server):
    url, _, _ = server
    client = openai_client(url)
    free = client.completions.create(model="tiny", prompt=WORDS, max_tokens=16, temperature=0)
    assert free.object == "text_completion" and free.choices[0].finish_reason == "length"
    words = free.choices[0].text.split()
    stop = " " + words[len(words) // 2]
    cut = free.choices[0].text[: free.choices[0].text.index(stop)]
    stopped = client.completions.create(model="tiny", prompt=WORDS, max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 16
    streamed = client.completions.create(model="tiny", prompt=WORDS, max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_models_and_an_unknown_model(server):
    url, _, _ = server
    listed = openai_client(url).models.list()
    assert [m.id for m in listed.data] == ["tiny"]
    r = post(url, "/v1/completions", {"model": "gpt-4", "prompt": "the", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "'tiny'" in r.json()["error"]["message"]


# ---- curl and the SSE framing ------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_completions_and_sse_framing(server):
    url, _, _ = server
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sN", url + "/v1/completions", "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = sse_events(out)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5
    whole = json.loads(subprocess.run(
        ["curl", "-s", url + "/v1/completions", "-H", "Content-Type: application/json",
         "-d", body.replace('"stream": true', '"stream": false')], capture_output=True, text=True, timeout=60).stdout)
    assert whole["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in chunks)
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_concurrent_clients_are_all_answered(server):
    """A bounded load: 8 clients, 3 requests each, streamed and whole, over 2 batch rows: none lost or failed."""
    url, _, _ = server
    answers = []

    def client(i):
        with httpx.Client(timeout=120) as http:
            for j in range(3):
                body = {"model": "tiny", "prompt": [5 + i, 6 + j, 7], "max_tokens": 4 + i, "temperature": 0}
                if (i + j) % 2:
                    r = http.post(url + "/v1/completions", json=body)
                    answers.append(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4 + i)
                else:
                    r = http.post(url + "/v1/completions", json={**body, "stream": True})
                    events = sse_events(r.text)
                    last = json.loads(events[-2])
                    answers.append(r.status_code == 200 and events[-1] == "[DONE]"
                                   and last["usage"]["completion_tokens"] == 4 + i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert answers == [True] * 24


# ---- refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logprobs": 3}, "logprobs"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"bogus": 1}, "bogus"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 10**9]}, "prompt"),
])
def test_bad_fields_get_400_naming_the_field(server, extra, param):
    url, _, _ = server
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in r.text


def test_bad_chat_messages_and_json(server):
    url, _, _ = server
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_chat_on_a_model_without_a_chat_template_points_to_completions(model_dirs, tmp_path):
    with serving(model_dirs["llama"], tmp_path, store=False) as (url, _):
        r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "/v1/completions" in r.json()["error"]["message"]


def test_prompt_plus_max_tokens_over_max_context_names_both_numbers(server):
    url, _, _ = server
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": list(range(5, 205)), "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    message = r.json()["error"]["message"]
    assert "200 tokens" in message and "max_tokens is 100" in message and "256" in message and "56" in message
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": WORDS}],
                                            "max_completion_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_body_size_cap_by_length_and_chunked(text_model, tmp_path):
    with serving(text_model, tmp_path, max_body_bytes=2000, store=False) as (url, _):
        big = {"model": "tiny", "prompt": "the " * 1000, "max_tokens": 2}
        r = post(url, "/v1/completions", big)
        assert r.status_code == 413 and "2000" in r.json()["error"]["message"]

        def chunked():
            yield json.dumps(big).encode()

        r = httpx.post(url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert post(url, "/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2}).status_code == 200


def test_api_key_on_every_endpoint_but_health(text_model, tmp_path):
    with serving(text_model, tmp_path, api_key="s3cret", store=False) as (url, _):
        assert httpx.get(url + "/health").status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")]:
            r = httpx.request(method, url + path, json={}, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert httpx.request(method, url + path).status_code == 401
        assert openai_client(url, "s3cret").models.list().data[0].id == "tiny"
        import openai

        with pytest.raises(openai.AuthenticationError):
            openai_client(url, "wrong").models.list()


def test_health_is_503_while_loading_then_200(text_model, tmp_path):
    gate = threading.Event()

    def slow_load():
        gate.wait(60)
        return Engine.from_pretrained(text_model, kv_path=tmp_path, config=CFG, device="cpu")

    with serving(text_model, tmp_path, load=slow_load, store=False) as (url, state):
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = post(url, "/v1/completions", {"model": "tiny", "prompt": "the"})
        assert r.status_code == 503 and r.headers["retry-after"]
        gate.set()
        poll(lambda: httpx.get(url + "/health").status_code == 200, "loaded")


def test_queue_cap_gives_429_with_retry_after(text_model, tmp_path):
    with serving(text_model, tmp_path, config={**CFG, "max_batch": 1}, max_queue=1, store=False) as (url, state):
        ask = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0}
        answers = []
        with steps_held(state.engine):
            running = threading.Thread(target=lambda: answers.append(post(url, "/v1/completions", ask)))
            running.start()
            poll(lambda: len(state.scheduler.jobs) == 1, "first request running")
            queued = threading.Thread(target=lambda: answers.append(post(url, "/v1/completions", ask)))
            queued.start()
            poll(lambda: len(state.scheduler._queue) == 1, "second request queued")
            r = post(url, "/v1/completions", ask)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error" and "queue" in r.json()["error"]["message"]
        running.join(120)
        queued.join(120)
        assert [a.status_code for a in answers] == [200, 200]


# ---- continuous batching -----------------------------------------------------------------------------------


def _greedy(engine, ids, n):
    return engine.generate([ids], max_new_tokens=n, stop_token_ids=[])[0].token_ids


def _job(ids, n, results, seed=None, temperature=0.0):
    done = threading.Event()

    def notify(kind, data):
        if kind == "done" or kind == "error":
            results.append((kind, data))
            done.set()

    job = Job(ids, n, Sampler(SamplingParams(temperature, 0, 1.0, seed), torch.device("cpu")), set(),
              TextStream(None, []), notify)
    job.done = done
    return job


@pytest.mark.parametrize("policy", ["kvswap", "full"])
def test_requests_joining_a_running_batch_get_their_lone_greedy_tokens(model_dirs, kv_path, policy):
    prompts = [list(range(1, 50)), list(range(20, 41)), list(range(60, 90)), list(range(7, 70)), [3, 4, 5]]
    lengths = [30, 5, 17, 9, 12]  # rows free at different steps: joins land mid-run
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CFG, policy=policy,
                                device="cpu") as engine:
        engine.generate([list(range(1, 120))], max_new_tokens=1)  # fits the K adapter on enough keys to keep it
        alone = [_greedy(engine, p, n) for p, n in zip(prompts, lengths)]
        scheduler = Scheduler(engine, ServerMetrics(), max_queue=16)
        results = []
        jobs = [_job(p, n, results) for p, n in zip(prompts, lengths)]
        for job in jobs:
            scheduler.submit(job)
        joins = []
        engine.events.subscribe(lambda e: joins.append(e.info["seq"]) if e.kind == "prefill_start" else None)
        scheduler.start()
        for job in jobs:
            assert job.done.wait(120)
        scheduler.stop()
    assert [job.generated for job in jobs] == alone
    assert len(joins) == 5 and sorted(set(joins)) == [0, 1]  # two rows, refilled as sequences left
    assert not [f for f in files_under(kv_path) if os.path.isfile(f)]


def test_sampled_requests_in_a_batch_keep_their_own_seeds(model_dirs, kv_path):
    prompt = list(range(1, 30))
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CFG, device="cpu") as engine:
        lone = engine.generate([prompt], max_new_tokens=10, temperature=1.2, seed=5, stop_token_ids=[])[0].token_ids
        scheduler = Scheduler(engine, ServerMetrics(), max_queue=16)
        results = []
        jobs = [_job(prompt, 10, results, seed=5, temperature=1.2), _job(list(range(40, 80)), 25, results, seed=9,
                                                                           temperature=1.2)]
        for job in jobs[::-1]:
            scheduler.submit(job)
        scheduler.start()
        assert all(job.done.wait(120) for job in jobs)
        scheduler.stop()
    assert jobs[0].generated == lone


def test_a_longer_request_waits_for_the_batch_to_drain_and_gets_its_own_solution(model_dirs, kv_path):
    config = {**CFG, "solutions": [{"batch": 2, "context": 64, "G": 4, "M": 2, "C": 4, "sigma": 8},
                                   {"batch": 2, "context": 256, "G": 4, "M": 4, "C": 8, "sigma": 8}]}
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu") as engine:
        built = []
        real_open = engine.open_batch
        engine.open_batch = lambda rows, context: built.append(context) or real_open(rows, context)
        scheduler = Scheduler(engine, ServerMetrics(), max_queue=16)
        results = []
        short, long, after = (_job(list(range(1, 20)), 40, results), _job(list(range(1, 100)), 20, results),
                              _job(list(range(1, 10)), 4, results))
        scheduler.submit(short)
        scheduler.start()
        poll(lambda: scheduler.jobs, "short request running")
        scheduler.submit(long)
        scheduler.submit(after)  # behind the long one: it waits too (first come, first served)
        assert short.done.wait(120) and long.done.wait(120) and after.done.wait(120)
        scheduler.stop()
    assert built == [59, 119]  # the 64-token solution, drained, then the 256-token one
    configs = [data["stats"]["config"] for _, data in results]
    assert [c["M"] for c in configs] == [2, 4, 4] and [c["max_context"] for c in configs] == [64, 256, 256]


def test_a_failed_step_or_prefill_ends_its_requests_and_serving_goes_on(model_dirs, kv_path, caplog):
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CFG, device="cpu") as engine:
        failures = {"prefill_start": 1, "decode_step_start": 1}

        def fault(event):
            if failures.get(event.kind):
                failures[event.kind] -= 1
                raise OSError(5, f"injected at {event.kind}")

        engine.events.subscribe(fault)
        scheduler = Scheduler(engine, ServerMetrics(), max_queue=16)
        results = []
        jobs = [_job(list(range(1, 30)), 8, results) for _ in range(4)]
        for i, job in enumerate(jobs):
            job.request_id = f"cmpl-{i}"
        scheduler.start()
        for job in jobs:
            scheduler.submit(job)
            assert job.done.wait(120)
        scheduler.stop()
    kinds = [kind for kind, _ in results]
    assert kinds == ["error", "error", "done", "done"]  # the prefill's request, then the step's, then service
    for i, at in enumerate(["prefill_start", "decode_step_start"]):  # the client gets its id, the log the cause
        assert f"(request cmpl-{i})" in results[i][1]["message"] and "injected" not in results[i][1]["message"]
        assert f"request cmpl-{i} failed: OSError: [Errno 5] injected at {at}" in caplog.text
    assert not [f for f in files_under(kv_path) if os.path.isfile(f)]


def test_a_client_leaving_mid_stream_frees_its_row(server):
    url, state, kv = server
    with steps_held(state.engine):
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url + "/v1/completions",
                               json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 240, "stream": True}) as r:
                first = next(r.iter_lines())
                assert first.startswith("data: ")
                # it failed now and then inside the whole suite only: say what the stream gave first
                poll(lambda: len(state.scheduler.jobs) == 1, f"request running (its first event: {first[:300]})")
                steps = state.scheduler.batch.steps
        assert [f for f in files_under(kv) if os.path.isfile(f) and "contexts" not in f]  # its KV files, until freed
    poll(lambda: not state.scheduler.jobs, "row freed after the client left")
    assert state.scheduler.batch.steps - steps <= 2  # the step held when it left, and at most one more
    assert b"edgekv_requests_cancelled_total 1.0" in httpx.get(url + "/metrics").content
    assert not [f for f in files_under(kv) if os.path.isfile(f) and "contexts" not in f]


def test_a_client_leaving_a_whole_response_frees_its_row(server):
    url, state, _ = server
    cancelled = _metric(url, "edgekv_requests_cancelled_total")
    with steps_held(state.engine):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 240},
                       timeout=httpx.Timeout(60, read=1.0))
        poll(lambda: [j.cancelled.is_set() for j in state.scheduler.jobs.values()] == [True], "disconnect seen")
    poll(lambda: not state.scheduler.jobs, "row freed after the client left")
    assert _metric(url, "edgekv_requests_cancelled_total") == cancelled + 1


def test_multi_turn_chat_prefills_only_what_is_new(server):
    url, state, _ = server
    client = openai_client(url)
    turn1 = [{"role": "user", "content": WORDS}]
    reply = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=6, temperature=0)
    first_ids = state.engine.tokenize(turn1, chat=True)
    poll(lambda: state.engine.context_store.match(first_ids + [5]) is not None, "turn 1 saved")
    before = _metric(url, "edgekv_prompt_tokens_from_store_total")
    turn2 = turn1 + [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "and the key of the river"}]
    client.chat.completions.create(model="tiny", messages=turn2, max_tokens=4, temperature=0)
    from_store = _metric(url, "edgekv_prompt_tokens_from_store_total") - before
    assert from_store >= len(first_ids) // 8 * 8 > 0  # turn 1's whole chunks came from the store


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_are_prometheus_text_with_what_the_issue_lists(server):
    url, _, _ = server
    post(url, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6})
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(r.text)}
    for name in ("edgekv_requests", "edgekv_prompt_tokens", "edgekv_generation_tokens",
                 "edgekv_time_to_first_token_seconds", "edgekv_decode_rate_tokens_per_second", "edgekv_kv_bytes_read",
                 "edgekv_reuse_rate", "edgekv_io_stall_share", "edgekv_kv_resident_bytes"):
        assert name in names, name
    assert _metric(url, "edgekv_kv_bytes_read_total") > 0 and _metric(url, "edgekv_kv_resident_bytes") > 0
    assert 'edgekv_requests_total{endpoint="/v1/completions",status="200"}' in r.text


# ---- text ---------------------------------------------------------------------------------------------------


class Chars:
    """A tokenizer whose token i is the i-th string given (what decode needs)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).encode("latin-1", "replace").decode("utf-8", "replace")


def test_text_stream_holds_back_what_a_stop_string_may_claim():
    stream = TextStream(Chars(["ab", "c<", "/s", ">tail"]), ["</s>"])
    out = [stream.push(i) for i in range(4)]
    assert out == ["", "a", "bc", ""] and stream.stopped  # the last 3 characters wait: "</" turned out to start it
    plain = TextStream(Chars(["ab", "c<", "/x"]), ["</s>"])
    assert "".join([plain.push(i) for i in range(3)]) + plain.finish() == "abc</x"


def test_text_stream_waits_for_a_split_character():
    euro = "€".encode()  # three bytes, split over two tokens
    stream = TextStream(Chars([euro[:2].decode("latin-1"), euro[2:].decode("latin-1") + "!"]), [])
    assert stream.push(0) == "" and stream.push(1) + stream.finish() == "€!"


# ---- shutdown, the CLI, the unit file -----------------------------------------------------------------------


def test_shutdown_ends_work_in_flight_and_leaves_no_kv_file(text_model, tmp_path):
    results = {}
    with serving(text_model, tmp_path, store=False) as (url, state):
        def ask():
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", url + "/v1/completions", json={
                        "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 240, "stream": True}) as r:
                    results["events"] = [line for line in r.iter_lines() if line]

        asker = threading.Thread(target=ask)
        asker.start()
        poll(lambda: len(state.scheduler.jobs) == 1, "request running")
        assert [f for f in files_under(tmp_path) if os.path.isfile(f)]
    asker.join(120)
    assert results["events"][-1] == "data: [DONE]"  # finished within the grace, or ended with an error event
    assert not [f for f in files_under(tmp_path) if os.path.isfile(f)]


def test_sigterm_on_the_cli_server(tmp_path):
    """The real command: SIGTERM while a stream runs; the stream ends properly, exit 0, no KV file left."""
    kv = tmp_path / "kv"
    kv.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "edgekv.cli", "serve", "--model", "fixture", "--port", "0",
                             "--kv-path", str(kv), "--no-context-store", "--shutdown-grace-s", "2"],
                            stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:
            if "Uvicorn running on" in line:
                port = int(line.rsplit(":", 1)[1].split()[0])
                break
        assert port, "uvicorn did not start"
        url = f"http://127.0.0.1:{port}"
        poll(lambda: httpx.get(url + "/health").status_code == 200, "fixture loaded")
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url + "/v1/completions", json={
                    "model": "fixture", "prompt": list(range(1, 40)), "max_tokens": 30000, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and "shut down" in events[-2]
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
    assert not [f for f in files_under(kv) if os.path.isfile(f)]


def test_cli_flags_are_checked(tmp_path, capsys):
    from edgekv.cli import main

    with pytest.raises(SystemExit):  # argparse: one of them
        main(["serve", "--platform", "local", "--config", "x.json"])
    assert main(["serve", "--model", "fixture", "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err
    assert main(["serve", "--model", "fixture", "--max-body-mib", "0"]) == 2
    with pytest.raises(FileNotFoundError, match="make deploy PLATFORM=orin"):
        deployed_config("orin", tmp_path)


def test_resolve_takes_the_deployed_model_and_kv_paths(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": "/models/smol", "kv_paths": ["/a", "/b"], "G": 4}))
    model, kv_paths, names = resolve(ServeOptions(config=str(config)))
    assert (model, kv_paths, names) == ("/models/smol", ["/a", "/b"], ("smol", "/models/smol"))
    with pytest.raises(ValueError, match="which model"):
        resolve(ServeOptions())


def test_service_unit_runs_serve_with_the_deployed_config(tmp_path):
    unit = service_unit("orin", tmp_path / "deploy/orin/config.json", tmp_path, "/venv/bin/python", port=8080)
    assert "[Service]" in unit and "[Install]" in unit and "KillSignal=SIGTERM" in unit
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_line == (f"ExecStart=/venv/bin/python -m edgekv.cli serve --config "
                         f"{tmp_path}/deploy/orin/config.json --host 127.0.0.1 --port 8080")
    assert f"WorkingDirectory={tmp_path}" in unit
