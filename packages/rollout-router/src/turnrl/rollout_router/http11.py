"""Minimal HTTP/1.1 for the HTTP router's hot path: engine connection pools and a server.

aiohttp's server and client cost ~170 µs of CPU per proxied request (request and response
objects, stream readers, per-request tasks and timers on both sides). These asyncio
protocols over ``httptools`` (llhttp, the parser Node.js uses) relay the same request in a
few tens of µs:

- :class:`EnginePool`: keep-alive connections to one engine; ``request`` sends a POST and
  returns the :class:`EngineConnection` once the response head arrived; its body is read
  chunk by chunk (chunked and Content-Length framing, back-pressure by pausing the socket);
- :class:`ServerConnection`: one client connection; parses requests (Content-Length or
  chunked bodies, ``Expect: 100-continue``, keep-alive, pipelining) and hands each to a
  coroutine that answers with a whole body or a chunked stream written straight to the
  socket. The coroutine runs as a task that is cancelled when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]
HOP_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})
_HIGH_WATER = 256 * 1024  # bytes of a response buffered before reading the engine pauses
_MAX_PIPELINED = 8  # requests queued on one client connection before reading it pauses


class EngineConnection(asyncio.Protocol):
    """One keep-alive connection to an engine; one request and response at a time."""

    def __init__(self, read_timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.active = False
        self._timer: asyncio.TimerHandle | None = None
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: Headers = []
        self.framed = False  # Content-Length or chunked (else the body ends at EOF)
        self.headers_done = False
        self.complete = False
        self.received = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.last_read = self.loop.time()

    # ---------------------------------------------------------------- protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.active and not self.complete:
            if self.headers_done and not self.framed:
                self.complete = True  # a body delimited by the end of the connection
                self.keep_alive = False
            else:
                self._fail(exc or ConnectionResetError("the engine closed the connection"))
        self._stop_timer()
        self._wake()

    # ---------------------------------------------------------------- parser
    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._stop_timer()
        self._wake()

    # ---------------------------------------------------------------- use
    def send(self, data: bytes) -> None:
        """Write one request (head and body in one write)."""
        assert self.transport is not None
        self.active = True
        self._begin()
        self._timer = self.loop.call_at(self.last_read + self.read_timeout, self._check_read)
        self.transport.write(data)

    async def response_head(self) -> None:
        """Wait for the status line and headers (raises what broke the connection)."""
        while not self.headers_done:
            await self._wait()

    @property
    def event_stream(self) -> bool:
        """Whether the response is Server-Sent Events (relayed as it comes)."""
        return any(
            n.lower() == b"content-type" and b"text/event-stream" in v for n, v in self.headers
        )

    async def next_chunk(self) -> bytes | None:
        """The body bytes received so far (waits for some), or None at its end."""
        while not self.chunks:
            if self.complete:
                return None
            await self._wait()
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def read_body(self) -> bytes:
        """The whole body."""
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Drop the connection (an engine aborts a request whose connection closes)."""
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- internals
    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None and not self.chunks:
            raise self.error

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_read(self) -> None:
        self._timer = None
        if self.complete or self.closed:
            return
        if self.loop.time() - self.last_read >= self.read_timeout:
            self._fail(TimeoutError(f"no data from the engine for {self.read_timeout}s"))
            self.close()
        else:
            self._timer = self.loop.call_at(self.last_read + self.read_timeout, self._check_read)


