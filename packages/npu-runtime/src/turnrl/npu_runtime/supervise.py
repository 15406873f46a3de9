"""Supervision of child processes (inference engines, sandboxes, helper servers).

Each child is started in its **own process group** (a new session), with stdout and
stderr appended to a log file. The parent can wait for an HTTP health URL while watching
that the child has not died (if it has, the error carries its exit code and the last log
lines), and stops it by sending SIGTERM to the whole group, then SIGKILL to the group
after a grace period -- so grandchildren (vLLM workers, Ray helpers) go too, and nothing
like `pkill -9 vllm` is ever needed.

Every child is registered in a module-level registry. :func:`stop_all` stops them all; it
runs at interpreter exit (``atexit``) and on SIGINT / SIGTERM (handlers installed once,
from the main thread, chaining whatever handler was there before), so supervised children
do not outlive their parent. A parent killed by SIGKILL cannot clean up, so each child also
gets a **guard**: a small process in a session of its own, forked off so that it is nobody's
child, that holds the read end of a pipe whose only writer is the parent. End of file means
the parent is gone (or stopped the child itself); the guard then stops what is left of the
child's group (SIGTERM, SIGKILL after a grace period).

:func:`run_contained` (``python -m turnrl.npu_runtime.supervise -- CMD``) runs a command
and then ends, and names, whatever it left running (orphaned daemons included).

Only the standard library is used.

Example::

    from turnrl.npu_runtime.supervise import start_process

    with start_process(["python", "-m", "http.server", "8000"], name="files",
                       log_path="runs/files.log") as proc:
        proc.wait_healthy("http://127.0.0.1:8000/", timeout=30)
        ...  # use the server
    # leaving the block stopped the whole process group
"""

from __future__ import annotations

import asyncio
import atexit
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "HealthTimeoutError",
    "ManagedProcess",
    "ProcessDiedError",
    "StartCancelled",
    "SupervisionError",
    "adopt_orphans",
    "descendants",
    "exit_when_orphaned",
    "group_alive",
    "install_signal_handlers",
    "kill_descendants",
    "run_contained",
    "run_group",
    "running_processes",
    "start_process",
    "stop_all",
]

# After SIGKILL, how long to wait for the group to disappear before giving up quietly
# (a process in uninterruptible sleep, e.g. stuck in a device driver, can outlast it).
_KILL_WAIT_S = 5.0
# How often to look at the process group while waiting for it to empty.
_POLL_S = 0.05
# A guard whose owner died: seconds between SIGTERM and SIGKILL of the orphaned group.
_ORPHAN_GRACE_S = 10.0
# How often a guard checks that the group it watches still exists.
_GUARD_POLL_S = 2.0
# Upper bound on one health request, so a server that accepts but never answers
# cannot make us overshoot the caller's timeout by much.
_MAX_PROBE_S = 5.0


class SupervisionError(RuntimeError):
    """Base class of the errors raised while supervising a child process."""


class ProcessDiedError(SupervisionError):
    """The child exited while we were waiting for it to become healthy.

    Attributes:
        name: The name given to :func:`start_process`.
        returncode: The child's exit code (negative: killed by that signal).
        log_tail: The last lines of its log file.
    """

    def __init__(self, name: str, pid: int, returncode: int, log_path: Path, log_tail: str):
        self.name = name
        self.pid = pid
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(
            f"process {name!r} (pid {pid}) exited with code {returncode} before it became "
            f"healthy; last lines of {log_path}:\n{log_tail}"
        )


class StartCancelled(SupervisionError):
    """Waiting for the child to become healthy was given up on: the ``cancel`` event handed
    to :meth:`ManagedProcess.wait_healthy` was set (the child is still running)."""


