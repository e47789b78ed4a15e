"""The OpenAI wire format: request models (validated at the edge) and the response bodies built from a finished job.

Field names and shapes follow the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``) as the
``openai`` Python client sends and parses them.  A field the server cannot honour is refused with a 400 naming
it, never ignored: unknown fields, and known ones (penalties, logprobs, n, ...) at anything but their neutral value.
Types are strict (``max_tokens: "5"``, ``prompt: [1, true]`` are refused, not coerced); a float field takes an int.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from edgekv.runtime.errors import unencodable

MAX_STOP_STRINGS = 4  # as the OpenAI API allows


class RequestError(Exception):
    """A request the server refuses: ``status`` (400, 404, ...) and the field it names (``param``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.headers = param, status, kind, headers or {}

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None,
               status: int | None = None) -> dict:
    """The OpenAI error shape; ``status`` only in a stream's error event, where no status line can carry it."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    if status is not None:
        error["status"] = status
    return {"error": error}


def _strings(value, param: str = ""):
    """Every string in a request with the field it sits at (``messages[0].content[1].text``)."""
    if isinstance(value, str):
        yield param, value
    elif isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields} | (value.model_extra or {})
        for name, item in fields.items():
            yield from _strings(item, f"{param}.{name}" if param else name)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{param}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{param}[{i}]")


# fields a client may send that change nothing at these values; anything else is refused by name
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (None, False, 0),
           "top_logprobs": (None, 0), "logit_bias": (None, {}), "echo": (False,), "best_of": (None, 1),
           "suffix": (None, ""), "parallel_tool_calls": (None,), "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"}), "service_level": (None,), "service_tier": (None, "auto"),
           "store": (None, False), "metadata": (None, {}), "modalities": (None, ["text"]), "reasoning_effort": (None,),
           "prediction": (None,), "audio": (None,), "functions": (None, []), "function_call": (None, "none")}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints share.  OpenAI's defaults: temperature 1, top_p 1."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # not OpenAI's; llama-server and vLLM take it
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list of strings once validated
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own logs: nothing to honour

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is served (one choice per request); send several requests")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stops

    def refuse_unsupported(self) -> None:
        """Text UTF-8 cannot encode, unknown fields, and known ones away from their neutral value, are named
        (outside pydantic, whose validators would bury the field name in a generic error)."""
        for param, text in _strings(self):  # JSON's "\ud800" decodes to text a tokenizer fails on, naming nothing
            if (why := unencodable(text)) is not None:
                raise RequestError(f"{param}: {why}", param=param)
        for name, value in (self.model_extra or {}).items():
            if name not in NEUTRAL:
                raise RequestError(f"unknown field {name!r}: this server takes {sorted(self.known_fields())}",
                                   param=name)
            if value not in NEUTRAL[name]:
                raise RequestError(f"field {name!r}={value!r:.60} is not supported here; drop it or send "
                                   f"{NEUTRAL[name][0]!r}", param=name)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")

    @classmethod
    def known_fields(cls) -> set[str]:
        return set(cls.model_fields)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"{len(prompt)} prompts in one request: send one prompt per request")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt is empty: send text or a list of token ids")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, content):
        if isinstance(content, list) and not content:
            raise ValueError("an empty list of parts: send the text, or one or more {\"type\": \"text\", \"text\": "
                             "...} parts")
        return content

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- the response bodies, as the OpenAPI schema declares them (documentation: routes build plain dicts) ------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    status: int | None = Field(None, description="in a stream's error event only: the HTTP status the whole "
                                                 "response would have had (500, 503, 507)")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "loading", "stopped", "error"]
    model: str | None = None
    message: str | None = None


REFUSALS = {"4XX": {"model": ErrorResponse, "description": "refused: the message names the field or limit, and the fix"},
            503: {"model": ErrorResponse, "description": "the model is loading, failed to load, or the server is "
                                                         "shutting down: retry when /health answers 200; or the KV "
                                                         "disk cannot be used (read-only, failing): the message says "
                                                         "what the server's log says"}}
SERVER_ERROR = {500: {"model": ErrorResponse, "description": "this request failed; the message names the request id "
                                                             "under which the server's log has the cause"},
                507: {"model": ErrorResponse, "description": "the KV disk is full: the message says what the "
                                                             "server's log says"}}
STREAM = {"text/event-stream": {"schema": {  # one server-sent event, as a client parses it
    "type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": "a JSON chunk (the completion's shape, choices[].text or .delta), an error "
                                         "body, or [DONE] last"}}}}}


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Envelope:
    """One response's id, creation time and model, and the body (or stream chunk) of each endpoint."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = request_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _wrap(self, obj: str, choices: list, usage_: dict | None) -> dict:
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def full(self, text: str, finish_reason: str, usage_: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
            return self._wrap("chat.completion", [choice], usage_)
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._wrap("text_completion", [choice], usage_)

    def chunk(self, text: str | None, finish_reason: str | None = None, usage_: dict | None = None,
              first: bool = False) -> dict:
        """A stream chunk; ``text`` None with a usage is the closing usage-only chunk (no choices)."""
        if text is None:
            return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage_)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._wrap("chat.completion.chunk", [choice], usage_)
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._wrap("text_completion", [choice], usage_)
