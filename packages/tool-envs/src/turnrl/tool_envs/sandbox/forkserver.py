"""The fork server: a warm Python with numpy and sympy imported that forks once per run.

The HTTP server starts one or more of these processes (``python -m
turnrl.tool_envs.sandbox.forkserver --fd N``) and talks to each over a Unix socket pair with
length-prefixed JSON messages (:mod:`turnrl.tool_envs.sandbox.wire`). The fork server is
single-threaded: a ``selectors`` loop reads requests, forks a child per run, drains the
child's stdout/stderr pipes as they fill (capped, never blocking the child), enforces the
wall clock, reaps the child and answers. Python code runs inside the forked child itself
(no interpreter start-up, imports already done); bash — and Python in ``exec`` mode, the
benchmark's baseline — is ``execve``'d in the child after the same containment steps.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
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
        self.stopping = False

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
                self._poll()
        finally:
            for run in [*self.runs.values(), *self.exiting.values()]:
                self._kill(run)
            shutil.rmtree(self.root, ignore_errors=True)

    def _poll(self) -> None:
        now = time.monotonic()
        deadlines = [r.deadline for r in self.runs.values() if not _ended(r)]
        deadlines += [r.ended + _KILL_GRACE_S for r in self.runs.values() if _ended(r)]
        deadlines += [r.deadline for r in self.exiting.values()]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for key, _ in self.selector.select(timeout):
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
        while self.queue and self.free_uids:
            self._start(self.queue.pop(0))

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
            return
        self.inbox += data
        for message in wire.take_messages(self.inbox):
            self.queue.append(message)

    def _send(self, message: dict[str, Any]) -> None:
        if self.stopping:
            return
        self.sock.setblocking(True)
        try:
            self.sock.sendall(wire.encode(message))
        except OSError:
            self.stopping = True
        finally:
            self.sock.setblocking(False)

    # ----------------------------------------------------------------- one run

    def _start(self, request: dict[str, Any]) -> None:
        uid = self.free_uids.pop()
        rundir = tempfile.mkdtemp(dir=self.root)
        os.chmod(rundir, 0o711)
        try:
            workdir, stdin_path = self._prepare(request, rundir, uid)
        except (ValueError, OSError) as exc:
            shutil.rmtree(rundir, ignore_errors=True)
            self.free_uids.append(uid)
            self._send({"id": request["id"], "error": f"could not prepare the run: {exc}"})
            return
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_process = request["language"] == "python" and self.python_mode == "fork"
        status_r, status_w = os.pipe() if in_process else (-1, -1)
        plan = child.ChildPlan(
            language=request["language"],
            workdir=workdir,
            stdin_path=stdin_path,
            out_fd=out_w,
            err_fd=err_w,
            uid=uid if self.isolation.setuid else None,
            keep_read_search=self.isolation.read_all_files,
            cpu_seconds=request["run_timeout"],
            memory_bytes=request["memory_mb"] << 20,
            python_mode=self.python_mode,
            limits=self.config,
            status_fd=status_w if in_process else None,
        )
        pid = self._fork(plan)
        for fd in (out_w, err_w, status_w):
            if fd >= 0:
                os.close(fd)
        started = time.monotonic()
        run = _Run(
            request=request,
            slot=uid,
            uid=uid,
            rundir=rundir,
            pid=pid,
            pidfd=os.pidfd_open(pid),
            started=started,
            deadline=started + request["run_timeout"],
            pipes={out_r: "stdout", err_r: "stderr"},
        )
        self.runs[pid] = run
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", run))
        self.selector.register(run.pidfd, selectors.EVENT_READ, ("exit", run))
        if status_r >= 0:
            self.selector.register(status_r, selectors.EVENT_READ, ("status", run))

    def _fork(self, plan: child.ChildPlan) -> int:
        """Fork the run's main process, as PID 1 of a new PID namespace when possible."""
        if self.own_pid_ns is not None:
            limits.unshare(limits.CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            if self.own_pid_ns is not None:
                limits.setns(self.own_pid_ns, limits.CLONE_NEWPID)
            raise
        if pid == 0:
            child.run_child(plan)  # never returns
        if self.own_pid_ns is not None:
            limits.setns(self.own_pid_ns, limits.CLONE_NEWPID)
        return pid

    def _prepare(self, request: dict[str, Any], rundir: str, uid: int) -> tuple[str, str]:
        """Create the run's directory (owned by its uid), its input files and its stdin file."""
        workdir = os.path.join(rundir, "work")
        os.mkdir(workdir, 0o700)
        files: dict[str, str | None] = dict(request.get("files") or {})
        files[child.main_file(request["language"])] = base64.b64encode(
            request["code"].encode()
        ).decode()
        for name, content in files.items():
            path = _inside(workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(content or ""))
        stdin_path = os.path.join(rundir, "stdin")
        with open(stdin_path, "wb") as f:
            f.write((request.get("stdin") or "").encode())
        os.chmod(stdin_path, 0o600)
        if self.isolation.setuid:
            for dirpath, dirnames, filenames in os.walk(workdir):
                for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                    os.chown(name, uid, uid)
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
        for name in run.request.get("fetch_files") or []:
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
