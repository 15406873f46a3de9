"""Process supervision with real child processes and a real HTTP health endpoint."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from turnrl.npu_runtime import supervise
from turnrl.npu_runtime.net import free_port
from turnrl.npu_runtime.supervise import (
    HealthTimeoutError,
    ProcessDiedError,
    StartCancelled,
    start_process,
    stop_all,
)


def test_child_serves_health_and_stops(scripts, tmp_path, port, gone):
    log = tmp_path / "logs" / "server.log"
    proc = start_process(
        [sys.executable, str(scripts["health_server"]), str(port), "0.3"],
        name="server",
        log_path=log,
    )
    try:
        assert proc.alive and proc.returncode is None
        assert proc in supervise.running_processes()
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=20, interval=0.1)
        assert proc.alive
        assert "serving" in proc.tail()
        assert proc.tail(1).strip() == "serving"
    finally:
        code = proc.stop(grace=5)
    assert code == -signal.SIGTERM
    assert proc.returncode == -signal.SIGTERM and not proc.alive
    assert proc not in supervise.running_processes()
    assert gone(proc.pid, timeout=0)
    # The log holds our header, then the child's own output.
    assert log.read_text().splitlines()[0].startswith("=== ")
    assert proc.stop() == code  # idempotent


def test_non_200_health_endpoint_times_out(scripts, tmp_path, port, gone):
    with start_process(
        [sys.executable, str(scripts["health_server"]), str(port), "0"],
        name="wrong-path",
        log_path=tmp_path / "s.log",
    ) as proc:
        with pytest.raises(HealthTimeoutError) as info:
            proc.wait_healthy(f"http://127.0.0.1:{port}/missing", timeout=1.5, interval=0.1)
        assert "HTTP 404" in str(info.value)
        assert info.value.url.endswith("/missing")
    assert gone(proc.pid)


def test_health_timeout_keeps_child_and_reports_log(scripts, tmp_path, port, gone):
    proc = start_process(
        [sys.executable, str(scripts["health_server"]), str(port), "60"],
        name="slow-server",
        log_path=tmp_path / "slow.log",
    )
    try:
        start = time.monotonic()
        with pytest.raises(HealthTimeoutError) as info:
            proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=1.0, interval=0.1)
        elapsed = time.monotonic() - start
        assert 0.9 <= elapsed < 5.0
        assert "slow-server" in str(info.value)
        assert "server starting" in info.value.log_tail
        assert isinstance(info.value, TimeoutError)  # callers may catch the builtin
        assert proc.alive  # a timeout does not kill; the caller decides
    finally:
        proc.stop(grace=2)
    assert gone(proc.pid, timeout=0)


def test_a_wait_for_health_is_cancelled_from_another_thread(scripts, tmp_path, port, gone):
    """A server that needs 60 s to come up: setting ``cancel`` (as a run does on Ctrl-C
    while its engines start) ends the wait at once, leaving the child to the caller."""
    proc = start_process(
        [sys.executable, str(scripts["health_server"]), str(port), "60"],
        name="slow-server",
        log_path=tmp_path / "slow.log",
    )
    cancel = threading.Event()
    try:
        threading.Timer(0.5, cancel.set).start()
        start = time.monotonic()
        with pytest.raises(StartCancelled, match="slow-server"):
            proc.wait_healthy(
                f"http://127.0.0.1:{port}/health", timeout=60, interval=0.5, cancel=cancel
            )
        assert time.monotonic() - start < 10  # not the 60 s the server needs
        assert proc.alive
    finally:
        proc.stop(grace=2)
    assert gone(proc.pid, timeout=0)


def test_child_dying_during_startup_raises_with_log_tail(scripts, tmp_path, port, gone):
    proc = start_process(
        [sys.executable, str(scripts["dies_early"])], name="crashy", log_path=tmp_path / "c.log"
    )
    start = time.monotonic()
    with pytest.raises(ProcessDiedError) as info:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=30, interval=0.1)
    assert time.monotonic() - start < 10  # noticed the death, did not wait for the timeout
    error = info.value
    assert error.returncode == 3 and error.name == "crashy"
    assert "exited with code 3" in str(error)
    assert "out of device memory" in str(error)
    assert "loading shard 49" in error.log_tail
    assert "loading shard 0\n" not in error.log_tail  # only the last 40 lines
    assert proc.stop() == 3
    assert gone(proc.pid, timeout=0)


async def test_wait_healthy_async_does_not_block_loop(scripts, tmp_path, port, gone):
    proc = start_process(
        [sys.executable, str(scripts["health_server"]), str(port), "0.5"],
        name="async-server",
        log_path=tmp_path / "a.log",
    )
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.02)

    task = asyncio.create_task(ticker())
    try:
        await proc.wait_healthy_async(f"http://127.0.0.1:{port}/health", timeout=20, interval=0.1)
        assert ticks >= 10  # the loop kept running while we waited ~0.5 s or more
    finally:
        task.cancel()
        proc.stop(grace=5)
    assert gone(proc.pid, timeout=0)


async def test_wait_healthy_async_reports_death_and_timeout(scripts, tmp_path, port, gone):
    crashy = start_process(
        [sys.executable, str(scripts["dies_early"])], name="crashy", log_path=tmp_path / "c.log"
    )
    with pytest.raises(ProcessDiedError, match="out of device memory"):
        await crashy.wait_healthy_async(f"http://127.0.0.1:{port}/h", timeout=30, interval=0.1)
    crashy.stop()
    with (
        start_process(
            [sys.executable, str(scripts["sleeper"])], name="sleeper", log_path=tmp_path / "s.log"
        ) as sleeper,
        pytest.raises(HealthTimeoutError, match="sleeper"),
    ):
        await sleeper.wait_healthy_async(f"http://127.0.0.1:{port}/h", timeout=0.5)
    assert gone(crashy.pid, timeout=0) and gone(sleeper.pid)


def test_sigterm_ignoring_child_and_grandchild_are_killed_after_grace(scripts, tmp_path, gone):
    pid_file = tmp_path / "grandchild.pid"
    proc = start_process(
        [sys.executable, str(scripts["ignores_sigterm"]), str(pid_file)],
        name="stubborn",
        log_path=tmp_path / "stubborn.log",
    )
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert os.getpgid(grandchild) == proc.pid  # same group as the child it leads
    time.sleep(0.2)  # let the child reach its loop, past any startup
    start = time.monotonic()
    code = proc.stop(grace=1.0)
    elapsed = time.monotonic() - start
    assert code == -signal.SIGKILL  # SIGTERM was ignored, so it took SIGKILL
    assert elapsed >= 1.0  # the grace period was honoured
    assert elapsed < 8.0
    assert gone(proc.pid, timeout=0)
    assert gone(grandchild)


def test_stop_also_kills_grandchildren_left_after_child_exit(tmp_path, gone):
    # The child starts a grandchild and exits at once: the group outlives its leader.
    pid_file = tmp_path / "gc.pid"
    script = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))"
    )
    proc = start_process([sys.executable, "-c", script], name="forker", log_path=tmp_path / "f.log")
    deadline = time.monotonic() + 20
    while proc.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert not gone(grandchild, timeout=0)
    start = time.monotonic()
    assert proc.stop(grace=5) == 0
    # The grandchild obeys SIGTERM; its zombie (which init may never reap) is not
    # waited for, so stop() returns well before the grace period ends.
    assert time.monotonic() - start < 4
    assert gone(grandchild)


def _forker(pid_file: Path, then: str) -> list[str]:
    """A command that starts a sleeping grandchild (output detached), writes its pid, then
    runs ``then``."""
    script = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); {then}"
    )
    return [sys.executable, "-c", script]


def test_run_group_returns_code_and_output_and_kills_leftovers(tmp_path, gone):
    pid_file = tmp_path / "gc.pid"
    code, output = supervise.run_group(_forker(pid_file, "sys.exit(3)"), timeout=60)
    assert (code, output) == (3, "started\n")
    assert gone(int(pid_file.read_text()))  # the grandchild it left was killed


def test_run_group_timeout_kills_the_whole_group(tmp_path, gone):
    pid_file = tmp_path / "gc.pid"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as error:
        supervise.run_group(_forker(pid_file, "time.sleep(600)"), timeout=3)
    assert time.monotonic() - start < 15
    assert error.value.output == "started\n"
    assert gone(int(pid_file.read_text()))


def test_run_group_applies_env_and_cwd(tmp_path):
    code, output = supervise.run_group(
        [sys.executable, "-c", "import os; print(os.environ['X'], os.getcwd())"],
        timeout=60,
        env={**os.environ, "X": "y"},
        cwd=tmp_path,
    )
    assert code == 0 and output.split() == ["y", str(tmp_path)]


def test_stop_all_stops_every_child(scripts, tmp_path, gone):
    procs = [
        start_process(
            [sys.executable, str(scripts["sleeper"])], name=f"s{i}", log_path=tmp_path / "s.log"
        )
        for i in range(3)
    ]
    stop_all(grace=2)
    assert supervise.running_processes() == []
    for proc in procs:
        assert proc.returncode == -signal.SIGTERM
        assert gone(proc.pid, timeout=0)


def test_env_is_laid_over_environ_and_cwd_applies(tmp_path):
    script = "import os; print(os.environ['TURNRL_X'], 'PATH' in os.environ, os.getcwd())"
    workdir = tmp_path / "wd"
    workdir.mkdir()
    proc = start_process(
        [sys.executable, "-c", script],
        name="env",
        log_path=tmp_path / "e.log",
        env={"TURNRL_X": "hello"},
        cwd=workdir,
    )
    deadline = time.monotonic() + 20
    while proc.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.stop() == 0
    assert proc.tail(1) == f"hello True {workdir}"


@pytest.mark.parametrize(
    ("cmd", "name", "error", "match"),
    [
        ([], "x", ValueError, "empty"),
        ("python -c 1", "x", TypeError, "single string"),
        (["python", 3], "x", TypeError, "only strings"),
        (["python"], "", ValueError, "name"),
    ],
)
def test_bad_start_arguments(cmd, name, error, match, tmp_path):
    with pytest.raises(error, match=match):
        start_process(cmd, name=name, log_path=tmp_path / "x.log")


def test_missing_program_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-engine"):
        start_process(["no-such-engine-binary"], name="no-such-engine", log_path=tmp_path / "x.log")
    assert supervise.running_processes() == []


def test_bad_wait_and_stop_arguments(scripts, tmp_path, gone):
    with start_process(
        [sys.executable, str(scripts["sleeper"])], name="s", log_path=tmp_path / "s.log"
    ) as proc:
        for url in ("localhost:8000/health", "ftp://h/x", "http:///health"):
            with pytest.raises(ValueError, match="health url"):
                proc.wait_healthy(url, timeout=1)
        with pytest.raises(ValueError, match="timeout"):
            proc.wait_healthy("http://127.0.0.1:1/", timeout=0)
        with pytest.raises(ValueError, match="interval"):
            proc.wait_healthy("http://127.0.0.1:1/", timeout=1, interval=0)
        with pytest.raises(ValueError, match="grace"):
            proc.stop(grace=-1)
        assert proc.alive
    assert gone(proc.pid)


def test_tail_of_missing_or_empty_log(tmp_path):
    assert supervise._read_tail(tmp_path / "nope.log", 5) == ""
    log = tmp_path / "l.log"
    log.write_text("".join(f"line {i}\n" for i in range(10_000)))
    assert supervise._read_tail(log, 3) == "line 9997\nline 9998\nline 9999"
    assert supervise._read_tail(log, 0) == ""


# A parent Python process that supervises one sleeping child, prints the child's pid,
# then either exits normally or waits to be signalled.
PARENT = """
import signal, sys, time
# Answer Ctrl-C as in a terminal even when the test runner was started with SIGINT ignored
# (a background job of a shell without job control inherits SIG_IGN).
signal.signal(signal.SIGINT, signal.default_int_handler)
from turnrl.npu_runtime.supervise import start_process
mode, log = sys.argv[1], sys.argv[2]
if mode == "chain":
    def mine(sig, frame):
        print("previous handler ran", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, mine)
cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
if mode == "stubborn":  # ignores SIGTERM, and so does the grandchild it starts
    cmd = [sys.executable, "-c", "import signal, subprocess, sys, time; "
           "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
           "time.sleep(600)"]
if mode == "thread":
    import threading
    from turnrl.npu_runtime.supervise import install_signal_handlers
    assert install_signal_handlers()
    started = []
    worker = threading.Thread(target=lambda: started.append(
        start_process(cmd, name="child", log_path=log)))
    worker.start()
    worker.join()
    proc = started[0]
else:
    proc = start_process(cmd, name="child", log_path=log)
print(proc.pid, flush=True)
if mode == "exit":
    sys.stdin.readline()  # the test checks the child is up, then lets us exit
    sys.exit(0)
time.sleep(600)
"""


def _run_parent(
    tmp_path: Path, mode: str, gone: Callable[..., bool]
) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT))
    parent = subprocess.Popen(
        [sys.executable, str(script), mode, str(tmp_path / "child.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert not gone(child, timeout=0)
    return parent, child


def _finish_parent(parent: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, _ = parent.communicate("go\n", timeout=30)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
    return parent.returncode, out


def test_children_are_stopped_at_interpreter_exit(tmp_path, gone):
    parent, child = _run_parent(tmp_path, "exit", gone)
    code, _ = _finish_parent(parent)
    assert code == 0
    assert gone(child)


@pytest.mark.parametrize(
    ("sig", "expected_code"),
    # An uncaught KeyboardInterrupt makes Python die of SIGINT too.
    [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)],
)
def test_children_are_stopped_when_parent_is_signalled(tmp_path, sig, expected_code, gone):
    parent, child = _run_parent(tmp_path, "wait", gone)
    parent.send_signal(sig)
    code, _ = _finish_parent(parent)
    assert code == expected_code
    assert gone(child)


def test_children_started_from_a_thread_are_stopped_on_sigterm(tmp_path, gone):
    parent, child = _run_parent(tmp_path, "thread", gone)
    parent.send_signal(signal.SIGTERM)
    code, _ = _finish_parent(parent)
    assert code == -signal.SIGTERM
    assert gone(child)


def _guards(pgid: int) -> list[int]:
    """Processes whose command line is the guard of process group ``pgid``."""
    mark = f"--guard\0{pgid}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(c) for t in tasks for c in (t / "children").read_text().split()]


def test_children_are_stopped_when_parent_is_killed_by_sigkill(tmp_path, gone):
    """No handler runs on SIGKILL: the child's guard sees the parent's pipe close.

    As Ray does when a worker exits, the parent's direct children are SIGKILLed with it:
    the supervised child goes, its grandchild (which ignores SIGTERM) is left to the guard.
    """
    parent, child = _run_parent(tmp_path, "stubborn", gone)
    deadline = time.monotonic() + 20
    while not supervise.descendants(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = supervise.descendants(child)[0]
    guards = _guards(child)
    assert len(guards) == 1 and guards[0] not in _children(parent.pid)
    for pid in [parent.pid, *_children(parent.pid)]:
        os.kill(pid, signal.SIGKILL)
    parent.wait()
    started = time.monotonic()
    assert gone(child, timeout=5) and gone(grandchild, timeout=30)
    # SIGTERM was ignored, so it took the guard's SIGKILL after its grace period.
    assert time.monotonic() - started >= supervise._ORPHAN_GRACE_S - 1
    assert "owner gone; stopping process group" in (tmp_path / "child.log").read_text()
    assert gone(guards[0], timeout=10)  # its work done, the guard exits too


def test_the_guard_exits_with_a_child_stopped_normally(tmp_path, gone):
    proc = start_process(
        [sys.executable, "-c", "import time; time.sleep(600)"], name="g", log_path=tmp_path / "g"
    )
    guards = _guards(proc.pid)
    assert len(guards) == 1
    proc.stop(grace=5)
    assert gone(guards[0], timeout=0) and gone(proc.pid, timeout=0)
    assert "owner gone" not in (tmp_path / "g").read_text()


def test_install_signal_handlers_from_a_thread_is_refused_until_main_did_it():
    results: list[bool] = []
    already = supervise._handlers_installed
    worker = threading.Thread(target=lambda: results.append(supervise.install_signal_handlers()))
    worker.start()
    worker.join()
    assert results == [already]


def test_previous_sigterm_handler_is_chained(tmp_path, gone):
    parent, child = _run_parent(tmp_path, "chain", gone)
    parent.send_signal(signal.SIGTERM)
    code, out = _finish_parent(parent)
    assert code == 7
    assert "previous handler ran" in out
    assert gone(child)


def test_kill_is_sigkill_with_no_sigterm_first(tmp_path, gone):
    # A child whose SIGTERM handler leaves a mark: kill() must never give it that chance.
    mark, ready = tmp_path / "got-sigterm", tmp_path / "ready"
    script = (
        "import pathlib, signal, time; "
        f"signal.signal(signal.SIGTERM, lambda *a: pathlib.Path({str(mark)!r}).touch()); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(600)"
    )
    proc = start_process([sys.executable, "-c", script], name="crash", log_path=tmp_path / "c.log")
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    assert proc.kill() == -signal.SIGKILL
    assert gone(proc.pid, timeout=0) and not proc.alive
    time.sleep(0.2)
    assert not mark.exists()
    assert proc.kill() == -signal.SIGKILL and proc.stop() == -signal.SIGKILL  # idempotent


_ORPHANS = textwrap.dedent(
    """
    import json, subprocess, sys, time
    from turnrl.npu_runtime import supervise

    adopted = supervise.adopt_orphans() if sys.argv[1] == "adopt" else False
    # sh starts a daemon and exits at once: the daemon is orphaned
    out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    daemon = int(out.stdout)
    time.sleep(0.2)
    seen = daemon in supervise.descendants()
    left = supervise.kill_descendants(grace=1.0) if adopted else []
    print(json.dumps({"adopted": adopted, "daemon": daemon, "seen": seen, "left": left,
                      "after": supervise.descendants()}))
    """
)


def _run_orphans(mode: str) -> dict:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _ORPHANS, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="child subreapers are Linux")
def test_an_orphaned_daemon_is_adopted_found_and_killed():
    result = _run_orphans("adopt")
    assert result["adopted"] and result["seen"]
    assert result["left"] == [result["daemon"]] and result["after"] == []
    with pytest.raises(ProcessLookupError):
        os.kill(result["daemon"], 0)


@pytest.mark.skipif(sys.platform != "linux", reason="child subreapers are Linux")
def test_without_adoption_an_orphan_escapes_the_tree():
    """The case adopt_orphans exists for: the daemon is reparented away from its starter."""
    result = _run_orphans("plain")
    try:
        assert not result["seen"]
    finally:
        os.kill(result["daemon"], signal.SIGKILL)


def _contained(script: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "turnrl.npu_runtime.supervise", "--", "sh", "-c", script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(sys.platform != "linux", reason="child subreapers are Linux")
def test_run_contained_names_and_kills_what_a_command_left_running():
    assert _contained("exit 0").returncode == 0
    assert _contained("exit 5").returncode == 5
    leaky = _contained("sleep 300 >/dev/null 2>&1 & exit 0")
    assert leaky.returncode == 3
    assert "1 process(es) left running" in leaky.stderr and "sleep 300" in leaky.stderr
    pid = int(leaky.stderr.split("left running: ")[1].split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_leftover_server_is_named_with_the_port_it_listens_on():
    port = free_port()
    server = f"{sys.executable} -m http.server --bind 127.0.0.1 {port}"
    wait = (  # until the server accepts connections
        "import socket, time; [time.sleep(0.1) for _ in iter(lambda: "
        f"socket.socket().connect_ex(('127.0.0.1', {port})) != 0, False)]"
    )
    leaky = _contained(f'{server} >/dev/null 2>&1 & {sys.executable} -c "{wait}"; exit 0')
    assert leaky.returncode == 3
    assert f"http.server --bind 127.0.0.1 {port} (listening on {port})" in leaky.stderr


def test_leftovers_waits_for_what_ends_on_its_own():
    """A child that ends within the grace is not a leftover; one that outlives it is."""
    before = set(supervise.descendants())
    short = subprocess.Popen(["sleep", "0.5"])
    long = subprocess.Popen(["sleep", "30"])
    try:
        assert set(supervise.leftovers(grace=3.0)) - before == {long.pid}
        assert short.poll() == 0
    finally:
        long.kill()
        long.wait()
    assert set(supervise.leftovers()) - before == set()


def test_descendants_are_in_tree_order_not_pid_order():
    """A child's own child comes right after it, before a sibling started earlier than the
    grandchild: pids wrap around, so a later process can have a smaller pid (as a restarted
    engine did in CI, taken for the app it was listed before)."""
    spawner = (
        "import subprocess, sys, time; sys.stdin.readline(); "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    a = subprocess.Popen(
        [sys.executable, "-c", spawner], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    grandchild = None
    try:
        assert a.stdin is not None and a.stdout is not None
        a.stdin.write("\n")
        a.stdin.flush()  # the grandchild starts after b
        grandchild = int(a.stdout.readline())
        ours = {a.pid, grandchild, b.pid}
        assert [p for p in supervise.descendants() if p in ours] == [a.pid, grandchild, b.pid]
    finally:
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)
        for proc in (a, b):
            proc.kill()
            proc.wait()