class EnginePool:
    """Keep-alive connections to one engine (as many as requests in flight)."""

    def __init__(self, url: str, connect_timeout: float = 5.0, read_timeout: float = 600.0):
        parts = urlsplit(url)
        https = parts.scheme == "https"
        self.url = url
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if https else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if https else None
        self.prefix = parts.path.rstrip("/").encode()
        self.host_header = parts.netloc.encode()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle: list[EngineConnection] = []

    async def _connect(self) -> EngineConnection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(
                lambda: EngineConnection(self.read_timeout), self.host, self.port, ssl=self.ssl
            ),
            self.connect_timeout,
        )
        return conn

    async def request(self, path: bytes, body: bytes, headers: bytes) -> EngineConnection:
        """POST ``body`` to ``path`` with ``headers`` (complete ``Name: value\\r\\n`` lines);
        returns the connection once the response head arrived. Read its body, then
        :meth:`release` it. Raises ``OSError``/``TimeoutError`` when the engine cannot be
        reached or fails before answering (a kept-alive connection the engine had just
        closed is retried once on a new one)."""
        data = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
            self.prefix,
            path,
            self.host_header,
            len(body),
            headers,
            body,
        )
        for attempt in range(2):
            conn = None
            while self.idle:
                candidate = self.idle.pop()
                if not candidate.closed:
                    conn = candidate
                    break
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            conn.send(data)
            try:
                await conn.response_head()
            except BaseException as exc:
                conn.close()
                stale = reused and not conn.received and not isinstance(exc, TimeoutError)
                if stale and attempt == 0 and isinstance(exc, OSError):
                    for idle in self.idle:  # likely closed together: start afresh
                        idle.close()
                    self.idle.clear()
                    continue
                raise
            return conn
        raise AssertionError("unreachable")

    def release(self, conn: EngineConnection) -> None:
        """Keep the connection for the next request if its response was read whole."""
        conn.active = False
        if conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close the idle connections."""
        for conn in self.idle:
            conn.close()
        self.idle.clear()


# ==================================================================== server side
@dataclass(slots=True)
class Request:
    """One parsed client request."""

    method: bytes
    path: str
    headers: dict[bytes, bytes]
    """Lower-cased names (the last of repeated headers)."""
    body: bytes
    keep_alive: bool


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date_cache: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode())
    return _date_cache[1]


class ServerConnection(asyncio.Protocol):
    """One client connection: requests are parsed here and answered by ``handler``.

    ``handler(conn, request)`` answers through :meth:`respond` (a whole body) or
    :meth:`start`, :meth:`write`, :meth:`end` (a chunked stream). It runs as a task,
    cancelled when the client disconnects; if it raises, or returns before answering, the
    connection is closed (a stream already started is cut short)."""

    def __init__(
        self,
        handler: Callable[[ServerConnection, Request], Coroutine[Any, Any, None]],
        max_body: int,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.handler = handler
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.reading_paused = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False
        # per response
        self.keep_alive = True
        self.started = False
        self.finished = False
        self.head_only = False

    # ---------------------------------------------------------------- protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # ---------------------------------------------------------------- parser
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            self._too_large = True
            return
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.max_body:
            self._too_large = True
        elif not self._too_large:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._too_large:
            self._refuse(413, f"request body larger than {self.max_body} bytes")
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        request = Request(
            self.parser.get_method(), path, self._headers, body, self.parser.should_keep_alive()
        )
        self.pending.append(request)
        if len(self.pending) > _MAX_PIPELINED and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()
        if self.task is None:
            self._next()

    # ---------------------------------------------------------------- requests
    def _next(self) -> None:
        request = self.pending.popleft()
        self.keep_alive = request.keep_alive
        self.started = self.finished = False
        self.head_only = request.method == b"HEAD"
        self.task = self.loop.create_task(self.handler(self, request))
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.task = None
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.debug("request ended with %r", exc)
        if self.closed:
            return
        if not self.finished or not self.keep_alive:
            self.close()
            return
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.pending:
            self._next()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be parsed or taken, then close."""
        self.pending.clear()
        if self.task is None and not self.closed:
            self.keep_alive = False
            self.started = self.finished = False
            self.head_only = False
            self.respond_json(status, {"error": message})
        self.close()

    def close(self) -> None:
        """Close the connection (after what was written is sent)."""
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    # ---------------------------------------------------------------- responses
    def _head(self, status: int, headers: Headers, framing: bytes) -> list[bytes]:
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
        parts += [b"%s: %s\r\n" % (n, v) for n, v in headers]
        parts.append(framing)
        if not self.keep_alive:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return parts

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """Answer with a whole body (``headers`` without framing headers)."""
        self.started = self.finished = True
        if self.closed or self.transport is None:
            return
        parts = self._head(status, headers, b"Content-Length: %d\r\n" % len(body))
        if not self.head_only:
            parts.append(body)
        self.transport.write(b"".join(parts))

    def respond_json(self, status: int, payload: object) -> None:
        """Answer with a JSON body."""
        headers = [(b"Content-Type", b"application/json; charset=utf-8"), (b"Date", _date())]
        self.respond(status, headers, json.dumps(payload).encode())

    def respond_text(self, status: int, text: str) -> None:
        """Answer with a plain-text body."""
        headers = [(b"Content-Type", b"text/plain; charset=utf-8"), (b"Date", _date())]
        self.respond(status, headers, text.encode())

    def start(self, status: int, headers: Headers) -> None:
        """Start a chunked response."""
        self.started = True
        if self.closed or self.transport is None:
            return
        head = self._head(status, headers, b"Transfer-Encoding: chunked\r\n")
        self.transport.write(b"".join(head))

    def write(self, chunk: bytes) -> None:
        """One chunk of a started response."""
        if chunk and not self.closed and self.transport is not None:
            self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))

    def end(self) -> None:
        """End a started response."""
        self.finished = True
        if not self.closed and self.transport is not None:
            self.transport.write(b"0\r\n\r\n")

    async def drain(self) -> None:
        """Wait while the client reads slower than the response is written."""
        while self.write_paused and not self.closed:
            self._drain = self.loop.create_future()
            await self._drain
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
