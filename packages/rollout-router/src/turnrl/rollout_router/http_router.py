"""OpenAI-compatible HTTP router in front of engines (``turnrl-router serve``).

Passes ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``
through to an engine chosen by the in-process :class:`~turnrl.rollout_router.router.Router`
(sticky on the ``x-session-id`` header, least in flight otherwise, capped, circuit-broken),
streaming responses included. A request is retried on another engine only while nothing
has been sent back to the caller. Also serves:

- ``POST /abort_requests``: ``{}`` aborts everything, ``{"session_id": ...}`` one session;
  re-sends the abort every 0.5 s while an aborted request still streams, answers once they
  have ended (``{"aborted": n, "sends": k}``). Those the engine has not ended within
  ``drain_timeout`` seconds (its API server stalled, say) are escalated: the upstream
  connection is closed (vLLM aborts on that), the caller's response ends as vLLM ends an
  aborted one (finish reason ``abort``, then ``[DONE]`` on a stream), the engine's circuit
  opens until a health check finds it answering, the event is counted
  (``abort_escalations_total``) and the route answers 504 (``{"escalated": n, ...}``) --
  at the deadline, however little the engine answers;
- ``GET /health`` (200 while at least one engine's circuit is closed, else 503),
  ``GET /metrics`` (Prometheus text), ``GET /engines`` (JSON per engine).

The engine files a request under the id the router sends as ``X-Request-Id`` (and, for
``/inference/v1/generate``, writes into the body): the body's ``request_id``, else the
caller's ``X-Request-Id``, else a fresh one. Other bodies are relayed byte for byte, not
parsed. ``turnrl-router serve`` runs :meth:`HttpRouter.serve`, a small HTTP/1.1 relay
(:mod:`turnrl.rollout_router.http11`) on uvloop; :meth:`HttpRouter.app` is the same routes
as an aiohttp application, to embed.

This is what litellm user simulators and evaluation tools talk to.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import httptools
from aiohttp import web
from multidict import CIMultiDict

from turnrl.rollout_router.client import ABORT_RESEND_S, ENGINE_ID_PREFIX
from turnrl.rollout_router.http11 import (
    HOP_HEADERS,
    EnginePool,
    Headers,
    Request,
    ServerConnection,
)
from turnrl.rollout_router.protocol import (
    EngineUnavailableError,
    NoEngineAvailableError,
    PartialGenerationError,
)
from turnrl.rollout_router.router import CLOSED, EngineState, Router, RouterConfig

log = logging.getLogger(__name__)

PASS_THROUGH = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
GENERATE = "/inference/v1/generate"
SESSION_HEADER = "x-session-id"
# Most prompts of one /v1/completions call aborted by id (vLLM files them as cmpl-<id>-<i>).
_MAX_PROMPTS_ABORTED = 16
_MAX_BODY = 256 * 1024 * 1024


@dataclass(eq=False)
class _Proxied:
    request_id: str
    session_id: str | None
    engine: str = ""
    task: asyncio.Task[object] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    relayed: bool = False
    """The response's head went to the caller (a stream is under way)."""
    between_events: bool = True
    """What was relayed ends at a Server-Sent Events boundary."""
    escalated: bool = False
    """Its abort was not confirmed in time: the task is cancelled to end it as aborted."""


class _ClientGoneError(Exception):
    """The caller went away mid-response (not the engine's fault)."""


def _engine_ids(request_id: str) -> list[str]:
    """Every id vLLM may file a proxied request under."""
    ids = [ENGINE_ID_PREFIX + request_id, f"chatcmpl-{request_id}"]
    return ids + [f"cmpl-{request_id}-{i}" for i in range(_MAX_PROMPTS_ABORTED)]


def _aborted_choice(path: str, stream: bool) -> dict[str, Any]:
    """The last choice vLLM sends for an aborted request on ``path``."""
    if path == GENERATE:
        return {"index": 0, "token_ids": [], "logprobs": {"content": []}}
    if path == "/v1/chat/completions":
        message = {"role": "assistant", "content": ""}
        return {"index": 0, "delta": {}} if stream else {"index": 0, "message": message}
    return {"index": 0, "text": ""}


