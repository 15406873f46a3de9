"""A SandboxFusion ``/run_code`` client on ``requests``, for turnrl's server or the real one.

Every call returns a :class:`RunResult` whose ``status`` says plainly what happened —
``success``, ``failed`` (non-zero exit), ``timeout``, ``sandbox_error``, ``connection_error``,
``http_error``, ``invalid_request`` or ``invalid_response`` — so an unreachable sandbox
never looks like a program that printed nothing. Connection errors and 5xx answers are
retried with exponential backoff; 4xx answers and finished runs are not.

Sync use::

    client = SandboxClient(SandboxClientConfig(url="http://127.0.0.1:8080"))
    result = client.run_code("print(1 + 1)")

Async use (a thread pool, capped by ``max_concurrency``)::

    result = await client.arun_code("print(1 + 1)")
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

_TRANSIENT_HTTP = range(500, 600)


@dataclass
class SandboxClientConfig:
    """Where the sandbox is and how to talk to it."""

    url: str = "http://127.0.0.1:8080"
    """Base URL of the server (``/run_code`` is appended)."""
    token: str | None = None
    """Bearer token, when the server requires one."""
    run_timeout: float = 10.0
    """Default wall-clock limit of a run, in seconds (sent as ``run_timeout``)."""
    memory_limit_mb: int = 1024
    """Default memory limit of a run (sent as ``memory_limit_MB``)."""
    request_timeout_margin: float = 10.0
    """The HTTP timeout is the run's timeout plus this margin (for queueing and transfer)."""
    connect_timeout: float = 5.0
    """Seconds to wait for a TCP connection."""
    max_retries: int = 3
    """Retries after a connection error or a 5xx answer (0 disables retrying)."""
    backoff: float = 0.2
    """First retry delay in seconds; doubled on every further retry."""
    max_concurrency: int = 32
    """Most requests in flight from :meth:`SandboxClient.arun_code` at once."""


@dataclass
class RunResult:
    """One run, as the client saw it."""

    status: str
    """``success``, ``failed``, ``timeout``, ``sandbox_error``, ``connection_error``,
    ``http_error``, ``invalid_request`` or ``invalid_response``."""
    stdout: str = ""
    """The program's standard output (possibly truncated by the server)."""
    stderr: str = ""
    """The program's standard error (possibly truncated by the server)."""
    return_code: int | None = None
    """Exit code (negative: killed by that signal); None when the program did not run."""
    execution_time: float | None = None
    """Wall-clock seconds of the run, as the server measured it."""
    truncated: bool = False
    """True when the server cut stdout or stderr."""
    message: str = ""
    """What went wrong, or the server's notes (time limit, truncation)."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Fetched files, decoded from base64."""
    attempts: int = 1
    """HTTP attempts made (more than 1 after retries)."""

    @property
    def ran(self) -> bool:
        """True when the code ran to an exit (successfully or not) or hit its time limit."""
        return self.status in ("success", "failed", "timeout")


