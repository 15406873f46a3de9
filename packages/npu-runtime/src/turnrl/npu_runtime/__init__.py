"""turnrl-npu-runtime: device detection, distributed backends, Ascend defaults, memory and process supervision.

Everything device-specific in turnrl lives here. Modules:

- :mod:`~turnrl.npu_runtime.device`: npu / cuda / cpu detection and the names that follow.
- :mod:`~turnrl.npu_runtime.distributed`: ``torch.distributed`` with hccl / nccl / gloo.
- :mod:`~turnrl.npu_runtime.ascend_env`: documented Ascend environment defaults.
- :mod:`~turnrl.npu_runtime.memory`: free / total device memory and the margin check.
- :mod:`~turnrl.npu_runtime.supervise`: child processes in their own process groups.
- :mod:`~turnrl.npu_runtime.net`: free ports for servers and rendezvous.
- :mod:`~turnrl.npu_runtime.transfer`: the trainer -> engines weight-transfer communicators
  (gloo, raw NCCL, HCCL; imports torch, so not re-exported here).

Only the standard library is imported here; torch is loaded when first needed.
"""

from turnrl.npu_runtime.ascend_env import (
    ASCEND_ENV_DEFAULTS,
    apply_ascend_env,
    ascend_env_defaults,
    remove_conflicting_env,
)
from turnrl.npu_runtime.device import (
    DEVICE_ENV_VAR,
    DeviceType,
    detect_device,
    device_count,
    distributed_backend,
    ray_resource_name,
    resolve_device,
    set_device,
    torch_device,
    visible_devices_env,
)
from turnrl.npu_runtime.distributed import DistributedContext, destroy_distributed, init_distributed
from turnrl.npu_runtime.memory import (
    InsufficientMemoryError,
    MemoryInfo,
    check_memory_margin,
    memory_info,
)
from turnrl.npu_runtime.supervise import (
    HealthTimeoutError,
    ManagedProcess,
    ProcessDiedError,
    start_process,
    stop_all,
)

__version__ = "0.1.0"

__all__ = [
    "ASCEND_ENV_DEFAULTS",
    "DEVICE_ENV_VAR",
    "DeviceType",
    "DistributedContext",
    "HealthTimeoutError",
    "InsufficientMemoryError",
    "ManagedProcess",
    "MemoryInfo",
    "ProcessDiedError",
    "apply_ascend_env",
    "ascend_env_defaults",
    "check_memory_margin",
    "destroy_distributed",
    "detect_device",
    "device_count",
    "distributed_backend",
    "init_distributed",
    "memory_info",
    "ray_resource_name",
    "remove_conflicting_env",
    "resolve_device",
    "set_device",
    "start_process",
    "stop_all",
    "torch_device",
    "visible_devices_env",
]