async def _end_aborted(entry: _Proxied, path: str, body: bytes, sink: _Sink) -> None:
    """End a request whose abort its engine did not confirm as vLLM ends an aborted one:
    finish reason ``abort`` (on a stream a last event, then ``[DONE]``). A stream cut
    inside an event is closed instead."""
    if entry.relayed and not entry.between_events:
        raise PartialGenerationError(f"{entry.engine}: abort not confirmed mid-event", None)
    try:
        stream = entry.relayed or json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        stream = False
    ids = {GENERATE: ENGINE_ID_PREFIX, "/v1/chat/completions": "chatcmpl-"}
    answer = {
        ("request_id" if path == GENERATE else "id"): ids.get(path, "cmpl-") + entry.request_id,
        "choices": [{**_aborted_choice(path, stream), "finish_reason": "abort"}],
    }
    if not stream:
        sink.respond_json(200, answer)
        return
    if not entry.relayed:
        await _maybe(sink.start(200, [(b"Content-Type", b"text/event-stream")]))
    await _maybe(sink.write(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(answer).encode()))
    await _maybe(sink.end())


class _Sink(Protocol):
    """Where a proxied response goes (the fast server's connection, or aiohttp's)."""

    def respond(self, status: int, headers: Headers, body: bytes) -> None: ...
    def respond_json(self, status: int, payload: object) -> None: ...
    def start(self, status: int, headers: Headers) -> Coroutine[Any, Any, None] | None: ...
    def write(self, chunk: bytes) -> Coroutine[Any, Any, None] | None: ...
    def end(self) -> Coroutine[Any, Any, None] | None: ...
    async def drain(self) -> None: ...


