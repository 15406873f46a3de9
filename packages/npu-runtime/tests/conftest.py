"""Shared helpers for the npu-runtime tests: child scripts and process-gone checks."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnrl.npu_runtime import supervise

# A real HTTP server: sleeps `delay` seconds, then serves 200 on /health (404 elsewhere).
HEALTH_SERVER = """
import http.server, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
print(f"server starting on {port} after {delay}s", flush=True)
time.sleep(delay)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok" if code == 200 else b"no")

    def log_message(self, *args):
        pass

print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

# Prints a few lines, then exits with code 3 (a server that crashes during startup).
DIES_EARLY = """
import sys, time
for i in range(50):
    print(f"loading shard {i}", flush=True)
print("RuntimeError: out of device memory", file=sys.stderr, flush=True)
time.sleep(0.3)
sys.exit(3)
"""

# Ignores SIGTERM, starts a grandchild (same process group) that also ignores it, and
# writes the grandchild's pid to argv[1].
IGNORES_SIGTERM = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('grandchild up', flush=True); time.sleep(600)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(grandchild.pid))
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print("child ignoring SIGTERM", flush=True)
while True:
    time.sleep(1)
"""

SLEEPER = "import time; print('sleeping', flush=True); time.sleep(600)"


def pid_gone(pid: int) -> bool:
    """True when `pid` no longer runs: no such process, or only a zombie left."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_pid_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_gone(pid):
            return True
        time.sleep(0.05)
    return pid_gone(pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def scripts(tmp_path: Path) -> dict[str, Path]:
    """The child scripts above, written to a temporary folder."""
    out = {}
    for name, text in {
        "health_server": HEALTH_SERVER,
        "dies_early": DIES_EARLY,
        "ignores_sigterm": IGNORES_SIGTERM,
        "sleeper": SLEEPER,
    }.items():
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(text))
        out[name] = path
    return out


@pytest.fixture(autouse=True)
def no_leftover_children() -> Iterator[None]:
    """Fail a test that leaves a supervised child running; clean up either way."""
    before = {p.pid for p in supervise.running_processes()}
    yield
    leftover = [p for p in supervise.running_processes() if p.pid not in before]
    pids = [p.pid for p in leftover]
    for proc in leftover:
        proc.stop(grace=0)
    assert not leftover, f"test left supervised children running: {pids}"


PYTHON = sys.executable
