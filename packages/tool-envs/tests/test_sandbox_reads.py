"""Hostile reads: a run sees no home directory but the interpreter's trees, no secret file, and
the server refuses to start where it cannot contain (as root, on real server processes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import requests

from turnrl.npu_runtime.net import free_port
from turnrl.tool_envs.sandbox.embedded import (
    TEST_SERVER_ARGS,
    EmbeddedSandbox,
    can_contain,
    shared_sandbox,
)

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux only"),
    pytest.mark.skipif(not can_contain(), reason="containment needs root and namespaces"),
]
SECRET = "turnrl-secret-5f1c"


@pytest.fixture(scope="module")
def secret_file():
    """A world-readable file in a world-readable folder of the server's home directory."""
    folder = tempfile.mkdtemp(prefix="turnrl-secret-", dir=os.path.expanduser("~"))
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "credentials")
    with open(path, "w") as f:
        f.write(SECRET)
    os.chmod(path, 0o644)
    yield path
    shutil.rmtree(folder)


def _run(url, code, language="python"):
    body = {"code": code, "language": language}
    answer = requests.post(f"{url}/run_code", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["run_result"]


def _read_attempts(secret_file):
    return (
        "import os\n"
        f"for path in ({secret_file!r}, '/etc/shadow', '/root/.bashrc'):\n"
        "    try:\n        print(path, open(path).read()[:40])\n"
        "    except OSError as e:\n        print(path, 'refused', type(e).__name__)\n"
        "print('home', sorted(os.listdir(os.path.expanduser('~' + 'root'))))\n"
        "import numpy\nprint('numpy', numpy.ones(2).sum())\n"
    )


def _assert_contained(out, secret_file):
    assert SECRET not in out, out
    assert "root:" not in out, out  # /etc/shadow's first line
    for path in (secret_file, "/etc/shadow", "/root/.bashrc"):
        assert f"{path} refused" in out, out
    assert "numpy 2.0" in out, out  # the interpreter and its libraries still load


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_secrets_in_home_and_etc_are_unreadable(secret_file, mode):
    if mode == "fork":
        server = shared_sandbox(*TEST_SERVER_ARGS)
    else:
        server = EmbeddedSandbox(*TEST_SERVER_ARGS, "--python-mode", "exec").start()
    try:
        ping = server.ping()
        assert ping["contained"] is True, ping
        isolation = ping["isolation"][0]
        assert isolation["read_all_files"] is False and isolation["gaps"] == []
        assert os.path.realpath(os.path.expanduser("~")) in isolation["hidden_paths"]
        out = _run(server.url, _read_attempts(secret_file))["stdout"]
        _assert_contained(out, secret_file)
        # /root shows only the ancestors of the interpreter's trees, never the secret's folder
        listing = next(line for line in out.splitlines() if line.startswith("home "))
        assert os.path.basename(os.path.dirname(secret_file)) not in listing
        assert ".bashrc" not in listing, listing
        shell = _run(server.url, f"cat {secret_file} /etc/shadow; echo rc=$?", "bash")
        assert SECRET not in shell["stdout"] and "rc=1" in shell["stdout"], shell
    finally:
        if mode == "exec":
            server.stop()


def _serve(*extra):
    cmd = [
        "setpriv",
        "--bounding-set",
        "-sys_admin",
        "--inh-caps",
        "-sys_admin",
        sys.executable,
        "-m",
        "turnrl.tool_envs.sandbox.cli",
        "serve",
        "--port",
        str(free_port()),
        *extra,
    ]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True), cmd


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_server_refuses_to_start_where_it_cannot_contain():
    """Without CAP_SYS_ADMIN (dropped by setpriv) there are no namespaces: refused, or served
    with a warning and the gaps in /v1/ping under --insecure."""
    process, _ = _serve()
    _, err = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "would not be contained" in err and "net_namespace" in err and "--insecure" in err

    process, cmd = _serve("--insecure")
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ping = requests.get(f"{url}/v1/ping", timeout=1).json()
                break
            except requests.RequestException:
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
                time.sleep(0.1)
        assert ping["contained"] is False
        assert {"net_namespace", "private_mounts"} <= set(ping["isolation"][0]["gaps"])
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "WARNING --insecure" in err
