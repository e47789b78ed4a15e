"""The HTTP side: FastAPI routes in the OpenAI shape over one Scheduler.

The model loads in a thread after the server starts listening, so ``/health`` answers 503 while it loads and
200 once requests can run.  Limits are checked before a request is queued: the API key (every endpoint but
``/health``), the body size, the fields, the context (prompt + max_tokens within max_context) and the queue.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgekv.runtime.sampling import Sampler, SamplingParams

from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, Envelope, RequestError, SamplingRequest, error_body,
                       usage)
from .scheduler import Job, QueueFull, Scheduler, ServerClosing
from .text import TextStream

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI legacy completions default; chat defaults to the context left


@dataclass
class ServeSettings:
    model_names: tuple[str, ...]  # the first is the id /v1/models lists; requests may name any
    api_key: str | None = None
    max_queue: int = 64
    max_body_bytes: int = 4 * 2**20
    save_prompts: bool = True  # keep each chat prompt's KV in the context store (multi-turn reuse), when one is open


@dataclass
class ServerState:
    """What the routes share: the engine and scheduler once loaded, or why loading failed."""

    settings: ServeSettings
    load: Callable[[], object]  # -> an Engine
    on_load_error: Callable[[BaseException], None] = lambda exc: None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine: object = None
    scheduler: Scheduler | None = None
    error: BaseException | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.scheduler.alive

    @property
    def status(self) -> str:
        """What /health says: loading, ok, or stopped (the scheduler has ended: shutdown)."""
        if self.scheduler is None:
            return "loading"
        return "ok" if self.scheduler.alive else "stopped"

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="edgekv-load", daemon=True).start()

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            engine = self.load()
            scheduler = Scheduler(engine, self.metrics, self.settings.max_queue,
                                  save_prompts=self.settings.save_prompts and engine.context_store is not None)
            scheduler.start()
        except BaseException as exc:
            log.error("loading the model failed: %s", exc)
            self.error = exc
            self.on_load_error(exc)
            return
        with self._lock:
            self.engine, self.scheduler = engine, scheduler
        log.info("model %s ready in %.1f s: /health answers 200", self.settings.model_names[0],
                 time.perf_counter() - started)

    def begin_shutdown(self, grace_s: float) -> None:
        """SIGTERM/SIGINT: requests in flight get ``grace_s`` to finish, then end with an error event."""
        if self.scheduler is not None:
            self.scheduler.drain(grace_s)

    def close(self) -> None:
        with self._lock:  # kept: /health says "stopped" from now on
            scheduler, engine = self.scheduler, self.engine
        try:
            if scheduler is not None:
                scheduler.stop()
        finally:
            if engine is not None:
                engine.close()


# ---- limits that wrap the app (pure ASGI: they see every request, streaming ones too) ----------------------


class BodyLimit:
    """413 for a body over ``max_bytes``: by Content-Length before reading, or counted for a chunked upload
    (read here and replayed to the app)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if int(length) > self.max_bytes:
                return await self._refuse(send, int(length))
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(send, size)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        body = json.dumps(error_body(f"request body is {size} bytes, over this server's limit of {self.max_bytes}; "
                                     "send a shorter prompt or raise --max-body-mib", "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class CountRequests:
    """``edgekv_requests_total{endpoint, status}`` for every answer, refusals by the limits included."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def noting(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting)
        finally:
            self.metrics.requests.labels(scope["path"], str(status[0])).inc()


# ---- the app -----------------------------------------------------------------------------------------------


def create_app(state: ServerState) -> FastAPI:
    settings = state.settings

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start_loading()
        yield
        await asyncio.to_thread(state.close)

    app = FastAPI(title="edgekv", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CountRequests, metrics=state.metrics)

    def api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise RequestError("missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                               status=401, kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestError)
    async def _refused(request, exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if p != "body"]
        param = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".") or None
        if first["type"] == "json_invalid" or not loc:
            message = f"the body is not a JSON object of this endpoint's fields: {first['msg']}"
        else:
            message = f"field {param!r}: {first['msg'].removeprefix('Value error, ')}"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        if state.error is not None:
            return JSONResponse({"status": "error", "message": str(state.error)}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": state.status}, status_code=503)
        return {"status": "ok", "model": settings.model_names[0]}

    @app.get("/metrics", dependencies=[Depends(api_key)])
    async def metrics():
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(api_key)])
    async def models():
        engine = _ready(state).engine
        return {"object": "list", "data": [{"id": settings.model_names[0], "object": "model", "created": 0,
                                            "owned_by": "edgekv", "max_model_len": engine.config.max_context}]}

    @app.post("/v1/completions", dependencies=[Depends(api_key)])
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(state, request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(api_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(state, request, body, chat=True)

    app.state.server = state
    return app


def _ready(state: ServerState) -> ServerState:
    """503 until requests can run: loading, failed to load, or shut down."""
    if state.error is not None:
        raise RequestError(f"the model failed to load: {state.error}", status=503, kind="server_error")
    if not state.ready:
        raise RequestError(f"the model is {state.status}; retry when /health answers 200", status=503,
                           kind="server_error", headers={"Retry-After": "5"})
    return state


async def _generate(state: ServerState, request: Request, body: SamplingRequest, chat: bool):
    settings = state.settings
    body.refuse_unsupported()
    if body.model not in settings.model_names:
        raise RequestError(f"model {body.model!r} is not served here; this server serves {settings.model_names[0]!r}",
                           param="model", status=404, kind="invalid_request_error")
    engine, scheduler = _ready(state).engine, state.scheduler
    ids = _prompt_ids(engine, body, chat)
    max_context = engine.config.max_context
    budget = body.token_budget if chat else body.max_tokens
    field_name = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    if budget is None:
        budget = max_context - len(ids) if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_context - len(ids))
    if len(ids) + budget > max_context:
        raise RequestError(f"the prompt has {len(ids)} tokens and {field_name} is {budget}: {len(ids) + budget} "
                           f"tokens, over this model's max_context of {max_context}; shorten the prompt or lower "
                           f"{field_name} to {max_context - len(ids)}", param=field_name)
    # the request model already holds every field to the ranges SamplingParams checks
    sampler = Sampler(SamplingParams(body.temperature, body.top_k, body.top_p, body.seed), engine.model.device)

    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def notify(kind: str, data: dict) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed at shutdown: nobody is listening
            loop.call_soon_threadsafe(events.put_nowait, (kind, data))

    stops = set(engine.default_stops())
    if chat and engine.tokenizer is not None and engine.tokenizer.eos_token_id is not None:
        stops.add(engine.tokenizer.eos_token_id)
    envelope = Envelope(chat, body.model)
    job = Job(ids, budget, sampler, stops, TextStream(engine.tokenizer, body.stop), notify, save_prompt=chat,
              request_id=envelope.id)
    try:
        scheduler.submit(job)
    except QueueFull as exc:
        raise RequestError(str(exc), status=429, kind="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after_s)}) from exc
    except ServerClosing as exc:
        raise RequestError(str(exc), status=503, kind="server_error") from exc
    if body.stream:
        return StreamingResponse(_stream(scheduler, job, events, envelope, body.include_usage, len(ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(request, scheduler, job, events, envelope, len(ids))


def _prompt_ids(engine, body: SamplingRequest, chat: bool) -> list[int]:
    if chat:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise RequestError(f"{engine.model.hf.name_or_path} has no chat template: send the text to /v1/completions "
                               "instead", param="messages")
        prompt, param = [m.as_template_message() for m in body.messages], "messages"
    else:
        prompt, param = body.prompt, "prompt"
    try:
        return engine.tokenize(prompt)
    except ValueError as exc:
        raise RequestError(str(exc).replace("prompt 0", "the prompt"), param=param) from exc


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(scheduler: Scheduler, job: Job, events: asyncio.Queue, envelope: Envelope, include_usage: bool,
                  n_prompt: int):
    """Server-sent events: text chunks, the finishing chunk (with usage), the usage chunk when asked, [DONE].
    A client that leaves cancels the job: its row is free before the next step."""
    ended = False
    try:
        yield _sse(envelope.chunk("", first=True))
        while not ended:
            kind, data = await events.get()
            if kind == "text":
                yield _sse(envelope.chunk(data["text"]))
                continue
            ended = True
            if kind == "error":
                yield _sse(error_body(data["message"], "server_error"))
                break
            spent = usage(n_prompt, data["completion_tokens"])
            yield _sse(envelope.chunk("", data["finish_reason"], spent))
            if include_usage:
                yield _sse(envelope.chunk(None, usage_=spent))
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            scheduler.cancel(job)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(request: Request, scheduler: Scheduler, job: Job, events: asyncio.Queue, envelope: Envelope,
                 n_prompt: int):
    texts = []
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                scheduler.cancel(job)
                return Response(status_code=499)  # nobody reads it: the client closed the connection
            kind, data = get.result()
            if kind == "text":
                texts.append(data["text"])
            elif kind == "error":
                return JSONResponse(error_body(data["message"], "server_error"), status_code=data["status"])
            else:
                return envelope.full("".join(texts), data["finish_reason"], usage(n_prompt, data["completion_tokens"]))
    except asyncio.CancelledError:
        scheduler.cancel(job)
        raise
    finally:
        gone.cancel()
