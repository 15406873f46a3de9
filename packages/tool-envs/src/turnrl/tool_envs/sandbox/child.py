"""What runs in the forked child: containment steps, then the user's code.

:func:`serve_one_run` is the whole life of a child the fork server forked ahead of demand:
it gets ready, waits for its one run's plan, then :func:`run_child` either replaces the
process (``execve`` for bash and for Python in ``exec`` mode) or runs Python in-process and
calls ``os._exit``. A child never serves a second run. Any failure of the containment
steps is written to the run's stderr and ends the child with code 127, so a run never
silently proceeds without its limits.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import json
import os
import random
import resource
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import NoReturn

from turnrl.tool_envs.sandbox import limits

LANGUAGES = ("python", "bash")
_MAIN_FILES = {"python": "main.py", "bash": "main.sh"}
_PR_SET_PDEATHSIG = 1
_STATUS_FD = 3
_libc = ctypes.CDLL(None)


@dataclass
class ChildPlan:
    """One run, decided by the fork server and sent to a ready child over its plan pipe."""

    language: str
    """``python`` or ``bash``."""
    workdir: str
    """The run's own directory (its cwd, HOME and TMPDIR), owned by ``uid``."""
    stdin_path: str
    """File that becomes stdin (opened before dropping privileges; not readable later)."""
    uid: int | None
    """Unprivileged uid/gid to become, or None when the server is not root."""
    keep_read_search: bool
    """Keep ``CAP_DAC_READ_SEARCH`` after dropping privileges (see ``Isolation``)."""
    cpu_seconds: float
    """CPU-time limit of each process of the run."""
    memory_bytes: int
    """Address space the code may add on top of the interpreter it starts with."""
    python_mode: str
    """``fork``: run Python in this warm process; ``exec``: start a fresh interpreter."""

    @property
    def in_process(self) -> bool:
        """Python run in this warm process (it reports its end on the status pipe)."""
        return self.language == "python" and self.python_mode == "fork"


def main_file(language: str) -> str:
    """Name of the file the code is written to (``main.py`` / ``main.sh``)."""
    return _MAIN_FILES[language]


def serve_one_run(
    plan_fd: int, out_fd: int, err_fd: int, status_fd: int, server_limits: limits.SandboxLimits
) -> NoReturn:
    """Body of a freshly forked, not yet used child: get ready, wait for one plan, run it.

    The fork server forks these ahead of demand (so the fork is off the request path); each
    serves exactly one run and exits. Until its plan arrives the child has done only what
    every run needs: its pipes on fds 0 (plan), 1 (stdout), 2 (stderr) and 3 (status),
    every other fd closed, default signal handlers, its own session, death with its server.
    End of file on the plan pipe (the server discards it or stops) ends it quietly.
    """
    try:
        for target, fd in enumerate((plan_fd, out_fd, err_fd, status_fd)):
            os.dup2(fd, target)
        os.closerange(_STATUS_FD + 1, os.sysconf("SC_OPEN_MAX"))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.setsid()
        set_parent_death_signal()
        base = limits.address_space_bytes()
        _prepare_python()
        plan = _read_plan()
    except BaseException as exc:  # never run code half-prepared
        os.write(2, f"sandbox: could not start the run: {exc!r}\n".encode())
        os._exit(127)
    if plan is None:
        os._exit(0)
    run_child(plan, base, server_limits)


def _read_plan() -> ChildPlan | None:
    """The run's plan from fd 0 (one JSON object, then end of file); None at a bare EOF."""
    data = bytearray()
    while chunk := os.read(0, 1 << 16):
        data += chunk
    return ChildPlan(**json.loads(data)) if data else None


