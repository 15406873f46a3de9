"""Fork-server internals that the end-to-end sandbox tests reach only by a race."""

from __future__ import annotations

import os
import selectors
import time

from turnrl.tool_envs.sandbox import forkserver


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
