"""Shared fixtures: fake engines on loopback (see turnrl.rollout_router.testing)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from turnrl.rollout_router.testing import FakeEngine


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    """Start fake engines on demand; all are stopped at the end of the test."""
    started: list[FakeEngine] = []

    async def make(**kwargs: object) -> FakeEngine:
        engine = await FakeEngine(**kwargs).start()  # type: ignore[arg-type]
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.kill()
