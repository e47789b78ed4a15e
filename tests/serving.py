"""Helpers of the server's tests: the app under uvicorn in a thread, polling, and the clients that drive it."""
import contextlib
import threading
import time

import httpx

from edgekv.runtime import Engine
from edgekv.serve import ServerState, ServeSettings, create_app
from edgekv.serve.server import ServeOptions, uvicorn_config

CFG = {"G": 4, "M": 4, "C": 8, "max_context": 256, "max_batch": 2}
WORDS = "the value of the river is north and the key of the mountain is green"


def poll(check, what: str, limit_s: float = 60.0):
    """Wait for ``check()`` to hold (a liveness bound, not a speed assertion)."""
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit_s:g} s")
        time.sleep(0.02)


@contextlib.contextmanager
def serving(model, kv_path, config=CFG, names=("tiny",), load=None, store: bool = True, options: dict | None = None,
            **settings):
    """The app under uvicorn in a thread on a free port, with ``edgekv serve``'s uvicorn settings (``options``:
    ServeOptions fields); yields (base_url, state) once /health answers 200."""
    import uvicorn

    def load_engine():
        engine = Engine.from_pretrained(model, kv_path=kv_path, config=config, device="cpu")
        if store:
            engine.open_context_store(kv_path / "contexts", chunk_tokens=8)
        return engine

    state = ServerState(ServeSettings(tuple(names), save_prompts=store, **settings), load or load_engine)
    options = ServeOptions(**{"port": 0, "log_level": "warning", "shutdown_grace_s": 5.0, **(options or {})})
    server = uvicorn.Server(uvicorn_config(create_app(state), options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    poll(lambda: server.started, "uvicorn started")
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    if load is None:
        poll(lambda: httpx.get(url + "/health").status_code == 200, "model loaded")
    try:
        yield url, state
    finally:
        state.begin_shutdown(2.0)  # what a signal does (serve.server): work in flight gets 2 s
        server.should_exit = True
        thread.join(60)


def openai_client(url, key="none"):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def sse_events(text: str) -> list[str]:
    """The data fields of an SSE body; asserts the framing (every event one 'data: ' line and a blank line)."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


@contextlib.contextmanager
def steps_held(engine):
    """Decode steps wait at their start until the block exits: what runs and what waits is then fixed."""
    gate = threading.Event()

    def hold(event):
        if event.kind == "decode_step_start":
            gate.wait(60)

    engine.events.subscribe(hold)
    try:
        yield
    finally:
        gate.set()
        engine.events.unsubscribe(hold)
