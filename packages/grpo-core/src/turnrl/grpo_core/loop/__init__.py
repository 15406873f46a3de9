"""The synchronous rollout -> reward -> advantage -> train -> weight-sync loop.

Apps supply the rollout and reward hooks; the loop owns batching, advantages, training
steps and weight sync. See :mod:`turnrl.grpo_core.loop.loop` for the step in detail.
"""

from turnrl.grpo_core.loop.async_loop import AbortFn, AsyncGRPOLoop, RolloutGroup
from turnrl.grpo_core.loop.collective_sync import CollectiveSyncConfig, CollectiveWeightSync
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
from turnrl.grpo_core.loop.ray_trainer import (
    RayGRPORun,
    RayReference,
    RayTrainerGroup,
    TrainerGroupError,
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
from turnrl.grpo_core.loop.weight_sync import DiskWeightSync, WeightSync, WeightSyncError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AbortFn",
    "AsyncGRPOLoop",
    "CheckpointError",
    "CollectiveSyncConfig",
    "CollectiveWeightSync",
    "DiskWeightSync",
    "EpisodeFailedError",
    "GRPOLoop",
    "LoopConfig",
    "PromptIterator",
    "RayGRPORun",
    "RayReference",
    "RayTrainerGroup",
    "RolloutGroup",
    "RolloutManager",
    "RolloutManagerConfig",
    "RolloutTimeoutError",
    "Sample",
    "TrainerGroupError",
    "WeightSync",
    "WeightSyncError",
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
