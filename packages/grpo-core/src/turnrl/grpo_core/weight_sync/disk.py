"""Weight sync from the trainer to inference engines through disk (the CPU path).

Each sync exports the trainer's weights as a Hugging Face folder ``<root>/v<version>``
(safetensors + config + tokenizer, replaced atomically by the exporter), asks every engine
to ``reload_weights`` from it with that version, then reads the version back from each
engine to confirm it serves the new weights. Older version folders are removed once no
engine uses them. The GPU path, vLLM's collective weight transfer in buckets, is
:class:`~turnrl.grpo_core.weight_sync.collective.CollectiveWeightSync`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from turnrl.rollout_router.client import EngineClient


class WeightSyncError(RuntimeError):
    """An engine did not confirm the weight version it was sent."""


class WeightSync(Protocol):
    """Pushes the trainer's current weights to the inference engines."""

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        """Publish the weights as ``version``; return timing metrics (seconds)."""
        ...


async def reload_engines(urls: Sequence[str], folder: str | Path, version: str) -> None:
    """Every engine at ``urls`` reloads its weights from ``folder`` as ``version`` and is
    asked which version it serves.

    Raises:
        WeightSyncError: an engine reports another version after the reload.
    """
    for url in urls:
        async with EngineClient(url) as client:
            await client.reload_weights(folder, weight_version=version)
            served = await client.weight_version()
        if served != version:
            raise WeightSyncError(f"engine {url} serves weight version {served!r}, sent {version}")


class DiskWeightSync:
    """Export to ``root/v<version>``, reload on every engine, confirm the version.

    Args:
        engine_urls: Base URLs of the engines to update.
        root: Folder for the exported versions.
        keep_last: Version folders to keep on disk (the newest ones).
    """

    def __init__(self, engine_urls: Sequence[str], root: str | Path, keep_last: int = 1) -> None:
        if not engine_urls:
            raise ValueError("DiskWeightSync needs at least one engine url")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.engine_urls = list(engine_urls)
        self.root = Path(root)
        self.keep_last = keep_last
        self.versions: list[int] = []
        """Versions exported so far, oldest first."""

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        """Export ``trainer`` (anything with ``export_hf(folder)``) and reload every engine.

        Raises:
            WeightSyncError: an engine reports another version after the reload.
        """
        if self.versions and version <= self.versions[-1]:
            raise ValueError(f"weight versions must increase: {version} after {self.versions[-1]}")
        start = time.perf_counter()
        folder = self.root / f"v{version}"
        trainer.export_hf(folder)
        exported = time.perf_counter()
        await reload_engines(self.engine_urls, folder, str(version))
        done = time.perf_counter()
        self.versions.append(version)
        for old in self.versions[: -self.keep_last]:
            shutil.rmtree(self.root / f"v{old}", ignore_errors=True)
        self.versions = self.versions[-self.keep_last :]
        return {"export_s": exported - start, "reload_s": done - exported, "total_s": done - start}
