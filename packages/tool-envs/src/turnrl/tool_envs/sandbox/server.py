"""The HTTP sandbox server: SandboxFusion's ``POST /run_code`` and ``GET /v1/ping``.

An aiohttp application that validates requests, hands each run to one of its fork servers
(:mod:`turnrl.tool_envs.sandbox.forkserver`) over a Unix socket pair and shapes the answer
as SandboxFusion does::

    {"status": "Success" | "Failed" | "SandboxError", "message": str,
     "compile_result": null,
     "run_result": {"status": "Finished" | "Error" | "TimeLimitExceeded",
                    "execution_time", "cpu_time", "return_code", "stdout", "stderr",
                    "stdout_truncated", "stderr_truncated"},
     "executor_pod_name": str, "files": {path: base64}}

``stdout_truncated`` / ``stderr_truncated`` are turnrl's additions (SandboxFusion clients
ignore unknown fields); a truncation is also spelled out in ``message``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from aiohttp import web

from turnrl.tool_envs.sandbox import wire
from turnrl.tool_envs.sandbox.child import LANGUAGES
from turnrl.tool_envs.sandbox.limits import SandboxLimits, containment_gaps

_FORKSERVER_START_TIMEOUT_S = 60.0


class ForkServerHandle:
    """The HTTP side of one fork-server process: send requests, match answers by id."""

    def __init__(self, index: int, config: SandboxLimits, slots: int, python_mode: str) -> None:
        self.index = index
        self.config = config
        self.slots = slots
        self.python_mode = python_mode
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.isolation: dict[str, Any] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        """Times the fork server died and was started again (in ``/v1/ping`` and the log)."""
        self.stopping = False
        self.alive = False
        self._restart_task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._reader_task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._restart_lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the process and wait until it has imported its modules and probed isolation."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k != "TURNRL_SANDBOX_TOKEN"}
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        cmd = [
            sys.executable,
            "-m",
            "turnrl.tool_envs.sandbox.forkserver",
            "--fd",
            str(theirs.fileno()),
            "--config",
            json.dumps(asdict(self.config)),
            "--slots",
            str(self.slots),
            "--python-mode",
            self.python_mode,
            "--worker-index",
            str(self.index),
        ]
        self.process = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        hello = await asyncio.wait_for(_read_message(reader), _FORKSERVER_START_TIMEOUT_S)
        if not hello or not hello.get("ready"):
            raise RuntimeError(f"fork server {self.index} failed to start")
        self.isolation = hello["isolation"]
        self.isolation["gaps"] = containment_gaps(self.isolation)
        self.isolation["restarts"] = self.restarts
        self._reader_task = asyncio.create_task(self._read_loop(reader))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        self.alive = True
        while True:
            message = await _read_message(reader)
            if message is None:
                break
            future = self.pending.pop(message["id"], None)
            if future is not None and not future.done():
                future.set_result(message)
        self.alive = False
        for future in self.pending.values():
            if not future.done():
                future.set_exception(RuntimeError(f"fork server {self.index} died during the run"))
        self.pending.clear()
        if not self.stopping:
            code = await asyncio.to_thread(self.process.wait) if self.process else None
            print(
                f"turnrl-sandbox: fork server {self.index} died (exit code {code}); restarting it",
                file=sys.stderr,
                flush=True,
            )
            self._restart_task = asyncio.create_task(self._restart_quietly())

    async def _restart_quietly(self) -> None:
        try:
            await self._ensure_running()
        except (OSError, RuntimeError, TimeoutError) as exc:  # the next request tries again
            print(
                f"turnrl-sandbox: restarting fork server {self.index} failed: {exc}",
                file=sys.stderr,
                flush=True,
            )

    async def _ensure_running(self) -> None:
        """Start a new fork server in place of a dead one (one restart at a time)."""
        async with self._restart_lock:
            if self.alive or self.stopping:
                return
            if self._writer is not None:
                self._writer.close()
            self._remove_runs_dir()
            self.restarts += 1
            await self.start()

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one request, first restarting a dead fork server.

        Raises:
            RuntimeError: the fork server died during the run, or cannot be started again.
        """
        if not self.alive:
            if self.stopping:
                raise RuntimeError(f"fork server {self.index} is stopping")
            try:
                await self._ensure_running()
            except (OSError, RuntimeError, TimeoutError) as exc:
                raise RuntimeError(
                    f"fork server {self.index} could not be restarted: {exc}"
                ) from exc
        assert self._writer is not None
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        self._writer.write(wire.encode({**request, "id": request_id}))
        await self._writer.drain()
        return await future

    async def stop(self) -> None:
        """Close the socket (the fork server then kills its runs and exits) and wait for it."""
        self.stopping = True
        if self._writer is not None:
            self._writer.close()
        if self.process is not None:
            try:
                await asyncio.to_thread(self.process.wait, 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait)
        self._remove_runs_dir()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task

    def _remove_runs_dir(self) -> None:
        """The fork server's private tmpfs was mounted on it; only the empty folder is left."""
        runs_dir = self.isolation.get("runs_dir")
        if runs_dir:
            with contextlib.suppress(OSError):
                os.rmdir(runs_dir)