class HealthTimeoutError(SupervisionError, TimeoutError):
    """The child did not answer its health URL with HTTP 200 in time (it is still running).

    Attributes:
        name: The name given to :func:`start_process`.
        url: The health URL that was polled.
        timeout: The timeout in seconds.
        last_error: What the last health request returned or raised.
        log_tail: The last lines of the child's log file.
    """

    def __init__(
        self, name: str, url: str, timeout: float, last_error: str, log_path: Path, log_tail: str
    ):
        self.name = name
        self.url = url
        self.timeout = timeout
        self.last_error = last_error
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(
            f"process {name!r} did not answer {url} with HTTP 200 within {timeout:g} s "
            f"(last attempt: {last_error}); last lines of {log_path}:\n{log_tail}"
        )


def _probe(url: str, timeout: float) -> tuple[bool, str]:
    """One HTTP GET of ``url``, bypassing any proxy; returns (healthy, description)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        # URLError wraps refused connections; OSError covers resets and socket timeouts.
        return False, f"{type(error).__name__}: {error}"
    return status == 200, f"HTTP {status}"


def _read_tail(path: Path, lines: int, block: int = 8192) -> str:
    """The last ``lines`` lines of a text file, read backwards in blocks."""
    if lines <= 0:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            data = b""
            while end > 0 and data.count(b"\n") <= lines:
                start = max(0, end - block)
                f.seek(start)
                data = f.read(end - start) + data
                end = start
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.rstrip("\n").split("\n")[-lines:])


_PROC = Path("/proc")


def _live_members_from_proc(pgid: int) -> bool | None:
    """Whether /proc lists a non-zombie process in group ``pgid``; None without /proc."""
    if not (_PROC / "self" / "stat").exists():
        return None
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def group_alive(pgid: int) -> bool:
    """Whether a running (non-zombie) process is left in process group ``pgid``.

    Zombies are ignored: an orphaned grandchild that died is re-parented to init, which
    in some containers never reaps it, and it holds no resources anyway.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    live = _live_members_from_proc(pgid)
    return True if live is None else live


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class ManagedProcess:
    """A supervised child process running in its own process group.

    Create it with :func:`start_process`. Usable as a context manager: leaving the
    ``with`` block calls :meth:`stop`.
    """

    def __init__(self, popen: subprocess.Popen[bytes], name: str, log_path: Path, cmd: list[str]):
        self._popen = popen
        self._guard_fd: int | None = None  # the guard's stdin: closed, it ends the group
        self._guard_alive: int | None = None  # end of file once the guard is exiting
        self._guard_group = 0  # the guard's process group (its launcher's pid)
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self._owner_pid = os.getpid()  # a forked copy of the registry must not stop these
        self._lock = threading.RLock()  # re-entrant: stop_all may run in a signal handler
        self._stopped = False

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"exited {self.returncode}"
        return f"ManagedProcess(name={self.name!r}, pid={self.pid}, {state})"

    @property
    def pid(self) -> int:
        """The child's process id (also its process-group id)."""
        return self._popen.pid

    @property
    def alive(self) -> bool:
        """Whether the child itself is still running (not yet exited)."""
        return self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code once the child exited (negative: killed by that signal), else None."""
        return self._popen.poll()

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the child's log file."""
        return _read_tail(self.log_path, lines)

    def _check_alive(self) -> None:
        code = self._popen.poll()
        if code is not None:
            raise ProcessDiedError(self.name, self.pid, code, self.log_path, self.tail())

    def _timeout_error(self, url: str, timeout: float, last: str) -> HealthTimeoutError:
        return HealthTimeoutError(self.name, url, timeout, last, self.log_path, self.tail())

    @staticmethod
    def _validate_wait(url: str, timeout: float, interval: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"health url must be http(s)://host[:port]/path, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")

    def wait_healthy(
        self,
        url: str,
        timeout: float,
        interval: float = 0.5,
        cancel: threading.Event | None = None,
    ) -> None:
        """Poll ``url`` with HTTP GET until it answers 200.

        Args:
            url: The health endpoint, e.g. ``http://127.0.0.1:8000/health``.
            timeout: Seconds to wait in total.
            interval: Seconds between attempts.
            cancel: Set from another thread to stop waiting (checked between attempts).

        Raises:
            ProcessDiedError: The child exited meanwhile (message has its exit code and
                last log lines).
            HealthTimeoutError: No HTTP 200 within ``timeout`` (the child keeps running;
                stop it if you give up on it).
            StartCancelled: ``cancel`` was set (the child keeps running).
            ValueError: ``url`` is not an http(s) URL, or ``timeout`` or ``interval`` is
                not positive.
        """
        self._validate_wait(url, timeout, interval)
        deadline = time.monotonic() + timeout
        last = "no attempt yet"
        while True:
            self._check_alive()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error(url, timeout, last)
            healthy, last = _probe(url, min(remaining, _MAX_PROBE_S))
            if healthy:
                return
            self._check_alive()
            pause = max(0.0, min(interval, deadline - time.monotonic()))
            if cancel is None:
                time.sleep(pause)
            elif cancel.wait(pause):
                raise StartCancelled(f"stopped waiting for {self.name!r} to answer {url}")

    async def wait_healthy_async(self, url: str, timeout: float, interval: float = 0.5) -> None:
        """Like :meth:`wait_healthy`, without blocking the event loop.

        Each HTTP request runs in a worker thread; the waits between them are
        ``asyncio.sleep``. Raises the same errors as :meth:`wait_healthy`.
        """
        self._validate_wait(url, timeout, interval)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no attempt yet"
        while True:
            self._check_alive()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._timeout_error(url, timeout, last)
            healthy, last = await asyncio.to_thread(_probe, url, min(remaining, _MAX_PROBE_S))
            if healthy:
                return
            self._check_alive()
            await asyncio.sleep(max(0.0, min(interval, deadline - loop.time())))

    def _wait_gone(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the child to exit (reaping it) and its group to empty."""
        deadline = time.monotonic() + seconds
        while True:
            # Never wait() without a timeout: Popen's blocking wait is not re-entrant,
            # and this may run again inside a signal handler.
            self._popen.poll()
            if self._popen.returncode is not None and not group_alive(self.pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop the child and everything in its process group.

        Sends SIGTERM to the group, waits up to ``grace`` seconds for the child to exit
        and the group to empty, then sends SIGKILL to the group. Reaps the child.
        Idempotent: later calls only return the exit code.

        Args:
            grace: Seconds between SIGTERM and SIGKILL (0 kills at once).

        Returns:
            The child's exit code (negative: the signal that ended it), or None if it
            could not be reaped (not expected in practice).

        Raises:
            ValueError: ``grace`` is negative.
        """
        if grace < 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace}")
        with self._lock:
            if not self._stopped:
                self._stopped = True
                try:
                    self._terminate_group(grace)
                finally:
                    _unregister(self)
                    self._release_guard()
            return self._popen.poll()

    def kill(self) -> int | None:
        """SIGKILL the whole group at once, with no SIGTERM first: what a crash looks like.

        Returns:
            The child's exit code (``-9`` when the signal ended it), or None if it could
            not be reaped.
        """
        with self._lock:
            if not self._stopped:
                self._stopped = True
                try:
                    if self._popen.poll() is None or group_alive(self.pid):
                        _signal_group(self.pid, signal.SIGKILL)
                        self._wait_gone(_KILL_WAIT_S)
                finally:
                    _unregister(self)
                    self._release_guard()
            return self._popen.poll()

    def _watch(self, log: Any) -> None:
        """Start the guard that stops this group once this process is gone (module docs).

        The guard is not a child of this process (its launcher forks it off and exits), so
        whatever kills this process's children with it (Ray does, at a worker's exit) does
        not kill the guard too. It holds ``alive``'s write end until it exits.
        """
        owner_r, owner_w = os.pipe()  # neither end is inherited by what this process execs
        alive_r, alive_w = os.pipe()
        # This file as a script, isolated (-I): standard library only, so the guard starts
        # wherever the owner runs, whatever its sys.path.
        cmd = [sys.executable, "-I", __file__, "--guard", str(self.pid), str(alive_w)]
        try:
            launcher = subprocess.Popen(
                cmd,
                stdin=owner_r,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(alive_w,),
                start_new_session=True,  # survives a signal to this process's group
            )
            launcher.wait()
        except BaseException:
            os.close(owner_w)
            os.close(alive_r)
            raise
        finally:
            os.close(owner_r)
            os.close(alive_w)
        self._guard_fd, self._guard_alive = owner_w, alive_r
        self._guard_group = launcher.pid

    def _release_guard(self) -> None:
        """The group is stopped: let the guard see end of file, and wait for it to exit."""
        if self._guard_fd is not None:
            os.close(self._guard_fd)
            self._guard_fd = None
        if self._guard_alive is not None:
            deadline = time.monotonic() + _KILL_WAIT_S
            select.select([self._guard_alive], [], [], _KILL_WAIT_S)  # EOF: it is exiting
            os.close(self._guard_alive)
            self._guard_alive = None
            while group_alive(self._guard_group) and time.monotonic() < deadline:
                time.sleep(_POLL_S / 10)

    def _terminate_group(self, grace: float) -> None:
        pgid = self.pid  # start_new_session=True: the child leads its own group
        if self._popen.poll() is None or group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            if self._wait_gone(grace):
                return
            _signal_group(pgid, signal.SIGKILL)
            self._wait_gone(_KILL_WAIT_S)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_registry: dict[int, ManagedProcess] = {}
