"""Test support, named as such (production code never imports it): a fake vLLM server.

:class:`FakeEngine` stands in for a vLLM server's HTTP API, on loopback, for routing tests
and benchmarks.

It speaks the subset of vLLM's API the router and client use -- ``/health``,
``/inference/v1/generate`` (streaming SSE chunks with ``generate-tokens-<id>`` ids and
per-token logprobs), ``/inference/v1/abort_requests`` (prefixed ids only, like vLLM),
``/abort_requests`` (all), ``/metrics`` (running gauge), ``/v1/completions`` and
``/v1/chat/completions`` (JSON or SSE) -- with knobs to make it slow, failing, stalled or
unhealthy, and :meth:`FakeEngine.kill` to make it vanish like a crashed process.

Generated tokens are a deterministic function of the prompt (``(sum(prompt) + i) % 1000``)
so tests can check exactly what came back and from where.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from turnrl.npu_runtime.net import free_port

PREFIX = "generate-tokens-"
# vLLM's RL control routes (VLLM_SERVER_DEV_MODE=1); the fake records the calls.
RL_ROUTES = (
    "/pause",
    "/resume",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weight_version",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
    "/sleep",
    "/wake_up",
)


@dataclass
class FakeEngine:
    """One fake engine server; ``await start()``, then use :attr:`url`."""

    token_delay: float = 0.0
    """Seconds between streamed tokens (0 answers at once)."""
    fail_status: int | None = None
    """Answer every generation with this HTTP status instead (e.g. 500)."""
    healthy: bool = True
    """Whether ``/health`` answers 200."""
    ignore_aborts: int = 0
    """Answer this many abort calls with 200 but abort nothing (vLLM does so for a request
    its engine has not registered yet)."""
    close_on_abort: bool = False
    """End an aborted stream by closing the connection instead of a final ``abort`` chunk
    (what a loaded vLLM server was seen to do)."""
    abort_reason: str = "abort"
    """Finish reason of the final chunk of an aborted stream (``length`` mimics an engine
    that labels a request cut short by an abort as length-capped)."""
    stalled: bool = False
    """Answer nothing while set: every route (``/health`` and aborts included) waits, and
    open streams send nothing, though connections are still accepted -- what a vLLM API
    server does while its engine-core process busy-polls the cores it needs."""
    name: str = "fake"
    """Reported in ``/v1/completions`` answers (``model``) to show where a request went."""
    port: int = 0
    """Port (0 picks a free one at start)."""
    keepalive_timeout: float = 75.0
    """Seconds an idle keep-alive connection stays open (vLLM's server: 5)."""
    decline_cache_reset: bool = False
    """Answer ``/reset_prefix_cache`` with ``{"success": false}`` (else vLLM's rule: declined
    while requests run, unless ``reset_running_requests=true`` preempts them)."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Bodies of the generation requests received."""
    aborted: set[str] = field(default_factory=set)
    """Engine-side ids that were aborted."""
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    """Engine-side id -> abort flag of generations in progress."""
    rl_calls: list[tuple[str, Any]] = field(default_factory=list)
    """(path with query, JSON body or None) of every RL control call received."""
    weight_version: str | None = None
    """What ``/weight_info`` reports (set by ``/update_weight_version``)."""
    paused: bool = False
    """Set by ``/pause``, cleared by ``/resume``."""
    pause_mode: str = "abort"
    """The ``mode`` of the last ``/pause``; with ``keep`` streams produce nothing while
    paused and go on after ``/resume``, as vLLM's keep-mode pause."""
    sleeping: set[str] = field(default_factory=set)
    """What ``/sleep`` put to sleep (``weights``, ``kv_cache``) and ``/wake_up`` not yet woke."""
    _runner: web.AppRunner | None = None
    _transports: set[asyncio.Transport] = field(default_factory=set)

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeEngine:
        """Listen on 127.0.0.1 (same port again after :meth:`kill`)."""
        app = web.Application(middlewares=[self._stall])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/inference/v1/abort_requests", self._abort)
        app.router.add_post("/abort_requests", self._abort_all)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        for route in RL_ROUTES:
            app.router.add_post(route, self._rl_call)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_get("/is_paused", self._is_paused)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        self.port = self.port or free_port()
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=0.1,
            keepalive_timeout=self.keepalive_timeout,
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def kill(self) -> None:
        """Vanish: close the listener and every open connection, mid-stream or not."""
        for transport in self._transports:
            transport.abort()  # reset the connection, as a dead process's kernel would
        self._transports.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _stall(self, request: web.Request, handler: Any) -> web.StreamResponse:
        await self._running()
        return await handler(request)  # type: ignore[no-any-return]

    async def _running(self) -> None:
        """Return once the server is not :attr:`stalled`."""
        while self.stalled:
            await asyncio.sleep(0.01)

    async def _rl_call(self, request: web.Request) -> web.Response:
        body: Any = await request.json() if request.can_read_body else None
        self.rl_calls.append((request.path_qs, body))
        if request.path == "/update_weight_version":
            self.weight_version = body["new_version"]
        elif request.path in ("/pause", "/resume"):
            self.paused = request.path == "/pause"
            self.pause_mode = request.query.get("mode", "abort") if self.paused else "abort"
        elif request.path == "/sleep":
            self.sleeping = {"weights", "kv_cache"}
        elif request.path == "/wake_up":
            self.sleeping -= set(request.query.getall("tags", ["weights", "kv_cache"]))
        elif request.path == "/reset_prefix_cache":  # vLLM declines while requests run
            preempt = request.query.get("reset_running_requests") == "true"
            done = not self.decline_cache_reset and (preempt or not self.running)
            return web.json_response({"success": done})
        return web.json_response({"ok": True})

    async def _weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def _is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": bool(self.sleeping)})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        text = f'vllm:num_requests_running{{engine="0"}} {len(self.running)}\n'
        text += 'vllm:num_requests_waiting{engine="0"} 0\n'
        return web.Response(text=text)

    async def _abort(self, request: web.Request) -> web.Response:
        if self.ignore_aborts > 0:
            self.ignore_aborts -= 1
            return web.Response(status=200)
        for rid in (await request.json()).get("request_ids", []):
            if rid in self.running:  # like vLLM: only the exact engine-side id matches
                self.aborted.add(rid)
                self.running[rid].set()
        return web.Response(status=200)

    async def _abort_all(self, _: web.Request) -> web.Response:
        for rid, flag in self.running.items():
            self.aborted.add(rid)
            flag.set()
        return web.json_response({"status": "aborted", "aborted": len(self.running)})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if request.transport is not None:
            self._transports.add(request.transport)
        if self.fail_status is not None:
            return web.json_response({"error": "injected failure"}, status=self.fail_status)
        rid = PREFIX + str(body["request_id"])
        prompt, params = body["token_ids"], body["sampling_params"]
        n = int(params.get("max_tokens", 16))
        flag = self.running[rid] = asyncio.Event()
        try:
            if not body.get("stream"):
                ids = [(sum(prompt) + i) % 1000 for i in range(n)]
                choice = {
                    "token_ids": ids,
                    "finish_reason": "length",
                    "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]},
                }
                return web.json_response({"request_id": rid, "choices": [choice]})
            return await self._stream(request, rid, prompt, n, flag)
        finally:
            del self.running[rid]

    async def _stream(
        self, request: web.Request, rid: str, prompt: list[int], n: int, flag: asyncio.Event
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            if self.token_delay:
                try:
                    await asyncio.wait_for(flag.wait(), self.token_delay)
                except TimeoutError:
                    pass
            await self._running()
            while self.paused and self.pause_mode == "keep" and not flag.is_set():
                await asyncio.sleep(0.005)
            if flag.is_set():
                if self.close_on_abort and request.transport is not None:
                    request.transport.close()
                    return resp
                await resp.write(_chunk(rid, [], self.abort_reason))
                break
            await resp.write(
                _chunk(rid, [(sum(prompt) + i) % 1000], "length" if i == n - 1 else None)
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.fail_status is not None:
            return web.json_response({"error": "injected failure"}, status=self.fail_status)
        request_id = request.headers.get("X-Request-Id", "x")
        chat = request.path == "/v1/chat/completions"
        answer: dict[str, Any] = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "model": self.name,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        }
        if not body.get("stream"):
            return web.json_response(answer)
        # Streamed: one chunk per token (max_tokens, default 1), abortable like vLLM by the
        # id it files the request under (chatcmpl-<id>, cmpl-<id>-<prompt index>).
        rid = f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}-0"
        flag = self.running[rid] = asyncio.Event()
        if request.transport is not None:
            self._transports.add(request.transport)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body.get("max_tokens") or 1)
            for i in range(n):
                if self.token_delay:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(flag.wait(), self.token_delay)
                await self._running()
                last = i == n - 1 or flag.is_set()
                finish = ("abort" if flag.is_set() else "stop") if last else None
                chunk = {**answer, "choices": [{"index": 0, "text": "ok", "finish_reason": finish}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if last:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            del self.running[rid]


def _chunk(rid: str, ids: list[int], finish: str | None) -> bytes:
    content = [{"token_id": t, "logprob": -0.5} for t in ids]
    choice = {
        "index": 0,
        "token_ids": ids,
        "finish_reason": finish,
        "logprobs": {"content": content},
    }
    return f"data: {json.dumps({'request_id': rid, 'choices': [choice]})}\n\n".encode()


@contextlib.contextmanager
def cpu_engines(
    model: str | Path, log_dir: str | Path, count: int = 2, **spec: Any
) -> Iterator[list[Any]]:
    """``count`` real vLLM servers of ``model`` on this host's CPU, started together, laid
    out on its cores as :class:`~turnrl.rollout_router.engine.EngineServer` lays out the
    engines of a host by default (their API servers on a core of their own); every one
    stopped (its whole process group) on exit.

    Args:
        model: A Hugging Face model folder.
        log_dir: Where the servers' logs go.
        count: How many servers (``EngineSpec.cpu_slot`` numbers them).
        spec: More :class:`~turnrl.rollout_router.engine.EngineSpec` fields (e.g.
            ``max_model_len``); ``served_model_name`` defaults to ``"tiny"``.

    Yields:
        The started :class:`~turnrl.rollout_router.engine.EngineServer` s.
    """
    from turnrl.rollout_router.engine import EngineServer, EngineSpec

    spec.setdefault("served_model_name", "tiny")
    servers = [
        EngineServer(
            EngineSpec(model=str(model), port=free_port(), cpu_slot=(i, count), **spec),
            log_dir=log_dir,
        )
        for i in range(count)
    ]

    async def start_all() -> None:
        await asyncio.gather(*(s.start_async() for s in servers))

    try:
        asyncio.run(start_all())
        yield servers
    finally:
        for server in servers:
            server.stop()


class ThreadedFakeEngine:
    """A :class:`FakeEngine` served from its own event loop on a daemon thread, for code
    that is not async (e.g. ``EngineLaunch(server=ThreadedFakeEngine)`` in a Ray actor)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = asyncio.run_coroutine_threadsafe(FakeEngine().start(), self.loop).result(30)
        self.url = self.engine.url

    def stop(self) -> None:
        """Kill the server and stop its thread."""
        asyncio.run_coroutine_threadsafe(self.engine.kill(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@contextlib.contextmanager
def fake_engine_processes(
    count: int, token_delay: float = 0.0
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """``count`` fake engines, each its own process (``python -m
    turnrl.rollout_router.testing``, its own session), for faults a process can have
    (SIGSTOP, SIGKILL); each killed (after a SIGCONT) on exit.

    Yields:
        ``(process, url)`` per engine; wait for ``/health`` before use.
    """
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for _ in range(count):
            port = free_port()
            cmd = [sys.executable, "-m", "turnrl.rollout_router.testing", "--port", str(port)]
            cmd += ["--token-delay", str(token_delay)]
            procs.append(subprocess.Popen(cmd, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        yield list(zip(procs, urls, strict=True))
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    """Serve one fake engine until killed: ``python -m turnrl.rollout_router.testing``."""
    import argparse

    parser = argparse.ArgumentParser(description="fake vLLM engine on loopback")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args(argv)

    async def serve() -> None:
        await FakeEngine(port=args.port, token_delay=args.token_delay).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
