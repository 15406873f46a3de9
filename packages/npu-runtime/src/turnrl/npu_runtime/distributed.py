"""Initialise ``torch.distributed`` with the backend that fits the device.

``init_distributed()`` picks ``hccl`` on Ascend NPUs, ``nccl`` on NVIDIA GPUs and
``gloo`` on the CPU, makes the local rank's device current, and starts the process
group -- either from the standard launcher variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``; what ``torchrun`` and Ray actors set),
or from an explicit rank, world size and master address.

Example (one process, CPU)::

    ctx = init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=29500)
    ...
    destroy_distributed()
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

from turnrl.npu_runtime.device import (
    DeviceType,
    device_count,
    require_torch,
    resolve_device,
    set_device,
    torch_device,
)

__all__ = ["DistributedContext", "destroy_distributed", "init_distributed"]

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the process group."""

    rank: int
    """Global rank of this process, in ``[0, world_size)``."""
    world_size: int
    """Number of processes in the group."""
    local_rank: int
    """Rank on this node; also the index of the device made current."""
    device: DeviceType
    """The device kind the group was initialised for."""
    backend: str
    """The ``torch.distributed`` backend in use (``hccl`` / ``nccl`` / ``gloo``)."""
    torch_device: str
    """The torch device string of this rank (``npu:0``, ``cuda:1``, ``cpu``)."""


def _int_env(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _from_env(env: Mapping[str, str]) -> tuple[int, int]:
    missing = [name for name in _ENV_VARS if not env.get(name)]
    if missing:
        raise ValueError(
            "init_distributed() without rank/world_size reads the launcher variables "
            f"{', '.join(_ENV_VARS)}, but {', '.join(missing)} is not set; run under torchrun "
            "or pass rank, world_size, master_addr and master_port"
        )
    return _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")


def _validate(rank: int, world_size: int, local_rank: int, master_port: int | None) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {master_port}")


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: DeviceType | str | None = None,
    timeout_s: float = 1800.0,
) -> DistributedContext:
    """Initialise the default ``torch.distributed`` process group for this device.

    With ``rank`` and ``world_size`` None, everything comes from the launcher variables
    (``env://``). Otherwise pass ``rank``, ``world_size``, ``master_addr`` and
    ``master_port`` (``tcp://``). If the group already exists, nothing is started and its
    context is returned.

    Args:
        rank: Global rank of this process.
        world_size: Number of processes.
        local_rank: Rank on this node, i.e. the device index (default: ``LOCAL_RANK``,
            else ``rank``; on accelerators wrapped by the visible device count).
        master_addr: Address of rank 0's rendezvous store.
        master_port: Port of rank 0's rendezvous store.
        device: The device kind (default: detected).
        timeout_s: Timeout of collective operations and of the rendezvous.

    Returns:
        The :class:`DistributedContext` of this process.

    Raises:
        ValueError: Missing or inconsistent rank / world size / address arguments.
        ImportError: PyTorch is not installed.
    """
    torch = require_torch()
    dist = torch.distributed
    kind = resolve_device(device)
    if dist.is_initialized():
        return _current_context(kind, local_rank)
    env = os.environ
    explicit = (rank, world_size, master_addr, master_port)
    if all(v is None for v in explicit):
        rank, world_size = _from_env(env)
        init_method = "env://"
    elif any(v is None for v in explicit):
        raise ValueError(
            "pass all of rank, world_size, master_addr and master_port, or none of them "
            f"(to read {', '.join(_ENV_VARS)} from the environment)"
        )
    else:
        assert rank is not None and world_size is not None  # narrowed by the branch above
        init_method = f"tcp://{master_addr}:{master_port}"
    local = _local_rank(local_rank, rank, kind, env)
    _validate(rank, world_size, local, master_port)
    current = set_device(local, kind)
    backend = kind.distributed_backend
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return DistributedContext(rank, world_size, local, kind, backend, current)


def _local_rank(local_rank: int | None, rank: int, kind: DeviceType, env: Mapping[str, str]) -> int:
    if local_rank is not None:
        return local_rank
    if env.get("LOCAL_RANK"):
        return _int_env(env, "LOCAL_RANK")
    if kind is DeviceType.CPU:
        return rank
    return rank % max(1, device_count(kind))


def _current_context(kind: DeviceType, local_rank: int | None) -> DistributedContext:
    dist = require_torch().distributed
    rank, world_size = int(dist.get_rank()), int(dist.get_world_size())
    local = _local_rank(local_rank, rank, kind, os.environ)
    backend = str(dist.get_backend())
    return DistributedContext(rank, world_size, local, kind, backend, torch_device(local, kind))


def destroy_distributed() -> None:
    """Tear down the default process group, if there is one (safe to call twice)."""
    dist = require_torch().distributed
    if dist.is_initialized():
        dist.destroy_process_group()
