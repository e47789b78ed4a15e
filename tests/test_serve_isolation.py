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


def _stream_text(url: str, body: dict) -> tuple[int, str]:
    with httpx.Client(timeout=120) as client:
        r = client.post(url + "/v1/completions", json={**body, "stream": True})
    if r.status_code != 200:
        return r.status_code, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    return 200, "".join(c["choices"][0]["text"] for c in chunks)


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