def run_child(
    plan: ChildPlan, base_address_space: int, server_limits: limits.SandboxLimits
) -> NoReturn:
    """Contain this ready child for ``plan`` and run the code in it; never returns."""
    try:
        in_process = plan.in_process
        if not in_process:
            os.close(_STATUS_FD)  # only an in-process run reports; nothing else may write there
        stdin = os.open(plan.stdin_path, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        os.chdir(plan.workdir)
        base = base_address_space if in_process else 0
        limits.apply_rlimits(server_limits, plan.cpu_seconds, base + plan.memory_bytes)
        if plan.uid is not None:
            limits.drop_privileges(plan.uid, plan.keep_read_search)
        set_parent_death_signal()  # after the uid change, which clears it: dies with its server
        env = limits.scrubbed_env(plan.workdir)
        script = main_file(plan.language)
        if plan.language == "bash":
            os.execve("/bin/bash", ["bash", script], env)
        if not in_process:
            os.execve(sys.executable, [sys.executable, "-I", script], env)
    except BaseException as exc:  # containment failed: never run the code without it
        os.write(2, f"sandbox: could not start the run: {exc!r}\n".encode())
        os._exit(127)
    code = _run_python(plan.workdir, env)
    _report_end(code, dropped_uid=plan.uid is not None)
    os._exit(code)


def _report_end(code: int, dropped_uid: bool) -> None:
    """Kill what the run left behind, close its output, report; the exit itself comes after.

    Tearing down a forked copy of the warm interpreter takes milliseconds; the fork server
    answers on this report instead of waiting for it (and still reaps the process).
    """
    try:
        if dropped_uid:
            with contextlib.suppress(ProcessLookupError):  # ESRCH: it left nothing behind
                os.kill(-1, signal.SIGKILL)  # every other process of this run's uid (never us)
        for fd in (0, 1, 2):
            os.close(fd)
        usage = resource.getrusage(resource.RUSAGE_SELF)  # precise, unlike os.times' ticks
        cpu = usage.ru_utime + usage.ru_stime
        os.write(_STATUS_FD, json.dumps({"code": code, "cpu": float(cpu)}).encode())
    except BaseException:
        pass


def _prepare_python() -> None:
    """What an in-process run needs that does not depend on its plan (done while waiting)."""
    os.environ.clear()
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    _reseed()  # this process serves a single run: its entropy is that run's alone


def _run_python(workdir: str, env: dict[str, str]) -> int:
    """Run ``main.py`` as ``__main__`` in this process; return its exit code."""
    os.environ.update(env)
    sys.argv = ["main.py"]
    sys.path.insert(0, workdir)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115  (the run's stdin now)
    code = 0
    try:
        with open("main.py", encoding="utf-8") as f:
            compiled = compile(f.read(), os.path.join(workdir, "main.py"), "exec")
        namespace = {"__name__": "__main__", "__builtins__": builtins, "__file__": "main.py"}
        exec(compiled, namespace)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        traceback.print_exception(
            type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None
        )
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120
    return code


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _reseed() -> None:
    """Forked children share the parent's RNG state; give each run fresh entropy."""
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(int.from_bytes(os.urandom(4), "little"))


def preload(modules: list[str]) -> None:
    """Import modules once in the fork server so every run gets them for free."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"turnrl-sandbox: cannot preload {name}: {exc}", file=sys.stderr)


def set_parent_death_signal() -> None:
    """Have the kernel kill this process when its parent (HTTP server or fork server) dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def kill_all_of_uid(uid: int) -> None:
    """Kill every process of ``uid`` (fallback when there is no PID namespace).

    A helper child takes that uid and calls ``kill(-1, SIGKILL)``, which reaches exactly the
    processes it may signal: those of the same uid (never the helper itself).
    """
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_HUGE = 1 << 21


def collapse_to_huge_pages() -> int:
    """Back the warm interpreter's heap with 2 MiB pages (Linux 6.1+ ``MADV_COLLAPSE``).

    A fork copies, and an exit frees, one page-table entry per 4 KiB page of the parent's
    anonymous memory; with huge pages that is one per 2 MiB, which makes every run's fork
    and exit cheaper (copy-on-write still copies only the 4 KiB a child writes). Returns
    the bytes collapsed; failures (older kernels, THP disabled) are ignored.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed = 0
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f]
    for fields in regions:
        anonymous = len(fields) < 6 or fields[5] == "[heap]"
        if not anonymous or not fields[1].startswith("rw"):
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start, end = (low + _HUGE - 1) & ~(_HUGE - 1), high & ~(_HUGE - 1)
        if end > start:
            libc.madvise(start, end - start, _MADV_HUGEPAGE)
            if libc.madvise(start, end - start, _MADV_COLLAPSE) == 0:
                collapsed += end - start
    return collapsed
