"""Shared test helpers: child scripts, process-gone checks, fake torch / torch_npu modules."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
import types
from collections.abc import Callable, Iterator
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
    """Wait up to `timeout` seconds for `pid` to be gone; True if it is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_gone(pid):
            return True
        time.sleep(0.05)
    return pid_gone(pid)


@pytest.fixture
def port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gone() -> Callable[..., bool]:
    """`gone(pid, timeout=10.0)`: wait for `pid` to be gone (timeout 0: check once).

    A fixture rather than an import so the tests also run with --import-mode=importlib.
    """
    return wait_pid_gone


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


class FakeAccelerator:
    """Stands in for ``torch.cuda`` / ``torch.npu``: the driver boundary we cannot have here."""

    def __init__(self, count: int, free: int = 30 << 30, total: int = 64 << 30):
        self.count = count
        self.current = 0
        self.free = free
        self.total = total
        self.set_device_calls: list[int] = []

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.set_device_calls.append(index)
        self.current = index

    def current_device(self) -> int:
        return self.current

    def mem_get_info(self, index: int) -> tuple[int, int]:
        assert 0 <= index < self.count
        return self.free, self.total


class FakeDistributed:
    """Stands in for ``torch.distributed`` when the backend (hccl / nccl) cannot run here."""

    def __init__(self) -> None:
        self.init_calls: list[dict[str, object]] = []
        self.initialized = False

    def is_initialized(self) -> bool:
        return self.initialized

    def init_process_group(self, **kwargs: object) -> None:
        self.init_calls.append(kwargs)
        self.initialized = True

    def get_rank(self) -> int:
        return int(self.init_calls[-1]["rank"])  # type: ignore[call-overload]

    def get_world_size(self) -> int:
        return int(self.init_calls[-1]["world_size"])  # type: ignore[call-overload]

    def get_backend(self) -> str:
        return str(self.init_calls[-1]["backend"])

    def destroy_process_group(self) -> None:
        self.initialized = False


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Callable[..., types.ModuleType]:
    """Install fake ``torch`` (and optionally ``torch_npu``) modules in ``sys.modules``.

    ``fake_torch(cuda=2, npu=8)`` makes 2 CUDA devices and, when ``npu`` is not None, a
    ``torch_npu`` module and ``torch.npu`` with that many NPUs. ``TURNRL_DEVICE`` is
    cleared so detection is automatic unless a test sets it.
    """
    monkeypatch.delenv("TURNRL_DEVICE", raising=False)

    def install(cuda: int = 0, npu: int | None = None) -> types.ModuleType:
        torch = types.ModuleType("torch")
        torch.cuda = FakeAccelerator(cuda)  # type: ignore[attr-defined]
        torch.distributed = FakeDistributed()  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torch", torch)
        if npu is None:
            monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
        else:
            torch.npu = FakeAccelerator(npu)  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
        return torch

    return install


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import torch`` and ``import torch_npu`` fail, as on a slim install."""
    monkeypatch.delenv("TURNRL_DEVICE", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
