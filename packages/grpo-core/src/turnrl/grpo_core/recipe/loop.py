"""The GRPO loop of a run, from its settings.

:func:`build_loop` is what every app's RL stage calls: the trainer ranks (one
``TorchEngineConfig`` each builds) are the Ray run's actors (one rank on the CPU default),
the reference policy is built on them when the KL loss is on, the weight sync is chosen
from the device and placement (``RayGRPORun.make_loop``), and the loop on top is a
:class:`~turnrl.grpo_core.loop.loop.GRPOLoop` (an ``AsyncGRPOLoop`` when asynchronous).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.loop.loop import GenerateFn, GRPOLoop, RewardFn


def build_loop(
    config: LoopConfig,
    trainer: Any,
    prompts: Sequence[Any],
    generate: GenerateFn,
    reward: RewardFn,
    *,
    pad_id: int,
    sync_root: str | Path,
    job: Any,
    reference: dict[str, Any] | None = None,
    **hooks: Any,
) -> GRPOLoop:
    """A :class:`GRPOLoop` training on ``job``'s trainer ranks and pushing their weights to
    its engines (an ``AsyncGRPOLoop`` when ``config.asynchronous``: drive it with ``run``,
    which overlaps the steps' rollouts with training).

    Args:
        config, prompts, generate, reward, pad_id: As for :class:`GRPOLoop`.
        trainer: The ``TorchEngineConfig`` (or ``MegatronEngineConfig``) every trainer rank
            builds (the ranks are started here unless they are already).
        sync_root: Folder of the exported weight versions the engines reload (when the
            weights go through disk: on the CPU, or with colocated engines; on GPUs and
            NPUs they go over NCCL / HCCL, :mod:`~turnrl.grpo_core.weight_sync.choose`).
        job: The started ``RayGRPORun`` whose engines serve the rollouts.
        reference: The reference policy's ``ReferencePolicy`` arguments (``model_path``,
            ``micro_batch_size``, ``temperature``, ...) when the KL loss is on, else None.
        hooks: ``evaluate``, ``on_metrics``, ``checkpoint_dir``, ``engine_busy`` of
            :class:`GRPOLoop`.
    """
    group = job.trainers if job.trainers is not None else job.start_trainers(trainer)
    return job.make_loop(  # type: ignore[no-any-return]
        config,
        prompts,
        generate,
        reward,
        pad_id=pad_id,
        sync_root=sync_root,
        reference=None if reference is None else group.build_reference(**reference),
        **hooks,
    )