_registry_lock = threading.RLock()
_handlers_installed = False

stop_requested = threading.Event()
"""Set by a program's first Ctrl-C handler (``turnrl.grpo_core.recipe.driver``). Python
drops an exception that a signal handler raises while a ``__del__`` method or a similar
callback runs (it only prints "Exception ignored in ..."), so long synchronous loops call
:func:`raise_if_stop_requested` between their steps: a Ctrl-C lost that way still stops
them at the next step."""


def raise_if_stop_requested() -> None:
    """Raise KeyboardInterrupt when :data:`stop_requested` is set."""
    if stop_requested.is_set():
        raise KeyboardInterrupt


def _register(proc: ManagedProcess) -> None:
    with _registry_lock:
        _registry[proc.pid] = proc


def _unregister(proc: ManagedProcess) -> None:
    with _registry_lock:
        if _registry.get(proc.pid) is proc:
            del _registry[proc.pid]


def running_processes() -> list[ManagedProcess]:
    """The supervised children started by this process and not stopped yet."""
    with _registry_lock:
        return [p for p in _registry.values() if p._owner_pid == os.getpid()]


def stop_all(grace: float = 5.0) -> None:
    """Stop every supervised child of this process (see :meth:`ManagedProcess.stop`).

    Children are first all sent SIGTERM, so their grace periods run in parallel, then
    each is stopped in turn. Runs at interpreter exit and on SIGINT / SIGTERM.

    Args:
        grace: Seconds between SIGTERM and SIGKILL.
    """
    procs = running_processes()
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.stop(grace)


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _chain_handler(signum: int, previous: _Handler) -> Callable[[int, FrameType | None], None]:
    def handler(sig: int, frame: FrameType | None) -> None:
        stop_all()
        if callable(previous):
            previous(sig, frame)
        elif previous in (signal.SIG_DFL, None):
            # Die of the same signal, as if we had never caught it.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return handler