class SandboxClient:
    """Thread-safe client; one ``requests.Session`` per thread."""

    def __init__(self, config: SandboxClientConfig | None = None) -> None:
        self.config = config or SandboxClientConfig()
        if self.config.max_concurrency < 1 or self.config.max_retries < 0:
            raise ValueError("max_concurrency must be >= 1 and max_retries >= 0")
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="sandbox")
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def close(self) -> None:
        """Stop the thread pool (sessions close with their threads)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.config.token:
                session.headers["Authorization"] = f"Bearer {self.config.token}"
        return session

    def run_code(
        self,
        code: str,
        language: str = "python",
        *,
        run_timeout: float | None = None,
        memory_limit_mb: int | None = None,
        stdin: str | None = None,
        files: dict[str, bytes] | None = None,
        fetch_files: list[str] | None = None,
    ) -> RunResult:
        """Run ``code`` and wait for the result (blocking)."""
        timeout = run_timeout if run_timeout is not None else self.config.run_timeout
        payload = {
            "code": code,
            "language": language,
            "run_timeout": timeout,
            "compile_timeout": timeout,
            "memory_limit_MB": memory_limit_mb or self.config.memory_limit_mb,
            "stdin": stdin,
            "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
            "fetch_files": fetch_files or [],
        }
        http_timeout = (self.config.connect_timeout, timeout + self.config.request_timeout_margin)
        attempt, delay = 0, self.config.backoff
        while True:
            attempt += 1
            result, transient = self._post(payload, http_timeout)
            if not transient or attempt > self.config.max_retries:
                result.attempts = attempt
                return result
            time.sleep(delay)
            delay *= 2

    async def arun_code(self, code: str, language: str = "python", **kwargs: Any) -> RunResult:
        """:meth:`run_code` from asyncio, at most ``max_concurrency`` at once."""
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.setdefault(
            loop, asyncio.Semaphore(self.config.max_concurrency)
        )
        async with semaphore:
            return await loop.run_in_executor(
                self._pool, lambda: self.run_code(code, language, **kwargs)
            )

    def ping(self) -> bool:
        """True when the server answers ``GET /v1/ping``."""
        try:
            answer = self._session().get(
                f"{self.config.url.rstrip('/')}/v1/ping", timeout=self.config.connect_timeout
            )
        except requests.RequestException:
            return False
        return answer.ok

    def _post(
        self, payload: dict[str, Any], timeout: tuple[float, float]
    ) -> tuple[RunResult, bool]:
        """One HTTP attempt; returns the result and whether retrying could help."""
        url = f"{self.config.url.rstrip('/')}/run_code"
        try:
            answer = self._session().post(url, json=payload, timeout=timeout)
        except requests.Timeout as exc:
            return RunResult(
                "timeout", message=f"no answer from the sandbox within {timeout[1]:.0f}s: {exc}"
            ), False
        except requests.ConnectionError as exc:
            return RunResult(
                "connection_error", message=f"cannot reach the sandbox at {url}: {exc}"
            ), True
        if answer.status_code in _TRANSIENT_HTTP:
            return RunResult(
                "http_error",
                message=f"sandbox answered HTTP {answer.status_code}: {answer.text[:500]}",
            ), True
        if answer.status_code >= 400:
            status = "invalid_request" if answer.status_code in (400, 422) else "http_error"
            return RunResult(
                status,
                message=f"sandbox refused the request (HTTP {answer.status_code}): {answer.text[:500]}",
            ), False
        try:
            return parse_response(answer.json()), False
        except (ValueError, KeyError, TypeError) as exc:
            return RunResult(
                "invalid_response", message=f"unexpected answer from the sandbox: {exc}"
            ), False


def parse_response(body: dict[str, Any]) -> RunResult:
    """Map a SandboxFusion ``RunCodeResponse`` to a :class:`RunResult`."""
    status = body["status"]
    message = body.get("message") or ""
    run = body.get("run_result")
    if status == "SandboxError" or run is None:
        compile_result = body.get("compile_result") or {}
        detail = message or compile_result.get("stderr") or "the sandbox reported an error"
        return RunResult("sandbox_error", stderr=compile_result.get("stderr") or "", message=detail)
    files = {k: base64.b64decode(v) for k, v in (body.get("files") or {}).items()}
    truncated = bool(run.get("stdout_truncated") or run.get("stderr_truncated"))
    if run["status"] == "TimeLimitExceeded":
        kind = "timeout"
        message = message or "time limit exceeded"
    elif run["status"] == "Error":
        kind = "sandbox_error"
        message = message or "the sandbox could not run the code (run status Error)"
    else:
        kind = "success" if status == "Success" else "failed"
    return RunResult(
        kind,
        stdout=run.get("stdout") or "",
        stderr=run.get("stderr") or "",
        return_code=run.get("return_code"),
        execution_time=run.get("execution_time"),
        truncated=truncated,
        message=message,
        files=files,
    )
