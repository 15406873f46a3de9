"""Hostile code: each run is contained with a clear status, the server keeps serving, and no
process of a sandbox uid is left once the response is back."""

from __future__ import annotations

import os
import threading
import time

import pytest
import requests

from turnrl.tool_envs.sandbox.embedded import (
    TEST_SERVER_ARGS,
    shared_sandbox,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux only")


@pytest.fixture(scope="module")
def sandbox():
    """One server for all sandbox test modules (started once, stopped at exit)."""
    return shared_sandbox(*TEST_SERVER_ARGS)


@pytest.fixture
def isolation(sandbox):
    return sandbox.ping()["isolation"][0]


def run(sandbox, code, language="python", **extra):
    body = {"code": code, "language": language, **extra}
    answer = requests.post(f"{sandbox.url}/run_code", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.fixture(autouse=True)
def _server_survives_and_nothing_is_left(sandbox):
    yield
    assert run(sandbox, "print('still serving')")["run_result"]["stdout"] == "still serving\n"
    deadline = time.monotonic() + 2.0
    while sandbox.processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox.processes() == []


def test_infinite_loop_hits_the_time_limit(sandbox):
    start = time.monotonic()
    body = run(sandbox, "while True:\n    pass", run_timeout=1)
    assert time.monotonic() - start < 5
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "TimeLimitExceeded"
    assert "time limit" in body["message"]


def test_bash_sleep_hits_the_time_limit(sandbox):
    body = run(sandbox, "echo before; sleep 30", language="bash", run_timeout=0.5)
    assert body["run_result"]["status"] == "TimeLimitExceeded"
    assert body["run_result"]["stdout"] == "before\n"  # output before the kill is kept


def test_fork_bomb_is_capped_by_the_process_limit(sandbox, isolation):
    if not isolation["setuid"]:
        pytest.skip("the per-run process limit needs root (a uid per run slot)")
    code = (
        "import os\nn = 0\nerr = None\n"
        "for _ in range(1000):\n"
        "    try:\n        pid = os.fork()\n    except OSError as e:\n        err = e\n        break\n"
        "    if pid == 0:\n        import time\n        time.sleep(60)\n        os._exit(0)\n"
        "    n += 1\n"
        "print(n, type(err).__name__)"
    )
    body = run(sandbox, code, run_timeout=5)
    n, err = body["run_result"]["stdout"].split()
    assert int(n) < 32 and err == "BlockingIOError"  # EAGAIN from RLIMIT_NPROC
    assert body["run_result"]["status"] == "Finished"


def test_bash_fork_bomb_is_killed(sandbox):
    body = run(sandbox, ":(){ :|:& };:", language="bash", run_timeout=2)
    assert body["run_result"]["status"] in ("Finished", "TimeLimitExceeded")


def test_memory_hog_gets_memory_error(sandbox):
    body = run(sandbox, "x = bytearray(2 << 30)\nprint('allocated')", memory_limit_MB=256)
    assert body["status"] == "Failed"
    assert "MemoryError" in body["run_result"]["stderr"]
    assert body["run_result"]["stdout"] == ""


def test_memory_limit_leaves_room_for_normal_work(sandbox):
    body = run(sandbox, "import numpy as np\nprint(np.ones(4_000_000).sum())", memory_limit_MB=256)
    assert body["run_result"]["stdout"] == "4000000.0\n", body


def test_ten_megabytes_of_stdout_are_truncated_with_a_flag(sandbox):
    start = time.monotonic()
    body = run(
        sandbox, "import sys\nsys.stdout.write('x' * (10 << 20))\nprint('end', file=sys.stderr)"
    )
    assert time.monotonic() - start < 10
    result = body["run_result"]
    assert result["return_code"] == 0  # the writer never blocked
    assert result["stdout_truncated"] is True
    assert len(result["stdout"]) == 65536
    assert result["stderr"] == "end\n"
    assert "stdout truncated to 65536 bytes" in body["message"]


def test_background_process_does_not_outlive_the_run(sandbox):
    body = run(sandbox, "(sleep 1000 &) ; echo started", language="bash")
    assert body["run_result"]["stdout"] == "started\n"


def test_python_daemon_double_fork_does_not_outlive_the_run(sandbox):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.close(1); os.close(2)\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "print('parent done')"
    )
    assert run(sandbox, code)["run_result"]["stdout"] == "parent done\n"


def test_network_is_unreachable(sandbox, isolation):
    if not isolation["net_namespace"]:
        pytest.skip("network namespaces are not available here")
    port = sandbox.url.rsplit(":", 1)[1]
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', '1.1.1.1'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=2)\n"
        "        print(host, 'connected')\n"
        "    except OSError as e:\n"
        "        print(host, 'blocked', type(e).__name__)"
    )
    out = run(sandbox, code)["run_result"]["stdout"]
    assert out.count("blocked") == 2, out


