"""A published store read over HTTP(S): any static server (or S3-compatible bucket) that serves
the store folder and honours ``Range``.  Read-only; one keep-alive connection per thread."""
from __future__ import annotations

import http.client
import ssl
import threading
import urllib.parse

import numpy as np

from .errors import ChunkUnavailable
from .local import byte_view
from .meta import check_blob, check_rel

_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class HttpBackend:
    def __init__(self, base_url: str, timeout_s: float = 30.0):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url.rstrip("/") + "/"
        self.timeout_s = timeout_s
        self._scheme, self._netloc = parts.scheme, parts.netloc
        self._prefix = parts.path.rstrip("/") + "/"
        self._query = f"?{parts.query}" if parts.query else ""
        self._local = threading.local()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        if self._scheme == "https":
            conn = http.client.HTTPSConnection(self._netloc, timeout=self.timeout_s, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self._netloc, timeout=self.timeout_s)
        self._local.conn = conn
        return conn, False

    def _drop(self) -> None:
        """Forget this thread's connection: after an error its state is unknown, so it is never reused."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _get(self, rel: str, headers: dict) -> http.client.HTTPResponse:
        """GET, once more on a fresh connection if a reused keep-alive one was closed by the server while idle."""
        path = self._prefix + urllib.parse.quote(rel) + self._query
        for _ in range(2):
            conn, reused = self._connection()
            try:
                conn.request("GET", path, headers=headers)
                return conn.getresponse()
            except _STALE:
                self._drop()
                if not reused:
                    raise
        raise AssertionError("unreachable")

    def read_file(self, rel: str) -> bytes | None:
        """A whole small file (index, context ids); None on 404."""
        url = self.base_url + check_rel(rel)
        try:
            resp = self._get(rel, {})
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise ChunkUnavailable(f"GET {url}: {exc!r}") from exc
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise ChunkUnavailable(f"GET {url}: HTTP {resp.status} {resp.reason}")
        return body

    def read_range(self, blob: str, offset: int, nbytes: int, out: np.ndarray) -> None:
        """Fill out[:nbytes] from one ranged GET; anything but a 206 of exactly that range raises ChunkUnavailable."""
        view = byte_view(out, nbytes)
        rel = f"chunks/{check_blob(blob)}.kv"
        last = offset + nbytes - 1
        where = f"GET {self.base_url}{rel} bytes {offset}-{last}"
        try:
            resp = self._get(rel, {"Range": f"bytes={offset}-{last}"})
            if resp.status != 206:
                hint = {200: " (the server ignores Range: serve the folder with a server that supports it)",
                        404: " (not published, or evicted from the store)"}.get(resp.status, "")
                raise ChunkUnavailable(f"{where}: HTTP {resp.status} {resp.reason}{hint}")
            content_range = resp.getheader("Content-Range", "")
            if not content_range.startswith(f"bytes {offset}-{last}/"):
                raise ChunkUnavailable(f"{where}: the server answered Content-Range {content_range!r}")
            length = resp.getheader("Content-Length")
            if length is not None and int(length) != nbytes:
                raise ChunkUnavailable(f"{where}: Content-Length {length}, expected {nbytes}")
            done = 0
            while done < nbytes:
                got = resp.readinto(view[done:])
                if not got:
                    raise ChunkUnavailable(f"{where}: body ended after {done} of {nbytes} bytes")
                done += got
            if not resp.isclosed() and resp.read(1):
                raise ChunkUnavailable(f"{where}: the body is longer than {nbytes} bytes")
        except ChunkUnavailable:
            self._drop()
            raise
        except (OSError, http.client.HTTPException) as exc:  # timeouts, resets, IncompleteRead
            self._drop()
            raise ChunkUnavailable(f"{where}: {exc!r}") from exc
