"""Start ``turnrl-sandbox serve`` as a child process and stop it again (tests, apps, benchmarks).

    with EmbeddedSandbox() as sandbox:
        client = SandboxClient(SandboxClientConfig(url=sandbox.url))

The server runs in its own process group; :meth:`EmbeddedSandbox.stop` ends that group
(the fork servers inside it also die with their parent).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType

import requests

from turnrl.npu_runtime.net import free_port
from turnrl.tool_envs.sandbox.client import SandboxClient, SandboxClientConfig

RESTART_BACKOFF_S = (0.5, 5.0)
"""First and longest wait between failed restarts of a dead server."""
RESTART_GIVE_UP_S = 300.0
"""A dead server that no restart brought back for this long is left dead."""


class EmbeddedSandbox:
    """A sandbox server child process on a loopback port."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        token: str | None = None,
        startup_timeout: float = 60.0,
        restart: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.extra_args = list(args)
        self.startup_timeout = startup_timeout
        self.restart = restart
        """Start the server again on the same port whenever it dies (not by :meth:`stop`)."""
        self.restarts = 0
        """Times it was started again."""
        self.process: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> EmbeddedSandbox:
        """Start the server and wait until ``/v1/ping`` answers (with ``restart``, a thread
        watches it from now on)."""
        self._stopping.clear()
        self._launch()
        if self.restart and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="sandbox-watch", daemon=True)
            self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            process = self.process
            if process is None or process.poll() is None:
                continue
            print(
                f"[turnrl sandbox] the server on {self.url} exited ({process.returncode}); "
                "starting it again",
                file=sys.stderr,
                flush=True,
            )
            _kill_group(process.pid)  # whatever of it survived (fork servers, runs)
            if not self._relaunch():
                return
            self.restarts += 1

    def _relaunch(self) -> bool:
        """Start the server again, retrying a failed start (its port still taken, a crash
        on start) with backoff for up to :data:`RESTART_GIVE_UP_S`; False when it gave up
        or was stopped meanwhile."""
        delay, longest = RESTART_BACKOFF_S
        give_up = time.monotonic() + RESTART_GIVE_UP_S
        while True:
            try:
                self._launch()
                return True
            except (RuntimeError, TimeoutError) as exc:
                if self.process is not None:
                    _kill_group(self.process.pid)  # what the failed start left (fork servers)
                if time.monotonic() + delay > give_up:
                    print(
                        f"[turnrl sandbox] could not start it again for "
                        f"{RESTART_GIVE_UP_S:.0f} s; giving up: {exc}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return False
                print(
                    f"[turnrl sandbox] could not start it again ({exc}); retrying in {delay:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            if self._stopping.wait(delay):
                return False
            delay = min(2 * delay, longest)

    def _launch(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "turnrl.tool_envs.sandbox.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--parent-pid",
            str(os.getpid()),
            *self.extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if k != "TURNRL_SANDBOX_TOKEN"}
        if self.token:
            env["TURNRL_SANDBOX_TOKEN"] = self.token
        self.process = subprocess.Popen(cmd, start_new_session=True, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"sandbox server exited with code {code} (its stderr says why)")
            try:
                if requests.get(f"{self.url}/v1/ping", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        _kill_group(self.process.pid)
        self.process.wait()
        raise TimeoutError(f"sandbox server did not answer within {self.startup_timeout}s")

    def ping(self) -> dict[str, object]:
        """The server's ``/v1/ping`` answer."""
        answer: dict[str, object] = requests.get(f"{self.url}/v1/ping", timeout=5).json()
        return answer

    def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it lingers (the watcher,
        with ``restart``, first)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(self.startup_timeout + 10)
            self._watcher = None
        if self.process is None or self.process.poll() is not None:
            return
        pgid = self.process.pid
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
        _kill_group(pgid)  # fork servers share the group; make sure none survived

    def processes(self) -> list[int]:
        """Pids of live processes running as one of this server's run uids."""
        found = []
        for entry in self.ping()["isolation"]:  # type: ignore[attr-defined]
            low, high = entry.get("uids", (0, 0))
            found += sandbox_processes(low, high - low)
        return found

    def __enter__(self) -> EmbeddedSandbox:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sandbox_processes(base_uid: int = 2_000_000, count: int = 1 << 27) -> list[int]:
    """Pids of live processes whose uid is in ``base_uid`` .. ``base_uid + count - 1``.

    The default range covers every server's run uids; ``EmbeddedSandbox.processes`` looks
    only at one server's.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "")
        state = next((line for line in status.splitlines() if line.startswith("State:")), "")
        uids = [int(u) for u in uid_line.split()[1:]]
        if uids and base_uid <= uids[0] < base_uid + count and "zombie" not in state:
            found.append(int(entry))
    return found


_SHARED: dict[tuple[str, ...], EmbeddedSandbox] = {}


@dataclass
class SandboxSettings:
    """An app's code interpreter: an external SandboxFusion server, or this package's server
    started for the run (``turnrl-sandbox serve``), and what each run may use."""

    url: str | None = field(default=None, metadata={"flags": (("--sandbox-url", str),)})
    """External SandboxFusion server; None starts the embedded sandbox."""
    insecure: bool = field(default=False, metadata={"flags": (("--sandbox-insecure", "on"),)})
    """Let the embedded sandbox serve where it cannot contain runs (not root, no
    namespaces); otherwise it refuses to start there."""
    run_timeout: float = 30.0
    """Seconds per code run."""
    memory_limit_mb: int = 1024
    """Memory per code run in MB."""
    max_concurrency: int = 128
    """Most sandbox calls in flight."""
    max_retries: int = 5
    """Retries of a call that found no server (0.2 s, doubling: ~6 s in all, the time an
    embedded server takes to be started again)."""
    max_tool_output_chars: int = 2048
    """Longest tool message in characters (head and tail kept)."""

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--sandbox-url must be an http(s) URL, got {self.url!r}")
        if self.url is not None and self.insecure:
            raise ValueError(
                "--sandbox-insecure applies to the embedded sandbox, not --sandbox-url"
            )

    @contextlib.contextmanager
    def client(self) -> Iterator[SandboxClient]:
        """A client of ``url``, or of an embedded server that runs for the block only and is
        started again (same URL) if it dies: the runs in flight fail, later ones are served."""
        with contextlib.ExitStack() as stack:
            url = self.url
            if not url:
                args = ["--insecure"] if self.insecure else []
                url = stack.enter_context(EmbeddedSandbox(*args, restart=True)).url
            client = SandboxClient(
                SandboxClientConfig(
                    url=url,
                    run_timeout=self.run_timeout,
                    memory_limit_mb=self.memory_limit_mb,
                    max_concurrency=self.max_concurrency,
                    max_retries=self.max_retries,
                )
            )
            stack.callback(client.close)
            yield client


def shared_sandbox(*args: str) -> EmbeddedSandbox:
    """One running server per argument list for this whole process, stopped at its exit.

    For test suites and notebooks that would otherwise start a server per module.
    """
    server = _SHARED.get(args)
    if server is None or server.process is None or server.process.poll() is not None:
        server = _SHARED[args] = EmbeddedSandbox(*args).start()
        atexit.register(server.stop)
    return server


def can_contain() -> bool:
    """Whether a server started here can contain runs: root, and namespaces allowed."""
    if os.geteuid() != 0 or not hasattr(os, "fork"):
        return False
    from turnrl.tool_envs.sandbox.limits import CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, unshare

    pid = os.fork()
    if pid == 0:  # probe in a child: unsharing is irreversible
        try:
            unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
        except OSError:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


TEST_SERVER_ARGS = (
    "--max-output-bytes",
    "65536",
    "--max-processes",
    "32",
    *([] if can_contain() else ["--insecure"]),
)
"""The server options turnrl's own sandbox tests share (small output cap, 32 processes;
``--insecure`` where the server cannot contain — not root, or no namespaces — and would
refuse to start; the tests of containment itself skip there)."""
