"""A process pool whose hung workers are killed and replaced, driven from asyncio.

Each worker is a separate Python process serving one call at a time over a pipe. The
parent waits for the answer with the event loop's reader callback (no thread blocks, the
loop keeps running), and when an item overruns its timeout the worker is sent SIGKILL and a
fresh one is started in the background — so a sympy computation stuck in C code (an
exponent tower, a deep nesting) costs its timeout and nothing more, unlike `signal.alarm`
timeouts, which only fire in a main thread and only between Python bytecodes.

Workers are fresh interpreters (`python -m turnrl.rewards._worker`), not multiprocessing
children: the caller's `__main__` is never re-imported, threads in the parent do not
matter, and on Linux a worker is killed if the parent dies. Functions sent to workers must
be importable by module name (module-level functions of installed packages or the stdlib).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class WorkerTimeout(TimeoutError):
    """A call ran past its timeout; its worker was killed and replaced."""


class WorkerCrashed(RuntimeError):
    """A worker died during a call (killed by the OS, out of memory, a segfault)."""


class WorkerError(RuntimeError):
    """The called function raised inside the worker; the message holds its traceback."""


@dataclass(frozen=True)
class PoolConfig:
    """How many workers run and how they start."""

    num_workers: int = max(1, min(4, os.cpu_count() or 1))
    """Worker processes, i.e. calls running at once."""
    preload: tuple[str, ...] = ("turnrl.rewards.math_reward", "math_verify", "sympy")
    """Modules each worker imports before it takes work, so no call pays for imports."""
    warmup: tuple[str, ...] = ("turnrl.rewards.math_reward:warm_up",)
    """`module:function` callables each worker runs once before it takes work (parsers and
    caches warmed, so the first items do not pay for them)."""
    startup_timeout_s: float = 120.0
    """Longest wait for a new worker to finish its imports."""
    memory_limit_mb: int | None = 4096
    """Address-space limit per worker (RLIMIT_AS); a runaway computation fails with
    MemoryError instead of exhausting the machine. None: no limit."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.memory_limit_mb is not None and self.memory_limit_mb < 256:
            raise ValueError(f"memory_limit_mb must be >= 256 or None, got {self.memory_limit_mb}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")


_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding `turnrl/`