def install_signal_handlers() -> bool:
    """Install the SIGINT / SIGTERM handlers that run :func:`stop_all` (once per process).

    :func:`start_process` calls this itself, but Python only lets the main thread set
    signal handlers: a program that starts its children from other threads should call
    it once from the main thread first. Each handler stops the children, then runs the
    handler that was there before (or dies of the signal, if that was the default).

    Returns:
        Whether the handlers are installed (False when called from another thread
        before they were).
    """
    global _handlers_installed
    if _handlers_installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue  # this process chose to survive the signal; so do its children
        signal.signal(signum, _chain_handler(signum, previous))
    _handlers_installed = True
    return True


atexit.register(stop_all)

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Make this process a child subreaper (Linux): orphaned descendants become its children.

    A daemon that a child double-forks (or a child's child whose parent died) is then
    reparented here instead of to init, so :func:`descendants` still sees it and
    :func:`kill_descendants` can end it. Returns False where the kernel has no subreapers.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _processes() -> dict[int, tuple[int, int]]:
    """Each live (non-zombie) process's parent and start time (clock ticks since boot)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # zombies are dead already (waiting to be reaped)
                found[int(entry)] = (int(fields[1]), int(fields[19]))
    return found


def descendants(pid: int | None = None) -> list[int]:
    """Live (non-zombie) processes below ``pid`` (default: this process) in the process tree,
    in tree order: each before the processes below it, siblings in the order they started
    (not by pid, which wraps around)."""
    root = os.getpid() if pid is None else pid
    processes = _processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in sorted(processes.items(), key=lambda item: (item[1][1], item[0])):
        children.setdefault(parent, []).append(child)
    found, todo = [], list(reversed(children.get(root, [])))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(reversed(children.get(child, [])))
    return found


def kill_descendants(grace: float = 5.0) -> list[int]:
    """End what this process started and left running: SIGTERM, then SIGKILL after ``grace``.

    Supervised children are stopped first (:func:`stop_all`); whatever is still below this
    process then (a helper's helper, a daemon adopted by :func:`adopt_orphans`) is signalled
    by pid. Returns the pids that were still there.
    """
    stop_all(grace)
    left = descendants()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else _KILL_WAIT_S)
        while (alive := descendants()) and time.monotonic() < deadline:
            _reap_children()
            time.sleep(_POLL_S)
        if not alive:
            break
    _reap_children()
    return left


def _reap_children() -> None:
    """Collect exited children that nobody waits for (adopted orphans)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _validate_start(cmd: Sequence[str], name: str) -> list[str]:
    if isinstance(cmd, str | bytes):
        raise TypeError(f"cmd must be a list of strings, not a single string: {cmd!r}")
    args = list(cmd)
    if not args:
        raise ValueError(f"cmd for process {name!r} is empty")
    bad = [a for a in args if not isinstance(a, str)]
    if bad:
        raise TypeError(f"cmd for process {name!r} must hold only strings, got {bad!r}")
    if not name or not name.strip():
        raise ValueError("name must be a non-empty string")
    return args


def start_process(
    cmd: Sequence[str],
    *,
    name: str,
    log_path: str | Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> ManagedProcess:
    """Start ``cmd`` as a supervised child in its own process group.

    Args:
        cmd: The program and its arguments (no shell).
        name: A short name used in errors and in the log header.
        log_path: File that stdout and stderr are appended to (parent folders are created).
        env: Variables laid over the current environment (``os.environ``) for the child.
        cwd: Working directory of the child (default: the current one).

    Returns:
        The :class:`ManagedProcess`, already registered for :func:`stop_all`.

    Raises:
        ValueError / TypeError: ``cmd`` is empty or not a list of strings, or ``name``
            is empty.
        FileNotFoundError: The program does not exist.
    """
    args = _validate_start(cmd, name)
    install_signal_handlers()
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ)
    if env is not None:
        child_env.update(env)
    with open(path, "ab") as log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"=== {stamp} turnrl: starting {name!r}: {' '.join(args)}\n".encode())
        log.flush()
        try:
            popen = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=cwd,
                start_new_session=True,
            )
        except FileNotFoundError as error:
            raise FileNotFoundError(
                f"cannot start process {name!r}: {args[0]!r} not found ({error})"
            ) from error
        proc = ManagedProcess(popen, name, path, args)
        try:
            proc._watch(log)
        except BaseException:
            proc.kill()
            raise
    _register(proc)
    return proc


