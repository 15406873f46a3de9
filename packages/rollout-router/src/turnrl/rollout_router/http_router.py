"""OpenAI-compatible HTTP router in front of engines (``turnrl-router serve``).

Passes ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``
through to an engine chosen by the in-process :class:`~turnrl.rollout_router.router.Router`
(sticky on the ``x-session-id`` header, least in flight otherwise, capped, circuit-broken),
streaming responses included. A request is retried on another engine only while nothing
has been sent back to the caller. Also serves:

- ``POST /abort_requests``: ``{}`` aborts everything, ``{"session_id": ...}`` one session;
  re-sends the abort every 0.5 s while an aborted request still streams, answers once they
  have ended (``{"aborted": n, "sends": k}``), or 504 if they do not within
  ``drain_timeout`` seconds;
- ``GET /health`` (200 while at least one engine's circuit is closed, else 503),
  ``GET /metrics`` (Prometheus text), ``GET /engines`` (JSON per engine).

This is what litellm user simulators and evaluation tools talk to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from turnrl.rollout_router.client import ABORT_RESEND_S, ENGINE_ID_PREFIX
from turnrl.rollout_router.protocol import (
    EngineUnavailableError,
    NoEngineAvailableError,
    PartialGenerationError,
)
from turnrl.rollout_router.router import CLOSED, EngineState, Router, RouterConfig

PASS_THROUGH = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
SESSION_HEADER = "x-session-id"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}
# Most prompts of one /v1/completions call aborted by id (vLLM files them as cmpl-<id>-<i>).
_MAX_PROMPTS_ABORTED = 16


@dataclass
class _Proxied:
    request_id: str
    session_id: str | None
    engine: str = ""
    task: asyncio.Task[object] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _engine_ids(request_id: str) -> list[str]:
    """Every id vLLM may file a proxied request under."""
    ids = [ENGINE_ID_PREFIX + request_id, f"chatcmpl-{request_id}"]
    return ids + [f"cmpl-{request_id}-{i}" for i in range(_MAX_PROMPTS_ABORTED)]


class HttpRouter:
    """The aiohttp application around a :class:`Router`."""

    def __init__(self, router: Router, *, drain_timeout: float = 10.0) -> None:
        self.router = router
        """The routing core."""
        self.drain_timeout = drain_timeout
        """Seconds ``/abort_requests`` waits for aborted requests to end."""
        self._proxied: dict[str, _Proxied] = {}
        self._http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        """The web application (routes, startup and cleanup hooks)."""
        app = web.Application()
        for path in PASS_THROUGH:
            app.router.add_post(path, self._proxy)
        app.router.add_post("/abort_requests", self._abort)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/engines", self._engines)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=600.0)
        self._http = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        await self.router.start()

    async def _cleanup(self, _: web.Application) -> None:
        await self.router.close()
        if self._http is not None:
            await self._http.close()

    # ------------------------------------------------------------ pass-through
    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            payload = json.loads(body) if body else {}
        except json.JSONDecodeError as exc:
            return web.json_response({"error": f"request body is not JSON: {exc}"}, status=400)
        if not isinstance(payload, dict):
            return web.json_response({"error": "request body must be a JSON object"}, status=400)
        rid = str(payload.get("request_id") or uuid.uuid4().hex)
        if request.path == "/inference/v1/generate":
            payload["request_id"] = rid
            body = json.dumps(payload).encode()
        session_id = request.headers.get(SESSION_HEADER)
        entry = _Proxied(rid, session_id, task=asyncio.current_task())
        self._proxied[rid] = entry
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        if auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        try:

            async def forward(e: EngineState) -> web.StreamResponse:
                entry.engine = e.url
                return await self._forward(request, e.url + request.path, body, headers)

            return await self.router.call(session_id, forward)
        except NoEngineAvailableError as exc:
            return web.json_response({"error": str(exc)}, status=503)
        except PartialGenerationError as exc:  # headers already sent: end the stream
            raise ConnectionResetError(str(exc)) from exc
        finally:
            del self._proxied[rid]
            entry.done.set()

    async def _forward(
        self, request: web.Request, url: str, body: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        assert self._http is not None
        started: web.StreamResponse | None = None
        try:
            async with self._http.post(url, data=body, headers=headers) as upstream:
                if upstream.status >= 500:
                    text = await upstream.text()
                    raise EngineUnavailableError(f"{url} -> HTTP {upstream.status}: {text[:300]}")
                out_headers = {
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS
                }
                if "text/event-stream" not in upstream.headers.get("Content-Type", ""):
                    data = await upstream.read()
                    return web.Response(status=upstream.status, body=data, headers=out_headers)
                started = web.StreamResponse(status=upstream.status, headers=out_headers)
                await started.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await started.write(chunk)
                await started.write_eof()
                return started
        except (aiohttp.ClientError, TimeoutError) as exc:
            if started is None:
                raise EngineUnavailableError(f"{url}: {exc!r}") from exc
            raise PartialGenerationError(f"{url} failed mid-stream: {exc!r}", None) from exc

    # ------------------------------------------------------------ control routes
    async def _abort(self, request: web.Request) -> web.Response:
        try:
            payload = await request.json() if request.can_read_body else {}
        except json.JSONDecodeError:
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(payload, dict):
            return web.json_response({"error": "body must be a JSON object"}, status=400)
        session_id = payload.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            return web.json_response({"error": "session_id must be a string"}, status=400)
        targets = [
            p for p in self._proxied.values() if session_id is None or p.session_id == session_id
        ]
        try:
            aborted, sends = await self.abort(targets, everything=session_id is None)
        except TimeoutError as exc:
            return web.json_response({"error": str(exc)}, status=504)
        return web.json_response({"aborted": aborted, "sends": sends})

    async def abort(self, targets: list[_Proxied], *, everything: bool) -> tuple[int, int]:
        """Abort proxied requests (and, with ``everything``, all engine requests); drain.

        Returns ``(aborted, sends)``: how many requests, and how many times it was sent.

        The abort is sent again every ``ABORT_RESEND_S`` while a target still streams: vLLM
        ignores an abort for a request it has not registered yet. After ``drain_timeout``
        the upstream connections left are closed (vLLM aborts on that) and this raises.
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
                return len(targets), sends
            if loop.time() >= deadline:
                break
        for p in pending:  # last resort: drop the upstream connection (vLLM aborts on it)
            if p.task is not None:
                p.task.cancel()
        raise TimeoutError(
            f"{len(pending)} request(s) did not end within {self.drain_timeout}s of the abort "
            f"(sent {sends} times); their connections were closed"
        )

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

    async def _health(self, _: web.Request) -> web.Response:
        up = [e.url for e in self.router.engines if e.circuit == CLOSED]
        return web.json_response({"healthy_engines": up}, status=200 if up else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=self.router.prometheus(), content_type="text/plain")

    async def _engines(self, _: web.Request) -> web.Response:
        return web.json_response(self.router.metrics())


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
    web.run_app(http.app(), host=args.host, port=args.port, access_log=None)


if __name__ == "__main__":
    main()