class _Worker:
    """One worker interpreter and the two pipe ends the parent uses to talk to it."""

    def __init__(self, config: PoolConfig) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SOURCE_ROOT, env.get("PYTHONPATH")]))
        command = [
            sys.executable,
            "-m",
            "turnrl.rewards._worker",
            str(to_child_r),
            str(from_child_w),
            str(config.memory_limit_mb or 0),
            ",".join(config.preload),
            ",".join(config.warmup),
        ]
        try:
            self.process = subprocess.Popen(
                command, pass_fds=(to_child_r, from_child_w), env=env, stdin=subprocess.DEVNULL
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.sender = Connection(to_child_w, readable=False)
        self.receiver = Connection(from_child_r, writable=False)

    async def receive(self, timeout_s: float) -> tuple[str, Any]:
        """The worker's next message; raises TimeoutError, or EOFError if it died."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.receiver.fileno()

        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(fd, on_readable)
        try:
            await asyncio.wait_for(readable, timeout_s)
        finally:
            loop.remove_reader(fd)
        message: tuple[str, Any] = self.receiver.recv()
        return message

    async def kill(self) -> None:
        """SIGKILL the worker (if still running), reap it and close the pipes."""
        if self.process.poll() is None:
            self.process.kill()
        await asyncio.to_thread(self.process.wait, 10)
        self.sender.close()
        self.receiver.close()


class ScoringPool:
    """Worker processes that run picklable functions with a hard per-call timeout.

    Use as `async with ScoringPool(PoolConfig(num_workers=2)) as pool:` and
    `await pool.run(fn, *args, timeout_s=5)`. A call that overruns kills its worker (a new
    one starts in the background); calls on other workers are not disturbed.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()  # None: pool broken
        self._workers: set[_Worker] = set()
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False
        self._started = False
        self._broken: str | None = None
        self.num_replaced = 0
        """Workers killed and replaced so far (timeouts and crashes)."""

    async def start(self) -> None:
        """Start every worker and wait until all have finished their imports."""
        if self._started:
            return
        self._started = True
        await asyncio.gather(*(self._add_worker() for _ in range(self.config.num_workers)))

    async def _add_worker(self) -> None:
        worker = await asyncio.to_thread(_Worker, self.config)
        self._workers.add(worker)
        try:
            kind, _ = await worker.receive(self.config.startup_timeout_s)
        except (TimeoutError, EOFError, OSError) as error:
            self._workers.discard(worker)
            await worker.kill()
            raise WorkerCrashed(f"worker failed to start: {error!r}") from error
        except asyncio.CancelledError:  # the pool closed while this worker was starting
            self._workers.discard(worker)
            await worker.kill()
            raise
        if kind != "ready":
            self._workers.discard(worker)
            await worker.kill()
            raise WorkerCrashed(f"worker sent {kind!r} instead of ready")
        if self._closed:
            self._workers.discard(worker)
            await worker.kill()
            return
        self._idle.put_nowait(worker)

    def _replace(self, worker: _Worker) -> None:
        if self._closed:  # close() kills every worker itself
            return
        self._workers.discard(worker)
        self.num_replaced += 1

        async def kill_and_restart() -> None:
            await worker.kill()
            if not self._closed:
                try:
                    await self._add_worker()
                except WorkerCrashed as error:
                    logger.exception("could not replace a scoring worker")
                    if not self._workers and len(self._starting) <= 1:
                        # No worker left and none coming: wake every waiting call.
                        self._broken = str(error)
                        self._idle.put_nowait(None)

        task = asyncio.create_task(kill_and_restart())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """Run `fn(*args)` in a worker and return its result.

        Args:
            fn: A module-level (picklable) function.
            *args: Its picklable arguments.
            timeout_s: Wall-clock limit from the moment a worker takes the call.

        Returns:
            What `fn` returned.

        Raises:
            WorkerTimeout: the call overran `timeout_s`; its worker was killed and replaced.
            WorkerCrashed: the worker died during the call (it was replaced), or no worker
                can be started any more.
            WorkerError: `fn` raised (the worker stays).
            RuntimeError: the pool is closed.
        """
        if self._closed:
            raise RuntimeError("ScoringPool is closed")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        request = pickle.dumps((fn, args))  # an unpicklable call fails here, not in a worker
        await self.start()
        worker = await self._idle.get()
        if worker is None:
            self._idle.put_nowait(None)  # pass the news on to the next waiting call
            if self._closed:
                raise RuntimeError("ScoringPool is closed")
            raise WorkerCrashed(f"no scoring worker could be started: {self._broken}")
        try:
            worker.sender.send_bytes(request)
            kind, payload = await worker.receive(timeout_s)
        except TimeoutError:
            self._replace(worker)
            raise WorkerTimeout(f"timed out after {timeout_s:g} s") from None
        except (EOFError, OSError) as error:
            self._replace(worker)
            raise WorkerCrashed(f"worker died: {error!r}") from None
        except BaseException:  # cancelled mid-call: the worker's state is unknown
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        if kind == "error":
            raise WorkerError(payload)
        return payload

    async def close(self) -> None:
        """Stop every worker (killed, joined) and any replacement still starting.

        Calls still waiting for a worker raise RuntimeError; calls running on a worker raise
        WorkerCrashed.
        """
        self._closed = True
        self._idle.put_nowait(None)  # wakes calls waiting for a worker
        for task in list(self._starting):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for worker in list(self._workers):
            await worker.kill()
        self._workers.clear()

    async def __aenter__(self) -> ScoringPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
