"""How the trainer's weights reach the inference engines after a step.

- :mod:`~turnrl.grpo_core.weight_sync.disk`: the :class:`WeightSync` interface and
  :class:`DiskWeightSync` (export a Hugging Face folder, engines reload it; the CPU path).
- :mod:`~turnrl.grpo_core.weight_sync.collective`: :class:`CollectiveWeightSync`, a
  broadcast from trainer rank 0 into the engines' workers (NCCL on CUDA, HCCL on Ascend).
- :mod:`~turnrl.npu_runtime.transfer`: the trainer side of those groups.
- :mod:`~turnrl.grpo_core.weight_sync.sleep`: :class:`EngineSleep`, colocated engines asleep
  while the trainer trains, woken for the sync.
"""

from turnrl.grpo_core.weight_sync.collective import CollectiveSyncConfig, CollectiveWeightSync
from turnrl.grpo_core.weight_sync.disk import DiskWeightSync, WeightSync, WeightSyncError
from turnrl.grpo_core.weight_sync.sleep import EngineSleep

__all__ = [
    "CollectiveSyncConfig",
    "CollectiveWeightSync",
    "DiskWeightSync",
    "EngineSleep",
    "WeightSync",
    "WeightSyncError",
]
