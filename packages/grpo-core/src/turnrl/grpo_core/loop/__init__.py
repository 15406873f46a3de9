"""The synchronous rollout -> reward -> advantage -> train -> weight-sync loop.

Apps supply the rollout and reward hooks; the loop owns batching, advantages, training
steps and weight sync. See :mod:`turnrl.grpo_core.loop.loop` for the step in detail.
"""

from turnrl.grpo_core.loop.config import ADVANTAGE_ESTIMATORS, LoopConfig
from turnrl.grpo_core.loop.loop import GRPOLoop, PromptIterator, load_function, rollout_metrics
from turnrl.grpo_core.loop.samples import Sample, build_train_batch, sample_advantages, split_batch
from turnrl.grpo_core.loop.weight_sync import DiskWeightSync, WeightSync, WeightSyncError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DiskWeightSync",
    "GRPOLoop",
    "LoopConfig",
    "PromptIterator",
    "Sample",
    "WeightSync",
    "WeightSyncError",
    "build_train_batch",
    "load_function",
    "rollout_metrics",
    "sample_advantages",
    "split_batch",
]
