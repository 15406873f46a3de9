"""The engines of a run: Ray actors placed with the trainer ranks still to start; every
engine started is stopped at exit.

:func:`engine_fleet` yields a :class:`Fleet`: the engines' URLs, the Ray run that placed
them, and a restart of one engine where it was. ``recipe.schema.engines`` starts the fleet a
config asks for.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from turnrl.grpo_core.placement.plan import PlacementConfig
    from turnrl.rollout_router.engine import EngineSpec


class Fleet(NamedTuple):
    """The engines of a run."""

    urls: list[str]
    """Where each engine serves."""
    job: Any
    """The ``RayGRPORun`` that placed them (its trainer ranks not started yet)."""
    restart: Callable[[str], None]
    """Start the engine serving at a URL again, where it was (blocks until healthy)."""


@contextlib.contextmanager
def engine_fleet(
    spec: EngineSpec,
    log_dir: Path,
    placement: PlacementConfig,
    *,
    torch_threads: int = 0,
    cancel: threading.Event | None = None,
) -> Iterator[Fleet]:
    """Start the engines serving ``spec``; everything started is stopped at exit.

    A Ray run (:func:`~turnrl.grpo_core.recipe.cluster.ray_run`) places the engines and,
    later, the trainer ranks (``job.start_trainers``, e.g. once SFT wrote their model).
    Blocks until they are healthy, so an app that trains meanwhile enters it from a worker
    thread.

    Args:
        spec: What every engine serves (the port is chosen where it starts).
        log_dir: Where the engines' logs go.
        placement: The Ray run's trainer ranks and engines.
        torch_threads: CPU threads of each Ray trainer rank (0: one per core).
        cancel: Set from another thread to stop the engines while they start
            (``StartCancelled``), e.g. when the SFT trained meanwhile is interrupted.
    """
    from turnrl.grpo_core.placement.actors import EngineLaunch
    from turnrl.grpo_core.recipe.cluster import ray_run
    from turnrl.grpo_core.weight_sync.choose import collective_backend, with_weight_transfer

    # The engines run the weight-transfer engine the loop will use (group_weight_sync
    # chooses alike).
    spec = with_weight_transfer(spec, collective_backend(spec.device, placement.colocate))
    launch = EngineLaunch(spec=spec, log_dir=str(log_dir))
    with ray_run(placement, launch, torch_threads=torch_threads, cancel=cancel) as job:
        yield Fleet(list(job.engine_urls), job, job.restart_engine)