def leftovers(grace: float = 0.0) -> list[int]:
    """:func:`descendants` still running after up to ``grace`` seconds for them to end on
    their own (a guard or a cluster's daemons winding down after their owner)."""
    deadline = time.monotonic() + grace
    while (left := descendants()) and time.monotonic() < deadline:
        time.sleep(_POLL_S)  # zombies do not count: descendants() leaves them out
    return left


def describe(pid: int) -> str:
    """``pid``, its command line and the TCP ports it listens on, for a leftovers report."""
    from turnrl.npu_runtime.net import listening_ports

    ports = listening_ports(pid)
    listening = f" (listening on {', '.join(map(str, ports))})" if ports else ""
    return f"{pid} {cmdline(pid)[:200]}{listening}"


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (``?`` if it is gone or unreadable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def run_group(
    cmd: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> tuple[int, str]:
    """Run ``cmd`` in a process group of its own to its end; ``(exit code, output)``.

    stdout and stderr are captured together. Whether ``cmd`` ends, times out or this call
    is interrupted, whatever is left of its group is killed (SIGKILL), so a worker that
    ``cmd`` spawned (``torchrun``'s ranks, an engine) does not outlive it.

    Raises:
        subprocess.TimeoutExpired: ``cmd`` ran past ``timeout`` seconds (its output so far
            in ``output``); the group is killed first.
    """
    proc = subprocess.Popen(
        list(cmd),
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=output) from None
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # leftovers of a finished or failed run
        if proc.poll() is None:
            proc.wait()
    return proc.returncode, output


def run_contained(cmd: Sequence[str], grace: float = 5.0) -> int:
    """Run ``cmd`` to its end, then end whatever it left running; its exit code, or 3.

    This process adopts orphans first (:func:`adopt_orphans`), so daemons ``cmd`` started
    are found too. SIGINT / SIGTERM are passed on to ``cmd``. Leftovers are named on stderr
    and killed (:func:`kill_descendants`); a command that succeeded but left some exits 3.
    """
    adopt_orphans()
    child = subprocess.Popen(list(cmd))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    left = descendants()
    if not left:
        return code
    names = "; ".join(describe(pid) for pid in left)
    print(f"turnrl supervise: {len(left)} process(es) left running: {names}", file=sys.stderr)
    kill_descendants(grace)
    return code or 3


def guard_group(pgid: int, grace: float = _ORPHAN_GRACE_S) -> None:
    """The guard of process group ``pgid`` (started by :func:`start_process`).

    Blocks until standard input, a pipe only the owner writes to, reaches end of file, or
    until the group is gone by itself; if the group is still there, the owner died without
    stopping it: SIGTERM, then SIGKILL after ``grace`` seconds.
    """
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        ready, _, _ = select.select([0], [], [], _GUARD_POLL_S)
        if ready and not os.read(0, 512):
            break
    if not group_alive(pgid):
        return
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"=== {stamp} turnrl: owner gone; stopping process group {pgid}", flush=True)
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)


async def exit_when_orphaned(parent_pid: int, interval: float = 1.0) -> None:
    """SIGTERM this process once ``parent_pid`` is no longer its parent (the parent died).

    For servers a process starts for itself (``--parent-pid``): killed without a chance to
    stop them (SIGKILL, a crash, a test runner's timeout), it would leave them running.
    Polling ``getppid`` works whichever thread started the child (the kernel's parent-death
    signal follows the starting thread, not the process).
    """
    if parent_pid <= 0:
        raise ValueError(f"parent_pid must be > 0, got {parent_pid}")
    while os.getppid() == parent_pid:
        await asyncio.sleep(interval)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--guard":
        if os.fork():  # the launcher exits; the guard is nobody's child but init's
            os._exit(0)
        guard_group(int(sys.argv[2]))  # holds fd argv[3] open until it exits
        sys.exit(0)
    if len(sys.argv) < 3 or sys.argv[1] != "--":
        sys.exit("usage: python -m turnrl.npu_runtime.supervise -- CMD [ARG ...]")
    sys.exit(run_contained(sys.argv[2:]))
