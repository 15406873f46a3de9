"""The GRPO loop of a run, on either runner, from the same settings.

:func:`build_loop` is what both apps call for their RL stage: the trainer (one
``TorchEngineConfig``), the reference policy when the KL loss is on, and the engines' weight
sync are built in this process (the local runner) or as the Ray run's trainer ranks (the
Ray runner), and the loop on top is the same :class:`~turnrl.grpo_core.loop.loop.GRPOLoop`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turnrl.grpo_core.loop.async_loop import loop_class
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
    urls: Sequence[str],
    sync_root: str | Path,
    job: Any = None,
    reference: dict[str, Any] | None = None,
    **hooks: Any,
) -> GRPOLoop:
    """A :class:`GRPOLoop` training ``trainer`` and pushing its weights to the engines (an
    ``AsyncGRPOLoop`` when ``config.asynchronous``: drive it with ``run``, which overlaps
    the steps' rollouts with training).

    Args:
        config, prompts, generate, reward, pad_id: As for :class:`GRPOLoop`.
        trainer: The ``TorchEngineConfig`` (or ``MegatronEngineConfig``) every trainer
            (this process's, or each rank's) builds.
        urls: The engines' URLs (the local runner's; a Ray run knows its own).
        sync_root: Folder of the exported weight versions the engines reload (when the
            weights go through disk: on the CPU, or with colocated engines; on GPUs and
            NPUs they go over NCCL / HCCL, :mod:`~turnrl.grpo_core.weight_sync.choose`).
        job: A started ``RayGRPORun`` (its trainer ranks are started here unless they are
            already), or None to train in this process.
        reference: The reference policy's ``ReferencePolicy`` arguments (``model_path``,
            ``micro_batch_size``, ``temperature``, ...) when the KL loss is on, else None.
        hooks: ``evaluate``, ``on_metrics``, ``checkpoint_dir``, ``engine_busy`` of
            :class:`GRPOLoop`.
    """
    if job is None:
        from turnrl.grpo_core.backends import make_engine
        from turnrl.grpo_core.training.reference import ReferencePolicy
        from turnrl.grpo_core.weight_sync.choose import collective_backend, make_weight_sync

        ref = None
        if reference is not None:
            kwargs = dict(reference)
            ref = ReferencePolicy(kwargs.pop("model_path"), **kwargs)
        engine = make_engine(trainer)
        # The local runner's engines never share the trainer's device (engine_fleet).
        backend = collective_backend(str(getattr(engine, "device", "cpu")).split(":")[0])
        return loop_class(config)(
            config,
            engine,
            prompts,
            generate,
            reward,
            weight_sync=make_weight_sync(backend, urls, sync_root),
            pad_id=pad_id,
            reference=ref,
            **hooks,
        )
    group = job.trainers if job.trainers is not None else job.start_trainers(trainer)
    return job.make_loop(
        config,
        prompts,
        generate,
        reward,
        pad_id=pad_id,
        sync_root=sync_root,
        reference=None if reference is None else group.build_reference(**reference),
        **hooks,
    )
