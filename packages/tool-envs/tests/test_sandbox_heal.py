"""A fork server killed under load: its runs answer SandboxError at once, the server starts
a new one, later runs are served, and nothing of the dead one is left (real processes)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from turnrl.npu_runtime.net import port_held
from turnrl.tool_envs.sandbox.embedded import TEST_SERVER_ARGS, EmbeddedSandbox, sandbox_processes

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux only")
SLOW = {"code": "import time\ntime.sleep(3)\nprint('done')", "language": "python"}


def _post(url, body):
    start = time.monotonic()
    answer = requests.post(f"{url}/run_code", json=body, timeout=60)
    return answer.status_code, answer.json(), time.monotonic() - start


def test_killed_fork_server_is_restarted_and_its_runs_fail_fast():
    with EmbeddedSandbox(*TEST_SERVER_ARGS, "--slots", "8") as server:
        before = server.ping()["isolation"][0]
        assert before["restarts"] == 0
        low, high = before["uids"]
        with ThreadPoolExecutor(8) as pool:
            running = [pool.submit(_post, server.url, SLOW) for _ in range(6)]
            deadline = time.monotonic() + 10
            while len(sandbox_processes(low, high - low)) < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(sandbox_processes(low, high - low)) >= 6  # all six runs have started
            os.kill(before["pid"], signal.SIGKILL)
            answers = [f.result() for f in running]
        for status, body, seconds in answers:
            assert status == 500 and body["status"] == "SandboxError", body
            assert "died during the run" in body["message"]
            assert seconds < 3, "an in-flight run waited for its sleep instead of failing"
        deadline = time.monotonic() + 2
        while sandbox_processes(low, high - low) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_processes(low, high - low) == []  # the dead server's runs died with it
        status, body, _ = _post(server.url, {"code": "print(6 * 7)", "language": "python"})
        assert status == 200 and body["run_result"]["stdout"] == "42\n", body
        after = server.ping()["isolation"][0]
        assert after["restarts"] == 1 and after["pid"] != before["pid"]
        assert after["gaps"] == before["gaps"]
        assert not os.path.exists(before["runs_dir"])  # the dead one's folder was removed


def test_a_killed_server_is_started_again_on_its_url_with_restart():
    """The whole server SIGKILLed under a run (an OOM kill, a stray signal): the run in
    flight fails at once, the server is started again on the same URL, later runs are served;
    ``stop`` ends it for good (the watcher starts no other)."""
    with EmbeddedSandbox(*TEST_SERVER_ARGS, restart=True) as server:
        first = server.process
        assert first is not None
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_post, server.url, SLOW)
            time.sleep(0.5)
            os.killpg(first.pid, signal.SIGKILL)
            with pytest.raises(requests.ConnectionError):
                running.result()
        deadline = time.monotonic() + 60
        while server.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.restarts == 1 and server.process is not first
        status, body, _ = _post(server.url, {"code": "print(6 * 7)", "language": "python"})
        assert status == 200 and body["run_result"]["stdout"] == "42\n", body
        assert server.ping()["isolation"][0]["restarts"] == 0  # a new server, not a healed one
    assert server.process is not None and server.process.poll() is not None
    time.sleep(0.5)
    assert server.restarts == 1
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{server.url}/v1/ping", timeout=5)


def test_a_server_that_cannot_start_again_at_once_is_retried_until_it_can(capfd):
    """The server killed (after a run, so its port has TIME_WAIT sockets) and its port taken
    before the restart could bind it (another process): the failed starts are retried with backoff, the sandbox is
    down meanwhile (a run fails to connect) and back on its URL once the port is free.
    Before, the first failed start ended the healing for good."""
    with EmbeddedSandbox(*TEST_SERVER_ARGS, restart=True) as server:
        first = server.process
        assert first is not None
        assert _post(server.url, {"code": "print(1)", "language": "python"})[0] == 200
        os.killpg(first.pid, signal.SIGKILL)
        with port_held(server.port):
            deadline = time.monotonic() + 30
            while "retrying in" not in capfd.readouterr().err:
                assert time.monotonic() < deadline, "no failed restart was retried"
                time.sleep(0.2)
            with pytest.raises(requests.ConnectionError):
                requests.get(f"{server.url}/v1/ping", timeout=5)
        deadline = time.monotonic() + 60
        while server.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.restarts == 1
        status, body, _ = _post(server.url, {"code": "print(6 * 7)", "language": "python"})
        assert status == 200 and body["run_result"]["stdout"] == "42\n", body


def test_an_embedded_sandbox_stops_when_the_process_that_started_it_is_killed(tmp_path) -> None:
    """SIGKILL of the owner (a test runner's timeout, a crash) leaves no sandbox running:
    the server watches its parent (--parent-pid) and stops, and its fork servers with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from turnrl.tool_envs.sandbox.embedded import TEST_SERVER_ARGS, EmbeddedSandbox\n"
        "box = EmbeddedSandbox(*TEST_SERVER_ARGS).start()\n"
        "print(box.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server = int(owner.stdout.readline())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    from turnrl.npu_runtime.supervise import group_alive

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if not group_alive(server):  # the server's group: it and its fork servers
            return
        time.sleep(0.1)
    os.killpg(server, signal.SIGKILL)
    raise AssertionError("the sandbox server outlived the process that started it")


def test_sandbox_settings_use_an_external_url_or_serve_for_the_block_only():
    from turnrl.tool_envs.sandbox.embedded import SandboxSettings, can_contain

    external = SandboxSettings(url="http://127.0.0.1:9", run_timeout=3.0, max_concurrency=4)
    with external.client() as client:  # an external server: nothing started
        assert client.config.url == "http://127.0.0.1:9"
        assert (client.config.run_timeout, client.config.max_concurrency) == (3.0, 4)
    with SandboxSettings(insecure=not can_contain()).client() as client:
        url = client.config.url
        assert requests.get(f"{url}/v1/ping", timeout=5).status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/v1/ping", timeout=5)
    with pytest.raises(ValueError, match="--sandbox-url must be an http"):
        SandboxSettings(url="sandbox:8080")
    with pytest.raises(ValueError, match="--sandbox-insecure applies to the embedded"):
        SandboxSettings(url="http://h:1", insecure=True)
