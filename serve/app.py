"""The HTTP side: FastAPI routes in the OpenAI shape over one Scheduler.

The model loads in a thread after the server starts listening, so ``/health`` answers 503 while it loads and
200 once requests can run.  Limits are checked before a request is queued: the Host, the body's size and read
time (serve/limits.py), the API key (every endpoint but ``/health``), the fields, the context (prompt +
max_tokens within max_context) and the queue.  The OpenAPI schema is served only when asked for (``openapi``),
behind the key like every endpoint; the HTML doc pages, which load their scripts from a public CDN, never are.
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
from urllib.parse import unquote

from fastapi import Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgekv.runtime.sampling import Sampler, SamplingParams

from .limits import LOOPBACK_NAMES, AllowedHosts, BodyLimit, CountRequests
from .metrics import ServerMetrics
from .protocol import (REFUSALS, SERVER_ERROR, STREAM, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                       CompletionResponse, Envelope, Health, ModelList, RequestError, SamplingRequest, error_body,
                       request_id, usage)
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
    body_timeout_s: float = 60.0  # a request body not complete by then gets 408
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES  # Host header names answered ("*": any)
    openapi: bool = False  # serve /openapi.json (behind the key)

    def __post_init__(self):
        if self.api_key is not None:
            check_api_key(self.api_key)


def check_api_key(key: str) -> None:
    """A key travels in an HTTP header (latin-1 bytes) and is compared byte for byte: an empty key would turn
    auth off, and a key outside printable ASCII could never match what a client sends."""
    if not key:
        raise ValueError("the API key is empty: give a key, or give none (no --api-key-file, --api-key or "
                         "EDGEKV_API_KEY) to serve without one")
    bad = next((c for c in key if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        raise ValueError(f"the API key holds {ascii(bad)} at position {key.index(bad)}: a key must be printable "
                         "ASCII without spaces (HTTP headers carry it byte for byte)")


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


# ---- the app -----------------------------------------------------------------------------------------------


class ErrorJSON(JSONResponse):
    """An error body as ASCII JSON: a message or param may quote what the client sent, lone surrogates included,
    which UTF-8 cannot encode (a plain JSONResponse would fail while answering)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def unexpected_error(request_id_: str, status: int | None = None) -> dict:
    """The body of a failure the server did not foresee: the id its log files the traceback under, nothing else."""
    return error_body(f"the server could not answer this request; its log says why (request {request_id_})",
                      "server_error", status=status)


