"""The rollout -> reward -> advantage -> train -> weight-sync loop, synchronous or async.

Apps supply the rollout and reward hooks; the loop owns batching, advantages, training
steps and weight sync. See :mod:`turnrl.grpo_core.loop.loop` for the step in detail,
:mod:`turnrl.grpo_core.loop.async_loop` for the off-policy mode and
:mod:`turnrl.grpo_core.loop.rollout_manager` for groups, over-sampling and aborts.
Where the trainers and engines run is :mod:`turnrl.grpo_core.placement`'s; how weights
reach the engines is :mod:`turnrl.grpo_core.weight_sync`'s.
"""

from turnrl.grpo_core.loop.async_loop import AbortFn, AsyncGRPOLoop, RolloutGroup
from turnrl.grpo_core.loop.config import ADVANTAGE_ESTIMATORS, LoopConfig
from turnrl.grpo_core.loop.loop import (
    CheckpointError,
    GRPOLoop,
    PromptIterator,
    latest_checkpoint,
    load_function,
    read_loop_state,
    rollout_metrics,
)
from turnrl.grpo_core.loop.rollout_manager import (
    EpisodeFailedError,
    RolloutManager,
    RolloutManagerConfig,
    RolloutTimeoutError,
    engine_failed,
    keep_rewards,
)
from turnrl.grpo_core.loop.samples import Sample, build_train_batch, sample_advantages, split_batch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AbortFn",
    "AsyncGRPOLoop",
    "CheckpointError",
    "EpisodeFailedError",
    "GRPOLoop",
    "LoopConfig",
    "PromptIterator",
    "RolloutGroup",
    "RolloutManager",
    "RolloutManagerConfig",
    "RolloutTimeoutError",
    "Sample",
    "build_train_batch",
    "engine_failed",
    "keep_rewards",
    "latest_checkpoint",
    "load_function",
    "read_loop_state",
    "rollout_metrics",
    "sample_advantages",
    "split_batch",
]
