"""ScoringPool: hard per-call timeouts by killing workers, replacement, crashes, no leftovers.

These start real worker processes (fresh interpreters importing sympy and math-verify,
about a second each on this machine); nothing is mocked.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time

import pytest

from turnrl.rewards import (
    PoolConfig,
    ScoringPool,
    WorkerCrashed,
    WorkerError,
    WorkerTimeout,
    symbolic_equal,
)

LIGHT = PoolConfig(num_workers=1, preload=(), warmup=())  # no sympy import: starts in a blink
MATH = PoolConfig(num_workers=3, warmup=())  # sympy and math-verify imported, not warmed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


async def test_a_worker_that_cannot_start_is_a_clear_error():
    pool = ScoringPool(PoolConfig(num_workers=1, preload=(), warmup=("os:abort",)))
    with pytest.raises(WorkerCrashed, match="failed to start"):
        await pool.start()
    await pool.close()


async def test_close_during_a_batch_ends_every_call():
    pool = ScoringPool(LIGHT)
    await pool.start()
    calls = [asyncio.create_task(pool.run(time.sleep, 30, timeout_s=60)) for _ in range(3)]
    await asyncio.sleep(0.2)  # one call runs, two wait for the single worker
    await pool.close()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert sorted(type(o).__name__ for o in outcomes) == [
        "RuntimeError",
        "RuntimeError",
        "WorkerCrashed",
    ]


async def test_unpicklable_call_fails_before_reaching_a_worker():
    async with ScoringPool(LIGHT) as pool:
        with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
            await pool.run(lambda: 1, timeout_s=5)
        assert pool.num_replaced == 0
        assert await pool.run(abs, -1, timeout_s=5) == 1


def test_pool_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_workers"):
        PoolConfig(num_workers=0)
    with pytest.raises(ValueError, match="memory_limit_mb"):
        PoolConfig(memory_limit_mb=10)
    with pytest.raises(ValueError, match="startup_timeout_s"):
        PoolConfig(startup_timeout_s=0)


async def test_hung_call_is_killed_and_its_worker_replaced():
    async with ScoringPool(LIGHT) as pool:
        first_pid = await pool.run(os.getpid, timeout_s=5)
        start = time.monotonic()
        with pytest.raises(WorkerTimeout):
            await pool.run(time.sleep, 60, timeout_s=0.5)
        assert time.monotonic() - start < 3
        assert pool.num_replaced == 1
        new_pid = await pool.run(os.getpid, timeout_s=30)  # waits for the replacement
        assert new_pid != first_pid
        for _ in range(50):
            if not _alive(first_pid):
                break
            await asyncio.sleep(0.05)
        assert not _alive(first_pid)


async def test_event_loop_keeps_running_while_a_call_hangs():
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    async with ScoringPool(LIGHT) as pool:
        task = asyncio.create_task(ticker())
        with pytest.raises(WorkerTimeout):
            await pool.run(time.sleep, 30, timeout_s=1.0)
        task.cancel()
    assert ticks > 30  # ~100 expected in one second; a blocked loop would give 1


async def test_crash_and_error_are_reported_and_the_pool_recovers():
    async with ScoringPool(LIGHT) as pool:
        with pytest.raises(WorkerError, match="ValueError"):
            await pool.run(int, "not a number", timeout_s=5)
        assert pool.num_replaced == 0  # an exception in the function keeps the worker
        with pytest.raises(WorkerCrashed):
            await pool.run(os._exit, 3, timeout_s=5)
        assert pool.num_replaced == 1
        assert await pool.run(abs, -4, timeout_s=30) == 4


async def test_close_leaves_no_process_and_refuses_new_calls():
    pool = ScoringPool(PoolConfig(num_workers=2, preload=(), warmup=()))
    await pool.start()
    pids = {await pool.run(os.getpid, timeout_s=5) for _ in range(4)}
    await pool.close()
    assert pids and not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(os.getpid, timeout_s=5)


ADVERSARIAL = [
    ("9^{9^{9^{9}}}", "1"),  # exponent tower: sympy evaluates the integer power in C
    ("(" * 400 + "1" + ")" * 400, "1"),  # deep nesting
    ("\\frac{" * 200 + "1" + "}{2}" * 200, "1"),
]


async def test_adversarial_math_is_bounded_by_the_timeout():
    """Each adversarial item, run at once on its own worker, returns within its timeout."""
    timeout_s = 1.5

    async def bounded(pred: str, truth: str) -> tuple[object, float]:
        start = time.monotonic()
        try:
            result: object = await pool.run(symbolic_equal, pred, truth, 6, timeout_s=timeout_s)
        except (WorkerTimeout, WorkerCrashed, WorkerError) as error:
            result = error
        return result, time.monotonic() - start

    async with ScoringPool(MATH) as pool:
        outcomes = await asyncio.gather(*(bounded(p, t) for p, t in ADVERSARIAL))
        for result, elapsed in outcomes:
            assert elapsed < timeout_s + 1.0, elapsed
            assert result is False or isinstance(result, Exception)  # never "equal"
        assert any(isinstance(result, WorkerTimeout) for result, _ in outcomes)
        # The pool still scores afterwards (on a replacement worker if all were killed).
        assert await pool.run(symbolic_equal, "2\\sqrt{2}", "\\sqrt{8}", 6, timeout_s=60) is True
