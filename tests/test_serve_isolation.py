"""One request never harms another: a request's own failure ends its row only, hostile requests
interleaved with running streams never change them, and the API fuzzed from its own OpenAPI schema never
answers 500 or hangs."""
import os
import threading

import httpx
import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.sampling import Sampler, SamplingParams
from edgekv.serve.metrics import ServerMetrics
from edgekv.serve.scheduler import Job, Scheduler
from edgekv.serve.text import TextStream
from tests.conftest import files_under, save_chat_model
from tests.harness.serve_fuzz import (CANCEL_BURST, SHORT_PROMPTS, TRACEBACK, burst_body, cancel_burst, fuzz_checks,
                                     fuzz_strategy, hostile_requests, send_hostile, steer, stream_text)
from tests.serving import CFG, poll, post, serving, steps_held


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("isolation") / "m")


class SamplerFailingAt(Sampler):
    """A request whose own sampling fails at its ``n``-th token (what an overflow in torch.multinomial did)."""

    def __init__(self, n: int):
        super().__init__(SamplingParams(), torch.device("cpu"))
        self.n, self.calls = n, 0

    def __call__(self, logits):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return super().__call__(logits)


def _job(ids, n, sampler=None):
    ended = threading.Event()
    outcome = {}

    def notify(kind, data):
        if kind in ("done", "error"):
            outcome.update(kind=kind, **data)
            ended.set()

    job = Job(ids, n, sampler or Sampler(SamplingParams(), torch.device("cpu")), set(), TextStream(None, []), notify)
    return job, ended, outcome


@pytest.mark.parametrize("fails_at", [1, 3], ids=["at-join", "mid-decode"])
def test_a_request_whose_sampling_fails_ends_alone(model_dirs, kv_path, fails_at):
    """The failing request gets its error; the row beside it runs to its lone greedy tokens; the next request runs."""
    victim_ids, after_ids = list(range(1, 40)), list(range(9, 30))
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=CFG, device="cpu") as engine:
        engine.generate([list(range(1, 120))], max_new_tokens=1)  # fits the K adapter on enough keys to keep it
        alone = engine.generate([victim_ids], max_new_tokens=30, stop_token_ids=[])[0].token_ids
        scheduler = Scheduler(engine, ServerMetrics(), max_queue=8)
        victim, victim_done, victim_out = _job(victim_ids, 30)
        bad, bad_done, bad_out = _job([5, 6, 7], 10, SamplerFailingAt(fails_at))
        with steps_held(engine):
            scheduler.submit(victim)
            scheduler.start()
            poll(lambda: scheduler.jobs, "victim running")
            scheduler.submit(bad)
        assert bad_done.wait(120) and victim_done.wait(120)
        after, after_done, after_out = _job(after_ids, 5)
        scheduler.submit(after)
        assert after_done.wait(120)
        scheduler.stop()
    assert bad_out["kind"] == "error" and bad_out["status"] == 500
    assert victim_out["kind"] == "done" and victim.generated == alone
    assert after_out["kind"] == "done" and len(after.generated) == 5
    assert not [f for f in files_under(kv_path) if os.path.isfile(f)]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
def test_the_issue_repro_a_tiny_temperature_beside_a_running_stream(text_model, tmp_path, temperature):
    """Issue 28's repro over HTTP: a stream of 60 tokens is running when ``temperature: 1e-40`` arrives.  Before
    the fix the newcomer got a 500 and the stream ended at ~29 tokens with the same error."""
    victim = {"model": "tiny", "prompt": "the value of the river", "max_tokens": 60, "temperature": 0}
    with serving(text_model, tmp_path, store=False) as (url, state):
        code, alone = stream_text(url, victim)
        assert code == 200 and alone
        got = {}
        with steps_held(state.engine):
            runner = threading.Thread(target=lambda: got.update(victim=stream_text(url, victim)))
            runner.start()
            poll(lambda: state.scheduler.jobs, "the stream running")
            hostile = threading.Thread(target=lambda: got.update(hostile=post(
                url, "/v1/completions", {"model": "tiny", "prompt": [5], "max_tokens": 2, "temperature": temperature})))
            hostile.start()
            poll(lambda: state.scheduler._queue, "the tiny-temperature request queued")
        runner.join(120)
        hostile.join(120)
        assert got["hostile"].status_code == 200, got["hostile"].text
        assert got["hostile"].json()["usage"]["completion_tokens"] == 2
        assert got["victim"] == (200, alone)