async def _read_message(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    try:
        header = await reader.readexactly(4)
        body = await reader.readexactly(int.from_bytes(header, "big"))
    except asyncio.IncompleteReadError:
        return None
    return json.loads(body)


class RequestError(ValueError):
    """A request the server refuses (HTTP 422, like SandboxFusion's validation errors)."""


def parse_request(body: Any, config: SandboxLimits) -> dict[str, Any]:
    """Validate a ``/run_code`` body and fill in defaults; raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    code, language = body.get("code"), body.get("language")
    if not isinstance(code, str):
        raise RequestError("field 'code' is required and must be a string")
    if language not in LANGUAGES:
        raise RequestError(
            f"language {language!r} is not supported by this sandbox; supported: {', '.join(LANGUAGES)}"
        )
    run_timeout = body.get("run_timeout")
    run_timeout = config.default_run_timeout if run_timeout is None else run_timeout
    if not isinstance(run_timeout, int | float) or not 0 < run_timeout <= config.max_run_timeout:
        raise RequestError(f"run_timeout must be a number in (0, {config.max_run_timeout}]")
    memory = body.get("memory_limit_MB")
    memory = config.default_memory_mb if memory is None or memory == -1 else memory
    if not isinstance(memory, int) or not 0 < memory <= config.max_memory_mb:
        raise RequestError(
            f"memory_limit_MB must be -1 or an integer in [1, {config.max_memory_mb}]"
        )
    stdin, files = body.get("stdin"), body.get("files") or {}
    if stdin is not None and not isinstance(stdin, str):
        raise RequestError("stdin must be a string")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in files.items()
    ):
        raise RequestError("files must map relative paths to base64 strings")
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        raise RequestError("fetch_files must be a list of paths")
    return {
        "code": code,
        "language": language,
        "run_timeout": float(run_timeout),
        "memory_mb": memory,
        "stdin": stdin,
        "files": files,
        "fetch_files": fetch,
    }


def shape_response(result: dict[str, Any], pod: str) -> dict[str, Any]:
    """Turn a fork server's answer into SandboxFusion's RunCodeResponse."""
    if "error" in result:
        return {
            "status": "SandboxError",
            "message": result["error"],
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": pod,
            "files": {},
        }
    timed_out = result["timed_out"]
    run_status = "TimeLimitExceeded" if timed_out else "Finished"
    notes = []
    if timed_out:
        notes.append("time limit exceeded; the run's processes were killed")
    elif result["signal"]:
        notes.append(f"killed by {result['signal']}")
    for stream in ("stdout", "stderr"):
        if result[f"{stream}_truncated"]:
            notes.append(f"{stream} truncated to {len(result[stream].encode())} bytes")
    run_result = {
        key: result[key]
        for key in (
            "execution_time",
            "cpu_time",
            "return_code",
            "stdout",
            "stderr",
            "stdout_truncated",
            "stderr_truncated",
        )
    }
    run_result["status"] = run_status
    ok = not timed_out and result["return_code"] == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": "; ".join(notes),
        "compile_result": None,
        "run_result": run_result,
        "executor_pod_name": pod,
        "files": result["files"],
    }


class ContainmentError(RuntimeError):
    """The fork servers cannot contain runs here, and ``insecure`` was not given."""


class SandboxServer:
    """The aiohttp application and its fork servers.

    It refuses to start where a fork server lacks a protection (``containment_gaps``), unless
    ``insecure``: then it serves with a warning on stderr and the gaps in ``/v1/ping``.
    """

    def __init__(
        self,
        config: SandboxLimits | None = None,
        workers: int = 1,
        slots: int = 64,
        token: str | None = None,
        python_mode: str = "fork",
        insecure: bool = False,
    ) -> None:
        if workers < 1 or slots < 1:
            raise ValueError("workers and slots must be at least 1")
        self.config = config or SandboxLimits()
        self.token = token
        self.insecure = insecure
        self.pod = f"turnrl-sandbox-{socket.gethostname()}-{os.getpid()}"
        self.forkservers = [
            ForkServerHandle(i, self.config, slots, python_mode) for i in range(workers)
        ]
        self._next = itertools.cycle(range(workers))

    def app(self) -> web.Application:
        """The aiohttp application (starts and stops the fork servers with itself)."""
        app = web.Application(client_max_size=64 << 20, middlewares=[self._auth])
        app.router.add_post("/run_code", self.run_code)
        app.router.add_get("/v1/ping", self.ping)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        await asyncio.gather(*(f.start() for f in self.forkservers))
        isolation = self.forkservers[0].isolation
        if not isolation["gaps"]:
            return
        why = f"runs would not be contained (missing: {', '.join(isolation['gaps'])}): " + (
            "; ".join(isolation["notes"]) or "see /v1/ping"
        )
        if not self.insecure:
            await self._stop(_app)
            raise ContainmentError(
                f"{why}. Run the server as root on Linux with namespaces, or pass --insecure "
                "to serve anyway (only for code you trust)"
            )
        print(f"turnrl-sandbox: WARNING --insecure: {why}", file=sys.stderr, flush=True)

    async def _stop(self, _app: web.Application) -> None:
        await asyncio.gather(*(f.stop() for f in self.forkservers))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token is not None and request.path != "/v1/ping":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return web.json_response({"detail": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def ping(self, _request: web.Request) -> web.Response:
        """``pong`` as SandboxFusion answers, plus what each fork server could isolate."""
        isolation = [f.isolation for f in self.forkservers]
        contained = not any(i.get("gaps") for i in isolation)
        return web.json_response({"status": "pong", "contained": contained, "isolation": isolation})

    async def run_code(self, request: web.Request) -> web.Response:
        """SandboxFusion's ``/run_code``."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return web.json_response({"detail": f"request body is not JSON: {exc}"}, status=422)
        try:
            run = parse_request(body, self.config)
        except RequestError as exc:
            return web.json_response({"detail": str(exc)}, status=422)
        forkserver = self.forkservers[next(self._next)]
        try:
            result = await forkserver.run(run)
        except RuntimeError as exc:
            return web.json_response(shape_response({"error": str(exc)}, self.pod), status=500)
        return web.json_response(shape_response(result, self.pod))


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a bearer token."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not token:
        raise ValueError(f"binding {host} (not loopback) requires --token: anyone could run code")


def serve(
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    workers: int = 1,
    slots: int = 64,
    python_mode: str = "fork",
    config: SandboxLimits | None = None,
    insecure: bool = False,
    parent_pid: int | None = None,
) -> None:
    """Run the server until interrupted (or, with ``parent_pid``, until that process ends)."""
    check_bind(host, token)
    server = SandboxServer(
        config,
        workers=workers,
        slots=slots,
        token=token,
        python_mode=python_mode,
        insecure=insecure,
    )
    app = server.app()
    if parent_pid is not None:
        from turnrl.npu_runtime.supervise import exit_when_orphaned

        async def watch_parent(app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(exit_when_orphaned(parent_pid))
            yield
            task.cancel()

        app.cleanup_ctx.append(watch_parent)
    web.run_app(app, host=host, port=port, access_log=None, print=None)
