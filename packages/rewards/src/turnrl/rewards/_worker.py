"""Scoring worker process: `python -m turnrl.rewards._worker RFD WFD MB MODULES WARMUPS`.

Started by `pool.ScoringPool` as a fresh interpreter (not through multiprocessing, so the
caller's `__main__` is never re-imported and no `if __name__ == "__main__"` guard is needed).
MODULES are imported and WARMUPS (`module:function`, comma-separated) called before it
says ready. It reads `(function, args)` calls pickled on file descriptor RFD and writes
`("ok", result)` or `("error", traceback)` on WFD, one call at a time, until RFD closes.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import traceback
from multiprocessing.connection import Connection


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def serve(reader: Connection, writer: Connection) -> None:
    """Answer calls until the parent closes the pipe."""
    while True:
        try:
            fn, args = reader.recv()
        except (EOFError, OSError):
            return
        try:
            result = ("ok", fn(*args))
        except BaseException:  # report everything (MemoryError, RecursionError) and go on
            result = ("error", traceback.format_exc(limit=4))
        writer.send(result)


def main(argv: list[str]) -> None:
    read_fd, write_fd, memory_mb = int(argv[0]), int(argv[1]), int(argv[2])
    modules, warmups = argv[3], argv[4]
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    _limit_memory(memory_mb)
    reader, writer = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    for name in filter(None, modules.split(",")):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for target in filter(None, warmups.split(",")):
        module_name, _, function_name = target.partition(":")
        getattr(importlib.import_module(module_name), function_name)()
    writer.send(("ready", None))
    serve(reader, writer)


if __name__ == "__main__":
    main(sys.argv[1:])
