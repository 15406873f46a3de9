"""The fork server: a warm Python with numpy and sympy imported that forks once per run.

The HTTP server starts one or more of these processes (``python -m
turnrl.tool_envs.sandbox.forkserver --fd N``) and talks to each over a Unix socket pair with
length-prefixed JSON messages (:mod:`turnrl.tool_envs.sandbox.wire`). The fork server is
single-threaded: a ``selectors`` loop reads requests, hands each run to a forked child,
drains the child's stdout/stderr pipes as they fill (capped, never blocking the child),
enforces the wall clock, reaps the child and answers. Python code runs inside the forked
child itself (no interpreter start-up, imports already done); bash — and Python in ``exec``
mode, the benchmark's baseline — is ``execve``'d in the child after the same containment
steps.

Children are forked ahead of demand: whenever the loop is idle and no ready child is
waiting, it forks one, which prepares what every run needs and blocks on its plan pipe
(:func:`~turnrl.tool_envs.sandbox.child.serve_one_run`), so the fork — copying the warm
interpreter's page tables, the largest single cost of a run — is off the request path.
A ready child serves exactly one run; right after the fork it drops its copies of the
server's bookkeeping (other runs' requests and output), so a run cannot find another run's
code or output among its Python objects.
"""

from __future__ import annotations

import argparse
import base64
import gc
import itertools
import json
import os
import select
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from turnrl.tool_envs.sandbox import child, limits, wire

_READ_CHUNK = 1 << 16
_KILL_GRACE_S = 0.5  # after the main process is reaped, how long stray pipe holders may live
_EXIT_GRACE_S = 1.0  # after a run reported its end, how long its exit may take before SIGKILL


def _waiting(pid: int, pidfd: int) -> bool:
    """Whether a ready child is alive with no kill pending: a child SIGKILLed from outside
    may not have exited yet, and a plan written to its pipe would be lost with it."""
    if select.select([pidfd], [], [], 0)[0]:
        return False  # exited
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    pending = int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)
    return fields.get("State", "").split()[:1] not in (["Z"], ["X"]) and not (
        pending & (1 << (signal.SIGKILL - 1))
    )


@dataclass
class _Ready:
    """A forked child waiting for its plan (see :func:`child.serve_one_run`)."""

    pid: int
    pidfd: int
    plan_w: int
    out_r: int
    err_r: int
    status_r: int

    def close(self) -> None:
        for fd in (self.pidfd, self.plan_w, self.out_r, self.err_r, self.status_r):
            if fd >= 0:
                os.close(fd)


_MAX_START_ATTEMPTS = 3
_FORK_AHEAD_RETRY_S = 1.0


@dataclass
class _Run:
    """One running request."""

    request: dict[str, Any]
    slot: int
    uid: int
    rundir: str
    pid: int
    pidfd: int
    started: float
    deadline: float
    pipes: dict[int, str]
    """Open read ends of the child's pipes -> ``stdout`` / ``stderr``."""
    output: dict[str, bytearray] = field(
        default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()}
    )
    truncated: dict[str, bool] = field(default_factory=lambda: {"stdout": False, "stderr": False})
    status: int | None = None
    """Wait status once reaped."""
    reported: dict[str, Any] | None = None
    """What an in-process Python run reported just before exiting (exit code, CPU time)."""
    replied: bool = False
    cpu_time: float = 0.0
    ended: float = 0.0
    timed_out: bool = False


