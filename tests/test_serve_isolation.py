"""One request never harms another (issue 28): a request's own failure ends its row only, hostile requests
interleaved with running streams never change them, and the API fuzzed from its own OpenAPI schema never
answers 500 or hangs."""
import json
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
from tests.serving import CFG, poll, post, serving, sse_events, steps_held


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
def test_a_request_whose_sampling_fails_ends_alone(model_dirs, kv_dir, fails_at):
    """The failing request gets its error; the row beside it runs to its lone greedy tokens; the next request runs."""
    victim_ids, after_ids = list(range(1, 40)), list(range(9, 30))
    with Engine.from_pretrained(model_dirs["llama"], kv_offload_path=kv_dir, config=CFG) as engine:
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
    assert not [f for f in files_under(kv_dir) if os.path.isfile(f)]


def _stream_text(url: str, body: dict, path: str = "/v1/completions", headers: dict | None = None) -> tuple[int, str]:
    """(status, the streamed text) of a request; a stream that ends in an error event is not a whole text."""
    with httpx.Client(timeout=120) as client:
        r = client.post(url + path, json={**body, "stream": True}, headers=headers or {})
    if r.status_code != 200:
        return r.status_code, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return 200, "".join(ch.get("text") or ch.get("delta", {}).get("content") or "" for ch in choices)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
def test_the_issue_repro_a_tiny_temperature_beside_a_running_stream(text_model, tmp_path, temperature):
    """Issue 28's repro over HTTP: a stream of 60 tokens is running when ``temperature: 1e-40`` arrives.  Before
    the fix the newcomer got a 500 and the stream ended at ~29 tokens with the same error."""
    victim = {"model": "tiny", "prompt": "the value of the river", "max_tokens": 60, "temperature": 0}
    with serving(text_model, tmp_path, store=False) as (url, state):
        code, alone = _stream_text(url, victim)
        assert code == 200 and alone
        got = {}
        with steps_held(state.engine):
            runner = threading.Thread(target=lambda: got.update(victim=_stream_text(url, victim)))
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

FUZZ_EXAMPLES = 240  # bounded for CI; bench/serve_fuzz.py runs thousands beside running streams
KEY = {"Authorization": "Bearer s3cret"}


def api_schema(settings):
    """The schema the app serves at /openapi.json (with --openapi), built from the app itself."""
    import schemathesis

    from edgekv.serve import ServerState, create_app

    return schemathesis.openapi.from_dict(create_app(ServerState(settings, load=lambda: None)).openapi())


def fuzz_strategy(settings):
    """Schema-valid and schema-violating requests for every operation."""
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    return st.one_of([op.ok().as_strategy(mode) for op in api_schema(settings).get_all_operations()
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])


def steer(case, model: str, max_tokens: int) -> None:
    """Point a generated body at the served model with a short budget, so it reaches the scheduler (a random
    model name is a 404 before it)."""
    if isinstance(case.body, dict):
        case.body["model"] = model
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(name), int) and not isinstance(case.body[name], bool):
                case.body[name] = 1 + case.body[name] % max_tokens


def fuzz_checks():
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, ignored_auth, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            negative_data_rejection, ignored_auth]


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
    @given(case=fuzz_strategy(state.settings), aimed=st.booleans())
    def fuzz(case, aimed):
        if aimed:
            steer(case, "tiny", 24)
        response = case.call(base_url=url, headers=KEY, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=fuzz_checks(), headers=KEY)

    fuzz()
    assert statuses.count(200) >= 20 and 500 not in statuses  # a fair share reached the scheduler
    poll(lambda: not state.scheduler.jobs and not state.scheduler._queue, "every request finished")
    assert httpx.get(url + "/health").status_code == 200 and state.scheduler.alive
    assert not [f for f in files_under(kv) if os.path.isfile(f) and "contexts" not in f]


# ---- hostile requests beside running streams ---------------------------------------------------------------


def hostile_requests(model: str) -> list[tuple[str, object]]:
    """(path, JSON body or raw bytes): every refused field, extreme values, malformed and oversized bodies."""
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
    return bodies


def _hostile(url: str, path: str, body, kind: int) -> int | None:
    """One hostile request; some leave early (a stream closed after its first event, a whole one timed out)."""
    with httpx.Client(timeout=httpx.Timeout(60, read=0.05 if kind == 2 else 60)) as client:
        if isinstance(body, bytes):
            return client.post(url + path, content=body, headers={"content-type": "application/json"}).status_code
        if kind == 1:
            with client.stream("POST", url + path, json={**body, "stream": True}) as r:
                next(r.iter_lines(), None)
                return None  # gone mid-stream
        try:
            return client.post(url + path, json=body).status_code
        except httpx.ReadTimeout:
            return None  # gone before the answer


def test_hostile_requests_never_change_or_end_a_running_stream(text_model, tmp_path):
    """While well-formed streams run (greedy, seeded sampling, a chat), hostile requests arrive from several
    clients: refused fields, extreme values, malformed and oversized bodies, clients that leave.  Every
    well-formed stream's text equals the same request run alone; no hostile request gets a 500."""
    victims = [("/v1/completions", {"model": "tiny", "prompt": "the value of the river", "max_tokens": 120,
                                    "temperature": 0}),
               ("/v1/completions", {"model": "tiny", "prompt": [9, 8, 7, 6], "max_tokens": 100, "temperature": 0.9,
                                    "top_p": 0.95, "seed": 4}),
               ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "the key"}],
                                         "max_tokens": 110, "temperature": 0})]
    with serving(text_model, tmp_path, config={**CFG, "max_batch": 4}) as (url, state):
        alone = [_stream_text(url, body, path) for path, body in victims]
        assert all(code == 200 and text for code, text in alone)
        hostile, statuses, running = hostile_requests("tiny"), [], threading.Event()
        running.set()

        def attacker(offset: int):
            i = offset
            while running.is_set() or i < offset + len(hostile):
                path, body = hostile[i % len(hostile)]
                statuses.append(_hostile(url, path, body, i % 3))
                i += 1

        got = [None] * len(victims)

        def victim(j):
            got[j] = _stream_text(url, victims[j][1], victims[j][0])

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
        assert {400, 404, 413, 200} <= set(statuses)
        poll(lambda: not state.scheduler.jobs and not state.scheduler._queue, "every request finished")
        assert httpx.get(url + "/health").status_code == 200
    assert not [f for f in files_under(tmp_path) if os.path.isfile(f) and "contexts" not in f]
