"""What bounds a client before a request reaches a route: its Host, its body's size and read time, the time it
takes to send its headers, and the metric series it can create.

The ASGI wrappers see every request, streaming ones and refusals included.  The header deadline lives in the
HTTP protocol (``header_deadline_protocol``): no ASGI code runs until the headers are in.  What a reverse proxy
in front should still add (TLS, per-client rate limits) is in README.md, "Serving behind a proxy".
"""
from __future__ import annotations

import asyncio
import json
import logging

from starlette.routing import Match

from .protocol import error_body

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
UNMATCHED_ROUTE = "unmatched"  # the one endpoint label of every path no route serves (404s): series stay bounded


async def _answer(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    """A JSON error that also closes the connection: what the client still sends is not read."""
    body = json.dumps(error_body(message, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class _Disconnected(Exception):
    pass


class BodyLimit:
    """413 for a body over ``max_bytes`` (by Content-Length before reading, else counted as it comes); 408 for one
    not complete within ``read_timeout_s`` (a stalled upload would hold its connection forever).  The body is
    read here and replayed to the app."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > self.max_bytes:  # h11 has checked it is a number
            return await self._too_large(send, int(length))
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout_s)
        except _TooLarge as exc:
            return await self._too_large(send, exc.nbytes)
        except _Disconnected:
            return
        except asyncio.TimeoutError:
            return await _answer(send, 408, f"the request body did not arrive within {self.read_timeout_s:g} s; "
                                            "send it whole (the server's --body-timeout-s)")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                raise _Disconnected
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                raise _TooLarge(size)
        return b"".join(chunks)

    async def _too_large(self, send, nbytes: int) -> None:
        await _answer(send, 413, f"request body is {nbytes} bytes, over this server's limit of {self.max_bytes}; "
                                 "send a shorter prompt or raise --max-body-mib")


def host_name(header: str) -> str:
    """The name of a Host header without its port: ``127.0.0.1:8080`` -> ``127.0.0.1``, ``[::1]:80`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class AllowedHosts:
    """400 for a request whose Host header is none of this server's names.  A page on another site whose DNS
    name is rebound to 127.0.0.1 would otherwise reach a loopback server that has no API key."""

    def __init__(self, app, names: tuple[str, ...]):
        self.app = app
        self.names = None if "*" in names else {n.lower().strip("[]") for n in names}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.names is None:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(header) not in self.names:
            return await _answer(send, 400, f"Host {header[:80]!r} is not a name this server answers to "
                                            f"({', '.join(sorted(self.names))}); the operator can add it with "
                                            "--allowed-hosts")
        return await self.app(scope, receive, send)


def route_label(routes, scope) -> str:
    """The path template of the route that serves ``scope`` (a wrong method still names its route), else one
    label for all the rest: a label per raw path would let any client grow /metrics without bound."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return route.path
    return UNMATCHED_ROUTE


class CountRequests:
    """``edgekv_requests_total{endpoint, status}`` for every answer, refusals by the limits included."""

    def __init__(self, app, metrics, routes):
        self.app, self.metrics, self.routes = app, metrics, routes

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
            self.metrics.requests.labels(route_label(self.routes, scope), str(status[0])).inc()


def header_deadline_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a deadline on each request's headers.  uvicorn closes an idle keep-alive
    connection, but a client that sends its headers a byte at a time would hold its connection forever.
    (uvicorn is imported here, when serving: ``make deploy`` imports this package for the unit file only.)"""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineH11(H11Protocol):
        def connection_made(self, transport):
            self._deadline, self._cycle_seen = None, None
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self.cycle is not self._cycle_seen:  # a request's headers are in
                self._cycle_seen = self.cycle
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is self._cycle_seen:  # no pipelined request began
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.info("closed a connection from %s: its request headers took over %g s", self.client,
                         header_timeout_s)
                self.transport.close()

    return HeaderDeadlineH11
