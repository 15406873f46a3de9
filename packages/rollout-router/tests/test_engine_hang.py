"""An engine that hangs (SIGSTOP of a real engine process) costs a bounded wait, never a hung
rollout: requests it has not answered re-run on another engine; one it was streaming fails at
once with the tokens it had produced (the episode is then an infrastructure failure)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import PartialGenerationError, SamplingParams
from turnrl.rollout_router.router import Router, RouterConfig
from turnrl.rollout_router.testing import fake_engine_processes

READ_TIMEOUT = 1.0

StartEngine = Callable[..., tuple[subprocess.Popen[bytes], str]]


@pytest.fixture
def start_engine() -> Iterator[StartEngine]:
    """Fake engines as their own processes, killed at the end of the test."""
    with contextlib.ExitStack() as stack:

        def start(token_delay: float = 0.0) -> tuple[subprocess.Popen[bytes], str]:
            return stack.enter_context(fake_engine_processes(1, token_delay))[0]

        yield start


async def _healthy(*urls: str) -> None:
    deadline = time.monotonic() + 30
    for url in urls:
        async with EngineClient(url) as client:
            while not await client.health(timeout=1.0):
                assert time.monotonic() < deadline, f"{url} never became healthy"
                await asyncio.sleep(0.1)


def _client(url: str) -> EngineClient:
    return EngineClient(url, connect_timeout=1.0, read_timeout=READ_TIMEOUT)


async def test_requests_to_a_stopped_engine_rerun_on_another(start_engine: StartEngine) -> None:
    stopped, url_a = start_engine()
    _, url_b = start_engine()
    await _healthy(url_a, url_b)
    os.kill(stopped.pid, signal.SIGSTOP)  # accepts connections (the kernel does), answers nothing
    config = RouterConfig(
        health_interval=0.2, health_timeout=0.5, failure_threshold=1, read_timeout=READ_TIMEOUT
    )
    async with Router([url_a, url_b], config) as router:  # its clients take read_timeout
        began = time.monotonic()
        gens = await asyncio.wait_for(
            asyncio.gather(
                *(router.generate([1, 2], SamplingParams(max_tokens=4), f"s{i}") for i in range(8))
            ),
            timeout=30,
        )
        seconds = time.monotonic() - began
        assert [g.token_ids for g in gens] == [[3, 4, 5, 6]] * 8  # every request completed
        assert {g.engine for g in gens} == {url_b}
        assert seconds < 3 * READ_TIMEOUT + 5, seconds  # at most one read timeout per request
        assert router.engine(url_a).circuit != "closed"  # taken out of rotation


async def test_a_stream_from_an_engine_that_stops_fails_with_its_tokens(
    start_engine: StartEngine,
) -> None:
    stopped, url = start_engine(token_delay=0.02)
    await _healthy(url)
    async with _client(url) as client:
        task = asyncio.create_task(
            client.generate([1, 2], SamplingParams(max_tokens=10_000), "long")
        )
        while sum(client.in_flight_tokens().values()) < 5:
            assert not task.done()
            await asyncio.sleep(0.01)
        os.kill(stopped.pid, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(PartialGenerationError) as failed:
            await asyncio.wait_for(task, timeout=30)
        assert time.monotonic() - began < READ_TIMEOUT + 5
    partial = failed.value.partial
    assert partial is not None and len(partial.token_ids) >= 5
    assert len(partial.logprobs) == len(partial.token_ids)
    assert partial.token_ids == list(range(3, 3 + len(partial.token_ids)))  # nothing garbled