class LastResort:
    """Any exception that escapes a route (or an error handler) becomes the JSON 500 form, its traceback logged
    under a request id the client is told; nothing of it reaches the body.  A response already started (a
    stream) can only end: its route sends its own error event first."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def noting(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting)
        except Exception:
            rid = request_id("req")
            log.exception("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"))
            if not started:
                await ErrorJSON(unexpected_error(rid), status_code=500)(scope, receive, send)


class AbsoluteForm:
    """RFC 9112 section 3.2.2: a server MUST accept a request target in absolute form (``GET
    http://host:port/health``), which uvicorn passes on as the path; the path becomes the target's, and the
    target's authority replaces the Host header (as the RFC says), so the Host check sees what was asked for."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        raw = scope.get("raw_path") or b""
        if scope["type"] == "http" and raw[:8].lower().startswith((b"http://", b"https://")):
            authority, _, path = raw.partition(b"://")[2].partition(b"/")
            raw = b"/" + path
            host = authority.rpartition(b"@")[2]
            headers = [(k, v) for k, v in scope["headers"] if k != b"host"] + [(b"host", host)]
            scope = {**scope, "raw_path": raw, "path": unquote(raw.decode("ascii")), "headers": headers}
        return await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    settings = state.settings

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start_loading()
        yield
        await asyncio.to_thread(state.close)

    app = FastAPI(title="edgekv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.body_timeout_s)
    app.add_middleware(AllowedHosts, names=settings.allowed_hosts)
    app.add_middleware(CountRequests, metrics=state.metrics, routes=app.router.routes)  # counts all
    app.add_middleware(AbsoluteForm)  # before the Host check and the count: both see the target's path and host
    app.add_middleware(LastResort)  # the outermost

    bearer = HTTPBearer(auto_error=False, description="the server's key (--api-key-file or EDGEKV_API_KEY), when "
                                                       "it has one")

    def api_key(request: Request, _: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
        """Checked on the header's own bytes (``bearer`` only declares the scheme in the OpenAPI schema)."""
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        sent = key.strip().encode("latin-1")  # the header's bytes as the client sent them
        if scheme.lower() != "bearer" or not secrets.compare_digest(sent, settings.api_key.encode("ascii")):
            raise RequestError("missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                               status=401, kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestError)
    async def _refused(request, exc: RequestError):
        return ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        param, message = validation_error(exc.errors())
        return ErrorJSON(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return ErrorJSON(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": Health}})
    async def health():
        if state.error is not None:  # unauthenticated: the cause (paths, names) is in the server's log only
            return JSONResponse({"status": "error", "message": "the model failed to load; the server log says why"},
                                status_code=503)
        if not state.ready:
            return JSONResponse({"status": state.status}, status_code=503)
        return {"status": "ok", "model": settings.model_names[0]}

    @app.get("/metrics", dependencies=[Depends(api_key)], responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}, **REFUSALS})
    async def metrics():
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(api_key)], response_model=None,
             responses={200: {"model": ModelList}, **REFUSALS})
    async def models():
        engine = _ready(state).engine
        return {"object": "list", "data": [{"id": settings.model_names[0], "object": "model", "created": 0,
                                            "owned_by": "edgekv", "max_model_len": engine.config.max_context}]}

    @app.post("/v1/completions", dependencies=[Depends(api_key)], response_model=None,
              responses={200: {"model": CompletionResponse, "content": STREAM}, **REFUSALS, **SERVER_ERROR})
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(state, request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(api_key)], response_model=None,
              responses={200: {"model": ChatCompletionResponse, "content": STREAM}, **REFUSALS, **SERVER_ERROR})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(state, request, body, chat=True)

    if settings.openapi:
        @app.get("/openapi.json", dependencies=[Depends(api_key)], include_in_schema=False)
        async def openapi():
            return app.openapi()

    app.state.server = state
    return app


def validation_error(errors: list[dict]) -> tuple[str | None, str]:
    """(param, message) of pydantic's errors for a body.  A value that matches no member of a union (``prompt``)
    gives one error per member, each located under the member's type name: the param is the field, not
    ``prompt.str``.  Undecodable JSON names no field (pydantic locates it at a character offset)."""
    first = errors[0]
    if first["type"] == "string_unicode":  # a key JSON decoded to text UTF-8 cannot encode ("\ud800")
        param = _param(first["loc"][1:]) or None
        return param, (f"{param or 'the body'}: a field name holds a lone surrogate that UTF-8 cannot encode; "
                       "send valid Unicode")
    if first["type"] == "json_invalid" or len(first["loc"]) < 2:
        return None, f"the body is not a JSON object of this endpoint's fields: {first['msg']}"
    field_errors = [e["loc"] for e in errors if e["loc"][:2] == first["loc"][:2]]
    common = list(first["loc"])
    for loc in field_errors[1:]:
        while list(loc[: len(common)]) != common:
            common.pop()
    param = _param(common[1:])
    if len(field_errors) > 1:
        kinds = dict.fromkeys(str(e[len(common)]) for e in field_errors if len(e) > len(common))
        return param, f"field {param!r} is none of the types it takes ({', '.join(kinds)})"
    return param, f"field {param!r}: {first['msg'].removeprefix('Value error, ')}"


def _param(loc) -> str:
    """A pydantic location as the field it names: ``("messages", 0, "content")`` -> ``messages[0].content``."""
    return "".join(f"[{p}]" if str(p).isdigit() else f".{p}" for p in loc).lstrip(".")


def _ready(state: ServerState) -> ServerState:
    """503 until requests can run: loading, failed to load, or shut down."""
    if state.error is not None:
        raise RequestError("the model failed to load; the server log says why", status=503, kind="server_error")
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
            raise RequestError(f"{body.model} has no chat template: send the text to /v1/completions instead",
                               param="messages")
        prompt, param = [m.as_template_message() for m in body.messages], "messages"
    else:
        prompt, param = body.prompt, "prompt"
    try:
        return engine.tokenize(prompt)
    except ValueError as exc:  # the engine names the checkpoint's folder: clients know the model by its served id
        message = str(exc).replace("prompt 0", "the prompt").replace(engine.model.hf.name_or_path, body.model)
        raise RequestError(message, param=param) from exc


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
                yield _sse(error_body(data["message"], "server_error", status=data["status"]))
                break
            spent = usage(n_prompt, data["completion_tokens"])
            yield _sse(envelope.chunk("", data["finish_reason"], spent))
            if include_usage:
                yield _sse(envelope.chunk(None, usage_=spent))
        yield "data: [DONE]\n\n"
    except Exception:  # the headers went out: the stream ends with the error event, its traceback in the log
        log.exception("request %s: its stream failed", envelope.id)
        yield _sse(unexpected_error(envelope.id, status=500))
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
                return ErrorJSON(error_body(data["message"], "server_error"), status_code=data["status"])
            else:
                return envelope.full("".join(texts), data["finish_reason"], usage(n_prompt, data["completion_tokens"]))
    except asyncio.CancelledError:
        scheduler.cancel(job)
        raise
    finally:
        gone.cancel()
