"""Fork-server internals that the end-to-end sandbox tests reach only by a race."""

from __future__ import annotations

import json
import os
import selectors
import time

import pytest

from turnrl.tool_envs.sandbox import child, forkserver, limits
from turnrl.tool_envs.sandbox.embedded import can_contain


def test_finish_survives_a_pipe_that_reaches_eof_at_finish_time() -> None:
    """Regression: the writer of a run's pipe exits between ``select`` and ``_finish``.

    ``_finish``'s last read then meets EOF and closes the pipe itself; closing it a second
    time raised ``KeyError('<fd> is not registered')``, which killed the whole fork server
    (every later code run answered "fork server 0 is not running"). Seen once in a 30-step
    ReTool run under heavy load; reproduced here deterministically.
    """
    server = forkserver.ForkServer.__new__(forkserver.ForkServer)  # no control socket
    server.selector = selectors.DefaultSelector()
    server.stopping = True  # replies are dropped
    server.free_uids, server.exiting = [], {}
    read_end, write_end = os.pipe()
    os.close(write_end)  # the writer has just exited: the next read is EOF
    now = time.monotonic()
    run = forkserver._Run(
        request={"id": 1},
        slot=0,
        uid=7,
        rundir=os.devnull + "-missing",
        pid=999_999,
        pidfd=-1,
        started=now,
        deadline=now + 5,
        pipes={read_end: "stdout"},
        status=0,
    )
    server.runs = {run.pid: run}
    server.selector.register(read_end, selectors.EVENT_READ, ("pipe", run))

    server._finish(run)

    assert run.pipes == {} and server.runs == {}
    assert run.replied and server.free_uids == [7]  # cleaned up, its uid free again
    assert read_end not in server.selector.get_map()


_UNUSED_UID = 1_999_999  # below every server's run uids: no process runs as it


@pytest.mark.skipif(not can_contain(), reason="needs root and PID namespaces")
def test_a_run_that_left_no_process_behind_reports_its_end() -> None:
    """Regression: killing the run's leftovers meets ESRCH when there are none (the usual
    case); that error skipped the report, so every answer waited for the slow exit.

    As in a real run, the reporting process is PID 1 of its own PID namespace and has
    dropped root for an unused uid, so ``kill(-1)`` finds no process to signal.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            limits.unshare(limits.CLONE_NEWPID)
            run = os.fork()
            if run == 0:
                try:
                    os.dup2(write_end, child._STATUS_FD)
                    os.setresgid(_UNUSED_UID, _UNUSED_UID, _UNUSED_UID)
                    os.setresuid(_UNUSED_UID, _UNUSED_UID, _UNUSED_UID)
                    if os.getuid() == _UNUSED_UID:  # never kill(-1) as root
                        child._report_end(7, dropped_uid=True)
                finally:
                    os._exit(0)
            os.waitpid(run, 0)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        report = json.loads(f.read() or b"null")
    os.waitpid(pid, 0)
    assert report is not None and report["code"] == 7 and isinstance(report["cpu"], float)