class ForkServer:
    """Serves run requests from one socket; see the module docstring."""

    def __init__(
        self,
        sock: socket.socket,
        config: limits.SandboxLimits,
        slots: int,
        python_mode: str,
        worker_index: int,
    ) -> None:
        self.sock = sock
        self.config = config
        self.python_mode = python_mode
        self.isolation = limits.probe_isolation()
        limits.enter_empty_network_namespace(self.isolation)
        self.own_pid_ns = limits.probe_pid_namespace(self.isolation)
        first_uid = config.base_uid + worker_index * slots
        self.free_uids = list(range(first_uid, first_uid + slots))
        self.uid_range = (first_uid, first_uid + slots)
        self.root = tempfile.mkdtemp(prefix="turnrl-sandbox-")
        os.chmod(self.root, 0o711)
        limits.enter_private_mounts(self.isolation, self.root, config.tmpfs_mb)
        limits.check_interpreter(self.isolation, first_uid)
        self.selector = selectors.DefaultSelector()
        self.inbox = bytearray()
        self.queue: list[dict[str, Any]] = []
        self.runs: dict[int, _Run] = {}  # by pid, until answered
        self.exiting: dict[int, _Run] = {}  # answered (reported their end), not reaped yet
        self.ready: _Ready | None = None  # forked ahead of demand, waiting for its plan
        self.stopping = False
        self._run_numbers = itertools.count()
        self._fork_ahead_after = 0.0  # after a failed fork ahead, when to try the next

    # ----------------------------------------------------------------- event loop

    def serve_forever(self) -> None:
        """Answer requests until the socket closes, then kill every run and clean up."""
        self.sock.setblocking(False)
        self.selector.register(self.sock, selectors.EVENT_READ, ("control", None))
        isolation = {**asdict(self.isolation), "runs_dir": self.root, "uids": list(self.uid_range)}
        isolation["pid"] = os.getpid()
        self._send({"ready": True, "isolation": isolation})
        try:
            while not (self.stopping and not self.runs):
                # Idle (nothing to read, nothing queued) and no ready child: fork one now,
                # so the next request does not wait for the fork.
                want_ready = (
                    self.ready is None
                    and not self.stopping
                    and time.monotonic() >= self._fork_ahead_after
                )
                events = self._poll(block=not want_ready)
                self._start_queued()
                if want_ready and not events and self.ready is None:
                    try:
                        self.ready = self._fork_ready()
                    except OSError:  # out of processes or memory: retry later or on demand
                        self._fork_ahead_after = time.monotonic() + _FORK_AHEAD_RETRY_S
        finally:
            for run in [*self.runs.values(), *self.exiting.values()]:
                self._kill(run)
            self._discard_ready()
            shutil.rmtree(self.root, ignore_errors=True)

    def _poll(self, block: bool = True) -> int:
        """Wait for (at most until the next deadline; without ``block``, poll) and handle events."""
        now = time.monotonic()
        deadlines = [r.deadline for r in self.runs.values() if not _ended(r)]
        deadlines += [r.ended + _KILL_GRACE_S for r in self.runs.values() if _ended(r)]
        deadlines += [r.deadline for r in self.exiting.values()]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        events = self.selector.select(timeout if block else 0)
        for key, _ in events:
            kind, run = key.data
            if kind == "control":
                self._read_control()
            elif kind == "pipe":
                self._read_pipe(run, key.fd)
            elif kind == "status":
                self._read_status(run, key.fd)
            else:
                self._reap(run)
        now = time.monotonic()
        for run in list(self.runs.values()):
            if not _ended(run) and now >= run.deadline:
                run.timed_out = True
                self._kill(run)
            elif _ended(run) and (not run.pipes or now >= run.ended + _KILL_GRACE_S):
                self._finish(run)
        for run in list(self.exiting.values()):
            if now >= run.deadline:
                self._kill(run)
        return len(events)

    def _start_queued(self) -> None:
        """Start queued requests while run slots are free, each in a ready child.

        Called from the loop's top level, so the stack a child is forked on holds no
        reference to another run.
        """
        while self.queue and self.free_uids and not self.stopping:
            if self.ready is None:
                try:
                    self.ready = self._fork_ready()
                except OSError as exc:
                    request = self.queue.pop(0)
                    self._send({"id": request["id"], "error": f"could not fork the run: {exc}"})
                    continue
            ready, self.ready = self.ready, None
            self._start(self.queue.pop(0), ready)

    def _read_control(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        if not data:
            self.stopping = True
            self.selector.unregister(self.sock)
            for run in self.runs.values():
                self._kill(run)
            self._discard_ready()
            return
        self.inbox += data
        for message in wire.take_messages(self.inbox):
            self.queue.append(message)

    def _send(self, message: dict[str, Any]) -> None:
        if self.stopping:
            return
        data = wire.encode(message)
        try:
            sent = self.sock.send(data)  # one syscall for the usual small answer
        except BlockingIOError:
            sent = 0
        except OSError:
            self.stopping = True
            return
        if sent == len(data):
            return
        self.sock.setblocking(True)
        try:
            self.sock.sendall(data[sent:])
        except OSError:
            self.stopping = True
        finally:
            self.sock.setblocking(False)

    # ----------------------------------------------------------------- one run

    def _start(self, request: dict[str, Any], ready: _Ready) -> None:
        """Prepare the run's directory and send its plan to ``ready``, which then runs it."""
        uid = self.free_uids.pop()
        rundir = os.path.join(self.root, f"run-{next(self._run_numbers)}")
        try:
            os.mkdir(rundir, 0o711)
            os.chmod(rundir, 0o711)  # whatever the umask: runs may traverse it, not list it
            workdir, stdin_path = self._prepare(request, rundir, uid)
        except (ValueError, OSError) as exc:
            shutil.rmtree(rundir, ignore_errors=True)
            self.free_uids.append(uid)
            self.ready = ready  # unused: it serves the next run
            self._send({"id": request["id"], "error": f"could not prepare the run: {exc}"})
            return
        plan = child.ChildPlan(
            language=request["language"],
            workdir=workdir,
            stdin_path=stdin_path,
            uid=uid if self.isolation.setuid else None,
            keep_read_search=self.isolation.read_all_files,
            cpu_seconds=request["run_timeout"],
            memory_bytes=request["memory_mb"] << 20,
            python_mode=self.python_mode,
        )
        try:
            if not _waiting(ready.pid, ready.pidfd):
                raise OSError("the ready child was killed while it waited")
            os.write(ready.plan_w, json.dumps(asdict(plan)).encode())
        except OSError as exc:  # the ready child died while waiting (killed from outside)
            self._discard(ready)
            shutil.rmtree(rundir, ignore_errors=True)
            self.free_uids.append(uid)
            attempts = request.get("_attempts", 0) + 1
            if attempts >= _MAX_START_ATTEMPTS:
                self._send({"id": request["id"], "error": f"could not start the run: {exc}"})
            else:
                self.queue.insert(0, {**request, "_attempts": attempts})
            return
        os.close(ready.plan_w)  # end of file: the whole plan is there
        started = time.monotonic()
        run = _Run(
            request=request,
            slot=uid,
            uid=uid,
            rundir=rundir,
            pid=ready.pid,
            pidfd=ready.pidfd,
            started=started,
            deadline=started + request["run_timeout"],
            pipes={ready.out_r: "stdout", ready.err_r: "stderr"},
        )
        self.runs[run.pid] = run
        for fd in (ready.out_r, ready.err_r):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", run))
        self.selector.register(run.pidfd, selectors.EVENT_READ, ("exit", run))
        if plan.in_process:
            self.selector.register(ready.status_r, selectors.EVENT_READ, ("status", run))
        else:
            os.close(ready.status_r)  # the child closed its end too: only in-process runs report

    def _fork_ready(self) -> _Ready:
        """Fork a child that gets ready and waits for its plan, as PID 1 of a new PID namespace
        when possible."""
        plan_r, plan_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        theirs, ours = (plan_r, out_w, err_w, status_w), (plan_w, out_r, err_r, status_r)
        if self.own_pid_ns is not None:
            limits.unshare(limits.CLONE_NEWPID)  # our next child is PID 1 of a new namespace
        try:
            pid = os.fork()
        except BaseException:
            for fd in (*theirs, *ours):
                os.close(fd)
            if self.own_pid_ns is not None:
                limits.setns(self.own_pid_ns, limits.CLONE_NEWPID)
            raise
        if pid == 0:
            try:
                self._forget_other_runs()
            except BaseException:
                os._exit(127)
            child.serve_one_run(*theirs, self.config)  # never returns
        if self.own_pid_ns is not None:
            limits.setns(self.own_pid_ns, limits.CLONE_NEWPID)
        for fd in theirs:
            os.close(fd)
        return _Ready(pid, os.pidfd_open(pid), *ours)

    def _forget_other_runs(self) -> None:
        """In a new child: drop the server's references to other runs (code, output, files)."""
        self.selector.close()  # its keys hold the runs
        self.runs.clear()
        self.exiting.clear()
        self.queue.clear()
        self.inbox.clear()

    def _discard_ready(self) -> None:
        if self.ready is not None:
            ready, self.ready = self.ready, None
            self._discard(ready)

    def _discard(self, ready: _Ready) -> None:
        """End an unused ready child (closing its plan pipe would too) and reap it."""
        try:
            os.kill(ready.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        ready.close()
        try:
            os.waitpid(ready.pid, 0)
        except ChildProcessError:
            pass

    def _prepare(self, request: dict[str, Any], rundir: str, uid: int) -> tuple[str, str]:
        """Create the run's directory (owned by its uid), its input files and its stdin file."""
        workdir = os.path.join(rundir, "work")
        os.mkdir(workdir, 0o700)
        contents = {
            name: base64.b64decode(content or "")
            for name, content in (request.get("files") or {}).items()
        }
        contents[child.main_file(request["language"])] = request["code"].encode()
        owned, nested = [workdir], False
        for name, data in contents.items():
            path = _inside(workdir, name)
            if os.path.dirname(path) != workdir:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                nested = True
            _write_file(path, data, 0o644)
            owned.append(path)
        stdin_path = os.path.join(rundir, "stdin")
        _write_file(stdin_path, (request.get("stdin") or "").encode(), 0o600)  # root's only
        if self.isolation.setuid:
            if nested:  # directories made on the way belong to the run too
                owned = [workdir]
                for dirpath, dirnames, filenames in os.walk(workdir):
                    owned += [os.path.join(dirpath, n) for n in dirnames + filenames]
            for path in owned:
                os.chown(path, uid, uid)
        return workdir, stdin_path

    def _read_pipe(self, run: _Run, fd: int) -> None:
        name = run.pipes[fd]
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self._close_pipe(run, fd)
            return
        buf = run.output[name]
        room = self.config.max_output_bytes - len(buf)
        if len(data) > room:
            run.truncated[name] = True
            data = data[: max(room, 0)]
        buf += data

    def _read_status(self, run: _Run, fd: int) -> None:
        """An in-process run's report of its end (sent after it closed stdout and stderr)."""
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        self.selector.unregister(fd)
        os.close(fd)
        try:
            report = json.loads(data)
            if isinstance(report.get("code"), int) and isinstance(report.get("cpu"), float):
                run.reported = report
                run.ended = time.monotonic()
                run.deadline = min(run.deadline, run.ended + _EXIT_GRACE_S)
        except (ValueError, AttributeError):
            pass  # forged or cut short by a crash: the reap tells the truth

    def _close_pipe(self, run: _Run, fd: int) -> None:
        self.selector.unregister(fd)
        os.close(fd)
        del run.pipes[fd]

    def _reap(self, run: _Run) -> None:
        try:
            pid, status, usage = os.wait4(run.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status, usage = run.pid, 0, None
        if pid == 0:
            return
        run.status = status
        run.cpu_time = (usage.ru_utime + usage.ru_stime) if usage else 0.0
        run.ended = run.ended or time.monotonic()
        self.selector.unregister(run.pidfd)
        os.close(run.pidfd)
        if not self.isolation.pid_namespace:
            self._kill(run)  # the process group and, by uid, anything that escaped it
        if run.replied:
            self._cleanup(run)

    def _kill(self, run: _Run) -> None:
        """Kill the run's whole tree (the PID namespace dies with its PID 1)."""
        for target in (
            lambda: os.kill(run.pid, signal.SIGKILL),
            lambda: os.killpg(run.pid, signal.SIGKILL),
        ):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass
        if self.isolation.setuid and not self.isolation.pid_namespace:
            child.kill_all_of_uid(run.uid)

    def _finish(self, run: _Run) -> None:
        for fd in list(run.pipes):
            self._read_pipe(run, fd)
            if fd in run.pipes:  # a last read that met EOF has closed it already
                self._close_pipe(run, fd)
        del self.runs[run.pid]
        reply = _result(run, self._fetch(run))
        run.replied = True
        self._send(reply)
        if run.status is None:  # reported its end and is exiting: clean up once reaped
            self.exiting[run.pid] = run
        else:
            self._cleanup(run)

    def _cleanup(self, run: _Run) -> None:
        self.exiting.pop(run.pid, None)
        shutil.rmtree(run.rundir, ignore_errors=True)
        self.free_uids.append(run.uid)

    def _fetch(self, run: _Run) -> dict[str, str]:
        """Read the requested output files (regular files inside the run's directory only)."""
        workdir = os.path.realpath(os.path.join(run.rundir, "work"))
        fetched: dict[str, str] = {}
        if not run.request.get("fetch_files"):
            return fetched
        for name in run.request["fetch_files"]:
            try:
                path = os.path.realpath(_inside(workdir, name))
                if not path.startswith(workdir + os.sep):
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                with os.fdopen(fd, "rb") as f:
                    if os.fstat(f.fileno()).st_size <= self.config.max_file_bytes:
                        fetched[name] = base64.b64encode(f.read()).decode()
            except (OSError, ValueError):
                continue
        return fetched


def _write_file(path: str, data: bytes, mode: int) -> None:
    """Create (or truncate) ``path`` with ``data``: a few syscalls, no buffered file object."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _ended(run: _Run) -> bool:
    return run.status is not None or run.reported is not None


def _inside(workdir: str, name: str) -> str:
    """``workdir/name`` for a relative ``name`` that stays inside ``workdir``."""
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm == ".." or norm.startswith("../") or norm in ("", "."):
        raise ValueError(f"file path {name!r} must be relative and stay inside the run directory")
    return os.path.join(workdir, norm)


def _result(run: _Run, files: dict[str, str]) -> dict[str, Any]:
    """The fork server's answer for a finished run (the HTTP server shapes the response)."""
    if run.status is None:  # answered on the run's own report, before its exit completed
        assert run.reported is not None
        signum, code, run.cpu_time = None, run.reported["code"], run.reported["cpu"]
    else:
        signum = os.WTERMSIG(run.status) if os.WIFSIGNALED(run.status) else None
        code = os.WEXITSTATUS(run.status) if os.WIFEXITED(run.status) else -(signum or 0)
    cpu_exceeded = signum in (signal.SIGXCPU, signal.SIGKILL) and (
        run.cpu_time >= run.request["run_timeout"] - 0.05
    )
    return {
        "id": run.request["id"],
        "timed_out": run.timed_out or cpu_exceeded,
        "return_code": code,
        "signal": signal.Signals(signum).name if signum else None,
        "execution_time": round((run.ended or time.monotonic()) - run.started, 6),
        "cpu_time": round(run.cpu_time, 6),
        "stdout": run.output["stdout"].decode("utf-8", errors="replace"),
        "stderr": run.output["stderr"].decode("utf-8", errors="replace"),
        "stdout_truncated": run.truncated["stdout"],
        "stderr_truncated": run.truncated["stderr"],
        "files": files,
    }


def main(argv: list[str] | None = None) -> None:
    """Entry point of a fork-server process (started by the HTTP server, not by users)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="inherited socket fd")
    parser.add_argument("--config", default="{}", help="SandboxLimits fields as JSON")
    parser.add_argument("--slots", type=int, default=64, help="most runs at once")
    parser.add_argument("--python-mode", choices=["fork", "exec"], default="fork")
    parser.add_argument("--worker-index", type=int, default=0)
    parser.add_argument(
        "--preload",
        default="numpy,numpy.random,sympy,fractions,decimal,statistics",
        help="modules to import up front",
    )
    args = parser.parse_args(argv)
    child.set_parent_death_signal()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sock = socket.socket(fileno=args.fd)
    config = limits.SandboxLimits(**json.loads(args.config))
    server = ForkServer(sock, config, args.slots, args.python_mode, args.worker_index)
    if args.python_mode == "fork":
        child.preload([m for m in args.preload.split(",") if m])
        gc.collect()
        gc.freeze()  # children never scan (and so never copy) the preloaded objects
        child.collapse_to_huge_pages()
    server.serve_forever()


if __name__ == "__main__":
    main()
