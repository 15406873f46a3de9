"""Weight sync from the trainer to inference engines through disk (the CPU path).

Each sync exports the trainer's weights as a Hugging Face folder ``<root>/v<version>``
(safetensors + config + tokenizer, replaced atomically by the exporter), asks every engine
to ``reload_weights`` from it with that version, then reads the version back from each
engine to confirm it serves the new weights. Older version folders are removed once no
engine uses them. An engine that cannot be reached at a sync (dead, or silent past its
``reload_timeout``) leaves the run: the sync goes on with the others and reports it to
``on_engine_lost`` (the apps' router then stops routing to it, so it can never serve an
older version). When no engine is left, the sync hands the unreachable ones to
``restore`` (which starts them again in place and waits for them) and reloads those it
returns; with none back, the sync fails. An engine started again in the background
comes back through :meth:`DiskWeightSync.rejoin`: the next sync reloads it too and, once
it confirms the version, reports it to ``on_engine_back``. The GPU path, vLLM's collective weight transfer in buckets, is
:class:`~turnrl.grpo_core.weight_sync.collective.CollectiveWeightSync`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import EngineUnavailableError

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """An engine did not confirm the weight version it was sent."""


class WeightSync(Protocol):
    """Pushes the trainer's current weights to the inference engines."""

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        """Publish the weights as ``version``; return timing metrics (seconds)."""
        ...


RELOAD_TIMEOUT_S = 600.0
"""How long an engine may take to reload a version before it counts as unreachable."""


async def reload_engine(
    url: str, folder: str | Path, version: str, timeout: float = RELOAD_TIMEOUT_S
) -> None:
    """The engine at ``url`` reloads its weights from ``folder`` as ``version`` and is asked
    which version it serves.

    Raises:
        EngineUnavailableError: it could not be reached, or did not answer the reload
            within ``timeout`` seconds (a hung engine).
        WeightSyncError: it reports another version after the reload.
    """
    async with EngineClient(url) as client:
        await client.reload_weights(folder, weight_version=version, timeout=timeout)
        served = await client.weight_version()
    if served != version:
        raise WeightSyncError(f"engine {url} serves weight version {served!r}, sent {version}")


async def reload_engines(
    urls: Sequence[str], folder: str | Path, version: str, timeout: float = RELOAD_TIMEOUT_S
) -> None:
    """:func:`reload_engine` on every engine at ``urls``, all at once; raises the first
    engine's error once all have answered."""
    results = await asyncio.gather(
        *(reload_engine(url, folder, version, timeout) for url in urls), return_exceptions=True
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result


class DiskWeightSync:
    """Export to ``root/v<version>``, reload on every engine at once, confirm the version.

    Args:
        engine_urls: Base URLs of the engines to update.
        root: Folder for the exported versions.
        keep_last: Version folders to keep on disk (the newest ones).
        on_engine_lost: Awaited with the URL of each engine that could not be reached at a
            sync (it is no longer synced; see the module).
        on_engine_back: Awaited with the URL of each engine that rejoined (:meth:`rejoin`)
            once it serves the version of a sync.
        reload_timeout: Seconds an engine may take to reload a version; past them it is
            taken as hung and leaves the run like an unreachable one.
        restore: Awaited, when no engine could be reached at a sync, with their URLs;
            returns those it started again in place, which get the version at once (they
            never left the run). None: such a sync fails.
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        root: str | Path,
        keep_last: int = 1,
        on_engine_lost: Callable[[str], Awaitable[None]] | None = None,
        on_engine_back: Callable[[str], Awaitable[None]] | None = None,
        reload_timeout: float = RELOAD_TIMEOUT_S,
        restore: Callable[[list[str]], Awaitable[list[str]]] | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError("DiskWeightSync needs at least one engine url")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if reload_timeout <= 0:
            raise ValueError(f"reload_timeout must be > 0, got {reload_timeout}")
        self.reload_timeout = reload_timeout
        """Seconds an engine may take to reload a version (see the arguments)."""
        self.engine_urls = list(engine_urls)
        self.root = Path(root)
        self.keep_last = keep_last
        self.versions: list[int] = []
        """Versions exported so far, oldest first."""
        self.on_engine_lost = on_engine_lost
        """Awaited with each engine URL that left the run (see the module)."""
        self.on_engine_back = on_engine_back
        """Awaited with each engine URL that rejoined the run (see :meth:`rejoin`)."""
        self.restore = restore
        """Starts the engines again when none could be reached (see the arguments)."""
        self.lost: list[str] = []
        """Engines that left the run, in the order they were lost."""
        self.joining: list[str] = []
        """Engines started again that the next sync brings back (:meth:`rejoin`)."""

    async def _reload(self, urls: Sequence[str], folder: Path, version: int) -> list[str]:
        """Reload ``urls`` from ``folder`` as ``version``, all at once (a sync costs the
        slowest one); returns those that could not be reached."""
        results = await asyncio.gather(
            *(reload_engine(url, folder, str(version), self.reload_timeout) for url in urls),
            return_exceptions=True,
        )
        lost = []
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, EngineUnavailableError):
                lost.append(url)
                logger.warning(
                    "engine %s could not be reached to load weight version %d: %s",
                    url,
                    version,
                    result,
                )
            elif isinstance(result, BaseException):
                raise result
        return lost

    async def reload_last(self, urls: Sequence[str], policy: str | Path) -> list[str]:
        """Give ``urls`` (engines started again) the weights the run last synced, or
        ``policy`` as version 0 before any sync; returns those that could not be reached."""
        if self.versions:
            return await self._reload(urls, self.root / f"v{self.versions[-1]}", self.versions[-1])
        return await self._reload(urls, Path(policy), 0)

    def rejoin(self, url: str) -> None:
        """Bring an engine that left the run back at the next sync (it was started again)."""
        if url not in self.engine_urls and url not in self.joining:
            self.joining.append(url)

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        """Export ``trainer`` (anything with ``export_hf(folder)``) and reload every engine.

        Raises:
            WeightSyncError: an engine reports another version after the reload, or no
                engine could be reached (nor restored).
        """
        if self.versions and version <= self.versions[-1]:
            raise ValueError(f"weight versions must increase: {version} after {self.versions[-1]}")
        start = time.perf_counter()
        folder = self.root / f"v{version}"
        trainer.export_hf(folder)
        exported = time.perf_counter()
        joining, self.joining = self.joining, []
        urls = [*self.engine_urls, *joining]
        lost = await self._reload(urls, folder, version)
        back = [u for u in joining if u not in lost]
        live = [u for u in self.engine_urls if u not in lost] + back
        if not live and self.restore is not None:  # the run needs an engine: wait for one
            again = await self.restore(list(lost))
            failed = await self._reload(again, folder, version)
            live = [u for u in again if u not in failed]
            back = [u for u in live if u in joining]  # had left the run before this sync
            lost = [u for u in lost if u not in live]
        if not live:
            raise WeightSyncError(
                f"no engine took weight version {version}: all {len(lost)} unreachable "
                f"({', '.join(lost)}); see the engine logs"
            )
        self.engine_urls = live
        self.lost += lost
        for url in lost:
            if self.on_engine_lost is not None:
                await self.on_engine_lost(url)
        for url in back:
            if self.on_engine_back is not None:
                await self.on_engine_back(url)
        done = time.perf_counter()
        self.versions.append(version)
        for old in self.versions[: -self.keep_last]:
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)
        self.versions = self.versions[-self.keep_last :]
        return {
            "export_s": exported - start,
            "reload_s": done - exported,
            "total_s": done - start,
            "engines": float(len(self.engine_urls)),
        }