# ---- the API fuzzed from its own OpenAPI schema ------------------------------------------------------------

FUZZ_EXAMPLES = 240  # bounded for CI; tests/harness/serve_fuzz.py runs thousands beside running streams
CANCEL_BURSTS = 6  # bounded for CI; the harness runs bursts for as long as it fuzzes
KEY = {"Authorization": "Bearer s3cret"}


def app_schema(settings) -> dict:
    """The schema the app serves at /openapi.json (with --openapi), built from the app itself."""
    from edgekv.serve import ServerState, create_app

    return create_app(ServerState(settings, load=lambda: None)).openapi()


@pytest.fixture(scope="module")
def fuzzed(text_model, tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    with serving(text_model, kv, api_key="s3cret", options={"header_timeout_s": 5.0}) as (url, state):
        yield url, state, kv


def test_the_api_fuzzed_from_its_own_schema(fuzzed):
    """No 500, no hung request (each has 60 s), every answer as the schema declares it (status, content type,
    body), schema-violating bodies refused, the key never skipped; the server healthy and every sequence's KV
    file gone afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    url, state, kv = fuzzed
    statuses = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=fuzz_strategy(app_schema(state.settings)), aimed=st.booleans())
    def fuzz(case, aimed):
        if aimed:
            steer(case, "tiny", 24)
        response = case.call(base_url=url, headers=KEY, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=fuzz_checks(case, aimed), headers=KEY)

    fuzz()
    assert statuses.count(200) >= 20 and 500 not in statuses  # a fair share reached the scheduler
    poll(lambda: not state.scheduler.jobs and not state.scheduler._queue, "every request finished")
    assert httpx.get(url + "/health").status_code == 200 and state.scheduler.alive
    assert not [f for f in files_under(kv) if os.path.isfile(f) and "contexts" not in f]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "the value", "max_tokens": 5, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the key"}], "max_tokens": 5, "stream": True}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the key"}], "max_tokens": 3})])
def test_answers_of_every_kind_are_what_the_schema_declares(fuzzed, path, body):
    """Whole and streamed answers of both endpoints through the schema's checks (the random fuzz may draw few
    streams): each server-sent event, each body, its status and content type as declared."""
    import schemathesis

    url, state, _ = fuzzed
    operation = schemathesis.openapi.from_dict(app_schema(state.settings)).find_operation_by_path("POST", path)
    case = operation.Case(body={"model": "tiny", **body}, media_type="application/json")
    response = case.call(base_url=url, headers=KEY, timeout=60)
    assert response.status_code == 200
    case.validate_response(response, checks=fuzz_checks(), headers=KEY)


# ---- hostile requests beside running streams ---------------------------------------------------------------


def test_hostile_requests_never_change_or_end_a_running_stream(text_model, tmp_path):
    """While well-formed streams run (greedy, seeded sampling, a chat), hostile requests arrive from several
    clients: refused fields, extreme values, malformed and oversized bodies, lone surrogates, prompts of 1 to 3
    tokens, the absolute-form target, clients that leave.  Every well-formed stream's text equals the same request
    run alone; no hostile request gets a 500 or a body with a traceback."""
    victims = [("/v1/completions", {"model": "tiny", "prompt": "the value of the river", "max_tokens": 120,
                                    "temperature": 0}),
               ("/v1/completions", {"model": "tiny", "prompt": [9, 8, 7, 6], "max_tokens": 100, "temperature": 0.9,
                                    "top_p": 0.95, "seed": 4}),
               ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "the key"}],
                                         "max_tokens": 110, "temperature": 0})]
    with serving(text_model, tmp_path, config={**CFG, "max_batch": 4}) as (url, state):
        alone = [stream_text(url, body, path) for path, body in victims]
        assert all(code == 200 and text for code, text in alone)
        hostile, statuses, bodies, running = hostile_requests("tiny"), [], [], threading.Event()
        running.set()

        def attacker(offset: int):
            i = offset
            while running.is_set() or i < offset + len(hostile):
                path, body = hostile[i % len(hostile)]
                status, text = send_hostile(url, path, body, i % 3)
                statuses.append(status)
                bodies.append(text)
                i += 1

        got = [None] * len(victims)

        def victim(j):
            got[j] = stream_text(url, victims[j][1], victims[j][0])

        attackers = [threading.Thread(target=attacker, args=(k * 7,)) for k in range(3)]
        streams = [threading.Thread(target=victim, args=(j,)) for j in range(len(victims))]
        for t in streams + attackers:
            t.start()
        for t in streams:
            t.join(300)
        running.clear()
        for t in attackers:
            t.join(300)
        assert got == alone
        assert len(statuses) >= len(hostile) and 500 not in statuses
        assert not [b for b in bodies if TRACEBACK in b]
        assert {400, 404, 413, 200} <= set(statuses)
        poll(lambda: not state.scheduler.jobs and not state.scheduler._queue, "every request finished")
        assert httpx.get(url + "/health").status_code == 200
    assert not [f for f in files_under(tmp_path) if os.path.isfile(f) and "contexts" not in f]


def test_every_hostile_request_alone_gets_its_answer_with_no_500_and_no_traceback(fuzzed):
    """Each of the hostile list once, read whole: a lone surrogate anywhere and ``content: []`` are 400s, prompts
    of 1 to 3 tokens (shorter than a group of G=4) are served, the absolute form is served for this server's
    authority and refused for another's; no answer is a 5xx or carries a traceback."""
    url, _, _ = fuzzed
    answers = [(path, body, *send_hostile(url, path, body, 0, KEY)) for path, body in hostile_requests("tiny")]
    assert not [(path, status) for path, _, status, _ in answers if status >= 500]
    assert not [path for path, _, _, text in answers if TRACEBACK in text]
    surrogates = [(status, text) for _, body, status, text in answers if isinstance(body, bytes) and b"\\ud" in body]
    assert len(surrogates) == 6 and all(s == 400 and "lone surrogate" in t for s, t in surrogates)
    short = [status for path, body, status, _ in answers
             if path == "/v1/completions" and isinstance(body, dict) and body.get("prompt") in SHORT_PROMPTS]
    assert len(short) == 7 and set(short) == {200}
    empty = [status for _, body, status, _ in answers if isinstance(body, dict) and body.get("messages") == [
        {"role": "user", "content": []}]]
    assert empty == [400]
    absolute = {path: status for path, _, status, _ in answers if path.lower().startswith("http://")}
    assert absolute == {"http://{authority}/health": 200, "HTTP://{authority}/v1/models": 200,
                        "http://{authority}/v1/completions": 200, "http://evil.example/health": 400}