def test_writes_outside_the_run_directory_fail(sandbox, isolation):
    if not isolation["setuid"]:
        pytest.skip("confining writes needs root (an unprivileged uid per run)")
    code = (
        "import os\n"
        "for path in ('/tmp/turnrl-escape', '/etc/turnrl-escape', '../escape', os.path.expanduser('~/../x')):\n"
        "    try:\n        open(path, 'w').write('x')\n        print(path, 'written')\n"
        "    except OSError as e:\n        print(path, type(e).__name__)\n"
        "open('inside.txt', 'w').write('ok')\nprint('inside ok')"
    )
    out = run(sandbox, code)["run_result"]["stdout"]
    assert "written" not in out, out
    assert "inside ok" in out
    assert not os.path.exists("/tmp/turnrl-escape") and not os.path.exists("/etc/turnrl-escape")


def test_file_size_limit(sandbox):
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (65 << 20))"
    body = run(sandbox, code)
    assert body["status"] == "Failed"  # SIGXFSZ or EFBIG, never a 65 MB file


def test_killing_its_own_parent_hurts_only_itself(sandbox):
    code = "import os, signal\nprint('ppid', os.getppid(), flush=True)\nos.kill(os.getppid(), signal.SIGKILL)\nprint('after')"
    body = run(sandbox, code)
    assert body["run_result"]["stdout"].startswith("ppid")


def test_killing_every_process_it_can_reach(sandbox):
    body = run(sandbox, "import os, signal\nos.kill(-1, signal.SIGKILL)", run_timeout=2)
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] in ("Finished", "TimeLimitExceeded")


def test_cpu_time_limit_covers_busy_threads(sandbox):
    code = (
        "import threading\n"
        "def spin():\n    while True: pass\n"
        "for _ in range(4): threading.Thread(target=spin, daemon=True).start()\n"
        "spin()"
    )
    body = run(sandbox, code, run_timeout=1)
    assert body["run_result"]["status"] == "TimeLimitExceeded"


def test_leftover_check_sees_a_live_run(sandbox, isolation):
    """The autouse leftover check can fail: it does see a run's processes while they live."""
    if not isolation["setuid"]:
        pytest.skip("runs are told apart by uid only when the server is root")
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (run(sandbox, "sleep 1 & sleep 1; wait", language="bash"), done.set())
    )
    thread.start()
    seen = 0
    while not done.is_set() and not seen:
        seen = len(sandbox.processes())
        time.sleep(0.02)
    thread.join()
    assert seen >= 1


def test_every_run_has_a_process_of_its_own(sandbox):
    """Children are forked ahead of demand, but none ever serves a second run: state a run
    leaves in its interpreter (globals, builtins, modules) is gone for the next one."""
    code = (
        "import builtins, os, sys\n"
        "print(os.readlink('/proc/self'), hasattr(builtins, 'left_behind'), 'json' in sys.argv)\n"
        "builtins.left_behind = 1\n"
        "sys.argv.append('json')"
    )
    outs = [run(sandbox, code)["run_result"]["stdout"].split() for _ in range(4)]
    assert len({pid for pid, *_ in outs}) == 4, outs
    assert all(rest == ["False", "False"] for _, *rest in outs), outs


def test_a_run_cannot_find_a_concurrent_runs_code_or_output(sandbox):
    """The fork server holds every run's request and output; a child drops its copies right
    after the fork, so no Python object of another run is reachable from user code."""
    slow = "import time\nprint('OUTPUT-4711', flush=True)\nx = 'SECRET-4711'\ntime.sleep(2)"
    thread = threading.Thread(target=run, args=(sandbox, slow))
    thread.start()
    time.sleep(0.8)  # the slow run is under way (its output already read by the server)
    probe = (
        "import gc\n"
        "marks = ('SECRET' + '-4711', 'OUTPUT' + '-4711')\n"
        "def has(v):\n"
        "    v = v.decode(errors='replace') if isinstance(v, (bytes, bytearray)) else v\n"
        "    return isinstance(v, str) and any(m in v for m in marks)\n"
        "found = [o for o in gc.get_objects() if isinstance(o, dict) and any(map(has, o.values()))]\n"
        "found += [o for o in gc.get_objects() if isinstance(o, list) and any(map(has, o))]\n"
        "print(len(found))"
    )
    assert run(sandbox, probe)["run_result"]["stdout"] == "0\n"
    thread.join()


def test_a_ready_child_killed_from_outside_is_replaced(sandbox, isolation):
    """The child waiting for the next run dies (OOM killer, an operator): the next run is
    handed to a fresh child instead of failing."""
    if not isolation["setuid"]:
        pytest.skip("the waiting child is told apart from runs by its uid (root) only as root")
    assert run(sandbox, "print(1)")["run_result"]["stdout"] == "1\n"
    forkserver = isolation["pid"]
    deadline = time.monotonic() + 5
    ready = []
    while not ready and time.monotonic() < deadline:
        with open(f"/proc/{forkserver}/task/{forkserver}/children") as f:
            children = [int(pid) for pid in f.read().split()]
        ready = [pid for pid in children if _uid_of(pid) == 0]
        time.sleep(0.02)
    assert len(ready) == 1
    os.kill(ready[0], 9)
    for _ in range(3):
        assert run(sandbox, "print(2)")["run_result"]["stdout"] == "2\n"


def _uid_of(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None
