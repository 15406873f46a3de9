"""The sandbox client against turnrl's server, a failing server, and no server at all; and
the official ``sandbox-fusion`` PyPI client against turnrl's server."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from turnrl.npu_runtime.net import free_port
from turnrl.tool_envs.sandbox import RunResult, SandboxClient, SandboxClientConfig
from turnrl.tool_envs.sandbox.client import parse_response
from turnrl.tool_envs.sandbox.embedded import (
    TEST_SERVER_ARGS,
    shared_sandbox,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux only")


@pytest.fixture(scope="module")
def sandbox():
    """One server for all sandbox test modules (started once, stopped at exit)."""
    return shared_sandbox(*TEST_SERVER_ARGS)


@pytest.fixture
def client(sandbox):
    client = SandboxClient(SandboxClientConfig(url=sandbox.url, max_concurrency=32))
    yield client
    client.close()


def test_success_failure_and_timeout_statuses(client):
    ok = client.run_code("print(6 * 7)")
    assert (ok.status, ok.stdout, ok.return_code, ok.ran) == ("success", "42\n", 0, True)
    failed = client.run_code("1 / 0")
    assert failed.status == "failed" and "ZeroDivisionError" in failed.stderr
    slow = client.run_code("sleep 5", language="bash", run_timeout=0.3)
    assert slow.status == "timeout" and "time limit" in slow.message


def test_files_round_trip(client):
    result = client.run_code(
        "open('b.txt', 'w').write(open('a.txt').read() * 2)",
        files={"a.txt": b"ab"},
        fetch_files=["b.txt"],
    )
    assert result.files == {"b.txt": b"abab"}


def test_unsupported_language_is_invalid_request_without_retry(client):
    result = client.run_code("x", language="cobol")
    assert result.status == "invalid_request"
    assert result.attempts == 1
    assert "cobol" in result.message


def test_connection_refused_is_retried_then_reported():
    config = SandboxClientConfig(url=f"http://127.0.0.1:{free_port()}", max_retries=2, backoff=0.01)
    result = SandboxClient(config).run_code("print(1)")
    assert result.status == "connection_error"
    assert result.attempts == 3
    assert "cannot reach the sandbox" in result.message
    assert not result.ran


class _Flaky(BaseHTTPRequestHandler):
    """A real HTTP server that answers 503 a given number of times, then a valid result."""

    failures_left = 0
    calls = 0

    def do_POST(self):
        type(self).calls += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).failures_left > 0:
            type(self).failures_left -= 1
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"overloaded")
            return
        body = (
            b'{"status":"Success","message":"","run_result":{"status":"Finished",'
            b'"return_code":0,"stdout":"ok\\n","stderr":""}}'
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Flaky.calls = 0
    yield server
    server.shutdown()
    server.server_close()


def test_5xx_is_retried_with_backoff(flaky):
    _Flaky.failures_left = 2
    url = f"http://127.0.0.1:{flaky.server_address[1]}"
    start = time.monotonic()
    result = SandboxClient(SandboxClientConfig(url=url, max_retries=3, backoff=0.05)).run_code("x")
    assert (result.status, result.stdout, result.attempts) == ("success", "ok\n", 3)
    assert time.monotonic() - start >= 0.05 + 0.1  # backoff doubled


def test_5xx_beyond_retries_is_http_error(flaky):
    _Flaky.failures_left = 10
    url = f"http://127.0.0.1:{flaky.server_address[1]}"
    result = SandboxClient(SandboxClientConfig(url=url, max_retries=1, backoff=0.01)).run_code("x")
    assert result.status == "http_error" and "503" in result.message
    assert _Flaky.calls == 2


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"status": "SandboxError", "message": "disk full", "run_result": None}, "sandbox_error"),
        ({"status": "Failed", "message": "", "run_result": {"status": "Error"}}, "sandbox_error"),
        (
            {"status": "Failed", "message": "", "run_result": {"status": "TimeLimitExceeded"}},
            "timeout",
        ),
    ],
)
def test_response_statuses_map_to_clear_client_statuses(body, status):
    result = parse_response(body)
    assert result.status == status
    assert result.message  # never a silent empty result


def test_bad_client_config_is_refused():
    with pytest.raises(ValueError):
        SandboxClient(SandboxClientConfig(max_concurrency=0))


async def test_concurrency_32_every_result_correct(client):
    codes = [f"import sympy\nprint({i} * {i}, sympy.isprime({i}))" for i in range(32)]
    results: list[RunResult] = await asyncio.gather(*(client.arun_code(c) for c in codes))
    for i, result in enumerate(results):
        assert result.status == "success", result
        assert result.stdout == f"{i * i} {__import__('sympy').isprime(i)}\n"


async def test_async_concurrency_cap_is_respected(sandbox):
    client = SandboxClient(SandboxClientConfig(url=sandbox.url, max_concurrency=2))
    start = time.monotonic()
    results = await asyncio.gather(*(client.arun_code("sleep 0.3", "bash") for _ in range(4)))
    assert all(r.status == "success" for r in results)
    assert time.monotonic() - start >= 0.6  # two waves of two
    client.close()


def test_official_sandbox_fusion_client_works_against_turnrl(sandbox):
    sandbox_fusion = pytest.importorskip("sandbox_fusion")
    request = sandbox_fusion.RunCodeRequest(
        code="import sys\nprint(sys.stdin.read() * 2)", language="python", stdin="ab"
    )
    response = sandbox_fusion.run_code(request, endpoint=sandbox.url, max_attempts=1)
    assert response.status == sandbox_fusion.RunStatus.Success
    assert response.run_result.stdout == "abab\n"
    assert response.run_result.status == sandbox_fusion.models.CommandRunStatus.Finished
    timeout = sandbox_fusion.run_code(
        sandbox_fusion.RunCodeRequest(code="while True: pass", language="python", run_timeout=0.5),
        endpoint=sandbox.url,
        max_attempts=1,
    )
    assert timeout.run_result.status == sandbox_fusion.models.CommandRunStatus.TimeLimitExceeded
    mapping = sandbox_fusion.SummaryMapping(RunTimeout="timeout")
    assert sandbox_fusion.summary_run_code_result(timeout, mapping) == "timeout"