class _AiohttpSink:
    """A :class:`_Sink` for the aiohttp application."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=_str_headers(headers))

    def respond_json(self, status: int, payload: object) -> None:
        self.response = web.json_response(payload, status=status)

    async def start(self, status: int, headers: Headers) -> None:
        self.response = web.StreamResponse(status=status, headers=_str_headers(headers))
        try:
            await self.response.prepare(self.request)
        except ConnectionResetError as exc:
            raise _ClientGoneError(str(exc)) from exc

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(chunk)
        except ConnectionResetError as exc:
            raise _ClientGoneError(str(exc)) from exc

    async def end(self) -> None:
        assert self.response is not None
        try:
            await self.response.write_eof()
        except ConnectionResetError as exc:
            raise _ClientGoneError(str(exc)) from exc

    async def drain(self) -> None:
        return None  # write() waits for the client already


def _str_headers(headers: Headers) -> CIMultiDict[str]:
    return CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in headers)


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("utf-8", "surrogateescape")


class HttpRouter:
    """The HTTP front of a :class:`Router`: :meth:`serve` (the fast server that
    ``turnrl-router serve`` runs) or :meth:`app` (the same routes as an aiohttp
    application, to embed)."""

    def __init__(
        self,
        router: Router,
        *,
        drain_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        max_body: int = _MAX_BODY,
    ) -> None:
        self.router = router
        """The routing core."""
        self.drain_timeout = drain_timeout
        """Seconds ``/abort_requests`` waits for aborted requests to end."""
        self.connect_timeout = connect_timeout
        """Seconds to connect to an engine."""
        self.read_timeout = read_timeout
        """Seconds an engine may stay silent while it owes a response."""
        self.max_body = max_body
        """Largest request body :meth:`serve` takes (bytes)."""
        self._proxied: set[_Proxied] = set()
        self._http: aiohttp.ClientSession | None = None
        self._pools: dict[str, EnginePool] = {}
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = 0

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the router's health loop and the client for control calls."""
        if self._http is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
            self._http = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
            )
        await self.router.start()

    async def close(self) -> None:
        """Stop the router and close every engine connection."""
        await self.router.close()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def serve(
        self, host: str = "127.0.0.1", port: int = 8080, *, reuse_port: bool = False
    ) -> asyncio.Server:
        """Start the router and serve it on ``host:port``; stop with ``server.close()``
        and :meth:`close`."""
        await self.start()
        loop = asyncio.get_running_loop()
        return await loop.create_server(
            lambda: ServerConnection(self._handle, self.max_body),
            host,
            port,
            backlog=1024,
            reuse_port=reuse_port or None,
        )

    def app(self) -> web.Application:
        """The same routes as an aiohttp application (startup and cleanup hooks)."""
        app = web.Application(client_max_size=self.max_body)
        for path in PASS_THROUGH:
            app.router.add_post(path, self._aiohttp_proxy)
        app.router.add_post("/abort_requests", self._aiohttp_abort)
        app.router.add_get("/health", self._aiohttp_health)
        app.router.add_get("/metrics", self._aiohttp_metrics)
        app.router.add_get("/engines", self._aiohttp_engines)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _: web.Application) -> None:
        await self.start()

    async def _cleanup(self, _: web.Application) -> None:
        await self.close()

    # ------------------------------------------------------------ fast server
    async def _handle(self, conn: ServerConnection, request: Request) -> None:
        try:
            await self._route(conn, request)
        except Exception as exc:  # a bug: answer 500 if nothing was sent, else cut it short
            log.exception("turnrl-router: %s %s failed", request.method, request.path)
            if conn.started:
                conn.close()
            else:
                conn.respond_json(500, {"error": f"router error: {exc!r}"})

    async def _route(self, conn: ServerConnection, request: Request) -> None:
        path, method = request.path, request.method
        if path in PASS_THROUGH:
            if method != b"POST":
                conn.respond_json(405, {"error": f"{path} takes POST"})
                return
            headers = request.headers
            try:
                await self._proxy(
                    path,
                    request.body,
                    _header(headers, b"x-session-id"),
                    headers.get(b"authorization"),
                    _header(headers, b"x-request-id"),
                    conn,
                )
            except PartialGenerationError:
                conn.close()  # headers already sent: cut the stream short
            return
        if path == "/abort_requests":
            if method != b"POST":
                conn.respond_json(405, {"error": f"{path} takes POST"})
                return
            conn.respond_json(*await self._abort_body(request.body))
        elif path in ("/health", "/metrics", "/engines"):
            if method not in (b"GET", b"HEAD"):
                conn.respond_json(405, {"error": f"{path} takes GET"})
            elif path == "/health":
                conn.respond_json(*self._health_body())
            elif path == "/metrics":
                conn.respond_text(200, self.router.prometheus())
            else:
                conn.respond_json(200, self.router.metrics())
        else:
            conn.respond_json(404, {"error": f"no route {path}"})

    # ------------------------------------------------------------ pass-through
    def _new_id(self) -> str:
        self._ids += 1
        return f"{self._id_prefix}{self._ids:x}"

    def _prepare(self, path: str, body: bytes, header_id: str | None) -> tuple[str, bytes] | str:
        """The request id and the body to send, or why the request is refused.

        Only ``/inference/v1/generate`` bodies (the id goes in there) and bodies that name a
        ``request_id`` are parsed; other bodies go through untouched, their id taken from
        an ``X-Request-Id`` header or made up (the engine files the request under the
        ``X-Request-Id`` the router sends, which is what aborts use)."""
        if path == GENERATE or b'"request_id"' in body:
            try:
                payload = json.loads(body) if body else {}
            except ValueError as exc:
                return f"request body is not JSON: {exc}"
            if not isinstance(payload, dict):
                return "request body must be a JSON object"
            given = payload.get("request_id")
            rid = str(given or header_id or self._new_id())
            if path == GENERATE and given != rid:
                payload["request_id"] = rid
                body = json.dumps(payload).encode()
        else:
            if body and (body[:1] != b"{" or body[-1:] != b"}"):
                stripped = body.strip()
                if stripped and (stripped[:1] != b"{" or stripped[-1:] != b"}"):
                    return "request body must be a JSON object"
            rid = header_id or self._new_id()
        if not (rid.isascii() and rid.isprintable()) or len(rid) > 512:
            return "request_id must be printable ASCII (at most 512 characters)"
        return rid, body

    async def _proxy(
        self,
        path: str,
        body: bytes,
        session_id: str | None,
        auth: bytes | None,
        header_id: str | None,
        sink: _Sink,
    ) -> None:
        """Relay one request to an engine the router picks; answer through ``sink``."""
        prepared = self._prepare(path, body, header_id)
        if isinstance(prepared, str):
            sink.respond_json(400, {"error": prepared})
            return
        rid, body = prepared
        entry = _Proxied(rid, session_id, task=asyncio.current_task())
        self._proxied.add(entry)
        headers = b"Content-Type: application/json\r\nX-Request-Id: %s\r\n" % rid.encode()
        if auth is not None:
            headers += b"Authorization: %s\r\n" % auth
        target = path.encode()

        async def forward(e: EngineState) -> None:
            entry.engine = e.url
            await self._forward(e.url, target, body, headers, sink, entry)

        try:
            await self.router.call(session_id, forward)
        except NoEngineAvailableError as exc:
            sink.respond_json(503, {"error": str(exc)})
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not entry.escalated or task is None:
                raise
            task.uncancel()  # our own cancellation (see abort), not the caller leaving
            await _end_aborted(entry, path, body, sink)
        finally:
            self._proxied.discard(entry)
            entry.done.set()

    def _pool(self, url: str) -> EnginePool:
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = EnginePool(url, self.connect_timeout, self.read_timeout)
        return pool

    async def _forward(
        self, url: str, path: bytes, body: bytes, headers: bytes, sink: _Sink, entry: _Proxied
    ) -> None:
        pool = self._pool(url)
        try:
            conn = await pool.request(path, body, headers)
        except (OSError, TimeoutError, httptools.HttpParserError) as exc:
            raise EngineUnavailableError(f"{url}: {exc!r}") from exc
        started = False
        try:
            if conn.status >= 500:
                text = (await conn.read_body())[:300].decode("utf-8", "replace")
                raise EngineUnavailableError(f"{url} -> HTTP {conn.status}: {text}")
            out: Headers = [(n, v) for n, v in conn.headers if n.lower() not in HOP_HEADERS]
            if not conn.event_stream:
                sink.respond(conn.status, out, await conn.read_body())
                return
            started = True
            await _maybe(sink.start(conn.status, out))
            entry.relayed = True
            while (chunk := await conn.next_chunk()) is not None:
                entry.between_events = False
                await _maybe(sink.write(chunk))
                entry.between_events = chunk.endswith(b"\n\n")
                await sink.drain()
            await _maybe(sink.end())
        except (OSError, TimeoutError, httptools.HttpParserError) as exc:
            if not started:
                raise EngineUnavailableError(f"{url}: {exc!r}") from exc
            raise PartialGenerationError(f"{url} failed mid-stream: {exc!r}", None) from exc
        finally:
            pool.release(conn)

    # ------------------------------------------------------------ aiohttp application
    async def _aiohttp_proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        sink = _AiohttpSink(request)
        headers = request.headers
        auth = headers.get("Authorization")
        try:
            await self._proxy(
                request.path,
                body,
                headers.get(SESSION_HEADER),
                None if auth is None else auth.encode("utf-8", "surrogateescape"),
                headers.get("X-Request-Id"),
                sink,
            )
        except (PartialGenerationError, _ClientGoneError) as exc:
            raise ConnectionResetError(str(exc)) from exc  # headers already sent: end it
        assert sink.response is not None
        return sink.response

    async def _aiohttp_abort(self, request: web.Request) -> web.Response:
        status, payload = await self._abort_body(await request.read())
        return web.json_response(payload, status=status)

    async def _aiohttp_health(self, _: web.Request) -> web.Response:
        status, payload = self._health_body()
        return web.json_response(payload, status=status)

    async def _aiohttp_metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.router.prometheus(), content_type="text/plain")

    async def _aiohttp_engines(self, _: web.Request) -> web.Response:
        return web.json_response(self.router.metrics())

    # ------------------------------------------------------------ control routes
    async def _abort_body(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            payload = json.loads(body) if body.strip() else {}
        except ValueError:
            return 400, {"error": "body must be JSON"}
        if not isinstance(payload, dict):
            return 400, {"error": "body must be a JSON object"}
        session_id = payload.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            return 400, {"error": "session_id must be a string"}
        targets = [p for p in self._proxied if session_id is None or p.session_id == session_id]
        aborted, sends, escalated = await self.abort(targets, everything=session_id is None)
        if escalated:
            error = (
                f"{escalated} request(s) did not end within {self.drain_timeout}s of the abort "
                f"(sent {sends} times); their connections were closed and they ended as aborted"
            )
            return 504, {"error": error, "aborted": aborted, "sends": sends, "escalated": escalated}
        return 200, {"aborted": aborted, "sends": sends}

    def _health_body(self) -> tuple[int, dict[str, Any]]:
        up = [e.url for e in self.router.engines if e.circuit == CLOSED]
        return (200 if up else 503), {"healthy_engines": up}

    async def abort(self, targets: list[_Proxied], *, everything: bool) -> tuple[int, int, int]:
        """Abort proxied requests (and, with ``everything``, all engine requests); drain.

        Returns ``(aborted, sends, escalated)``: how many requests, how many times it was
        sent, and how many were not confirmed within ``drain_timeout``.

        The abort is sent again every ``ABORT_RESEND_S`` while a target still streams: vLLM
        ignores an abort for a request it has not registered yet. At ``drain_timeout`` the
        requests left are escalated: their upstream connections closed (vLLM aborts on
        that), their callers' responses ended as aborted, and their engines marked
        (:meth:`Router.abort_unconfirmed`).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        pending = list(targets)
        sends = 0
        while True:
            await self._send_aborts(
                pending, everything, max(0.05, min(deadline - loop.time(), 5.0))
            )
            sends += 1
            remaining = deadline - loop.time()
            pending = [p for p in pending if not p.done.is_set()]
            if pending and remaining > 0:
                waiters = [asyncio.ensure_future(p.done.wait()) for p in pending]
                _, still = await asyncio.wait(waiters, timeout=min(remaining, ABORT_RESEND_S))
                for w in still:
                    w.cancel()
                pending = [p for p in pending if not p.done.is_set()]
            if not pending:
                return len(targets), sends, 0
            if loop.time() >= deadline:
                break
        for p in pending:  # last resort: drop the upstream connection (vLLM aborts on it)
            p.escalated = True
            if p.task is not None:
                p.task.cancel()
        why = f"{self.drain_timeout}s after the abort (sent {sends} times)"
        for url in {p.engine for p in pending if p.engine}:
            self.router.abort_unconfirmed(url, why)
        ended = [asyncio.ensure_future(p.done.wait()) for p in pending]
        _, still = await asyncio.wait(ended, timeout=ABORT_RESEND_S)  # they end at once
        for w in still:
            w.cancel()
        return len(targets), sends, len(pending)

    async def _send_aborts(self, targets: list[_Proxied], everything: bool, timeout: float) -> None:
        by_engine: dict[str, list[str]] = {}
        for p in targets:
            if p.engine:
                by_engine.setdefault(p.engine, []).extend(_engine_ids(p.request_id))
        jobs = []
        for e in self.router.engines:
            ids = by_engine.get(e.url, [])
            if ids:
                url = e.url + "/inference/v1/abort_requests"
                jobs.append(self._post(url, {"request_ids": ids}, timeout))
            if everything and e.circuit == CLOSED:
                jobs.append(self._post(e.url + "/abort_requests", {}, timeout))
        await asyncio.gather(*jobs, return_exceptions=True)

    async def _post(self, url: str, body: object, timeout: float = 10.0) -> None:
        assert self._http is not None
        limit = aiohttp.ClientTimeout(total=timeout)
        async with self._http.post(url, json=body, timeout=limit) as r:
            await r.read()


def build_parser() -> argparse.ArgumentParser:
    """Command-line parser of ``turnrl-router``."""
    parser = argparse.ArgumentParser(prog="turnrl-router", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the HTTP router")
    serve.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="URL",
        help="engine base URL (repeat for several)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--max-concurrency-per-engine", type=int, default=8)
    serve.add_argument("--health-interval", type=float, default=0.5)
    serve.add_argument("--drain-timeout", type=float, default=10.0)
    return parser


async def _maybe(result: Coroutine[Any, Any, None] | None) -> None:
    if result is not None:
        await result


async def serve_forever(http: HttpRouter, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then close."""
    server = await http.serve(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows
            loop.add_signal_handler(sig, stop.set)
    print(f"turnrl-router: serving on http://{host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        await http.close()


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (every platform but Windows)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``turnrl-router`` console script."""
    args = build_parser().parse_args(argv)
    for url in args.engine:
        if not url.startswith(("http://", "https://")):
            raise SystemExit(f"turnrl-router: --engine must be an http(s) URL, got {url!r}")
    config = RouterConfig(
        max_concurrency_per_engine=args.max_concurrency_per_engine,
        health_interval=args.health_interval,
    )
    http = HttpRouter(Router(args.engine, config), drain_timeout=args.drain_timeout)
    _run(serve_forever(http, args.host, args.port))


if __name__ == "__main__":
    main()