def test_streams_closed_after_their_first_chunk_change_no_other_stream(text_model, tmp_path):
    """Bursts of eight greedy streams started together, a random half closed by their clients after the first
    chunk: every stream left open equals its lone run, whatever joined, finished or left beside it."""
    import random

    rng = random.Random(0)
    with serving(text_model, tmp_path, config={**CFG, "max_batch": 4}, store=False) as (url, state):
        alone = [stream_text(url, burst_body("tiny", i)) for i in range(len(CANCEL_BURST))]
        assert all(code == 200 and text for code, text in alone)
        for _ in range(CANCEL_BURSTS):
            leave = set(rng.sample(range(len(CANCEL_BURST)), len(CANCEL_BURST) // 2))
            kept = cancel_burst(url, "tiny", leave)
            assert sorted(kept) == sorted(set(range(len(CANCEL_BURST))) - leave)
            assert {i: got for i, got in kept.items() if got != alone[i]} == {}, leave
        poll(lambda: not state.scheduler.jobs and not state.scheduler._queue, "every request finished")
        cancelled = [line for line in httpx.get(url + "/metrics").text.splitlines()
                     if line.startswith("edgekv_requests_cancelled_total ")]
        assert float(cancelled[0].split()[1]) == CANCEL_BURSTS * len(CANCEL_BURST) // 2  # every one left running
    assert not [f for f in files_under(tmp_path) if os.path.isfile(f)]
