"""Which accelerator this process runs on, and the names that follow from it.

One small enum, :class:`DeviceType`, maps each device to everything device-specific the
rest of turnrl needs: the ``torch.distributed`` backend (``hccl`` / ``nccl`` / ``gloo``),
the visible-devices variable (``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``)
and the Ray resource name (``NPU`` / ``GPU``).

Detection order: an Ascend NPU (``torch_npu`` importable and ``torch.npu.is_available()``),
then an NVIDIA GPU (``torch.cuda.is_available()``), else the CPU. The environment variable
``TURNRL_DEVICE=npu|cuda|cpu`` forces a choice (an error if that device is missing).

torch is optional (``pip install turnrl-npu-runtime[torch]``) and imported lazily: without
it, detection answers ``cpu``, and anything that needs torch raises an ``ImportError``
saying what to install.
"""

from __future__ import annotations

import enum
import importlib
import os
from collections.abc import Mapping
from types import ModuleType

__all__ = [
    "DEVICE_ENV_VAR",
    "DeviceType",
    "detect_device",
    "device_count",
    "distributed_backend",
    "ray_resource_name",
    "require_torch",
    "require_torch_npu",
    "resolve_device",
    "set_device",
    "torch_device",
    "visible_devices_env",
]

DEVICE_ENV_VAR = "TURNRL_DEVICE"
"""Environment variable that forces the device: ``npu``, ``cuda`` or ``cpu``."""

TORCH_INSTALL_HINT = "pip install turnrl-npu-runtime[torch]"
NPU_INSTALL_HINT = "pip install turnrl-npu-runtime[npu] (on an Ascend machine with CANN)"


class DeviceType(enum.StrEnum):
    """An accelerator kind, and the names each part of the stack uses for it."""

    NPU = "npu"
    CUDA = "cuda"
    CPU = "cpu"

    @property
    def distributed_backend(self) -> str:
        """The ``torch.distributed`` backend: ``hccl``, ``nccl`` or ``gloo``."""
        return {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}[self.value]

    @property
    def visible_devices_env(self) -> str | None:
        """The variable that restricts which devices a process sees (None on CPU)."""
        return {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}.get(self.value)

    @property
    def ray_resource(self) -> str | None:
        """Ray's resource name for one such device (None on CPU: Ray counts CPUs itself)."""
        return {"npu": "NPU", "cuda": "GPU"}.get(self.value)

    @property
    def is_accelerator(self) -> bool:
        """True for NPU and CUDA."""
        return self is not DeviceType.CPU


def require_torch() -> ModuleType:
    """Import and return ``torch``, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module("torch")
    except ImportError as error:
        raise ImportError(
            f"this needs PyTorch, which is not installed: {TORCH_INSTALL_HINT} ({error})"
        ) from error


def _try_torch() -> ModuleType | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def _npu_available(torch: ModuleType) -> bool:
    """Whether torch_npu imports and reports at least one usable NPU."""
    try:
        importlib.import_module("torch_npu")  # registers the torch.npu namespace
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def _cuda_available(torch: ModuleType) -> bool:
    return bool(torch.cuda.is_available())


def _parse_forced(env: Mapping[str, str]) -> DeviceType | None:
    raw = env.get(DEVICE_ENV_VAR, "").strip().lower()
    if raw in ("", "auto"):
        return None
    try:
        return DeviceType(raw)
    except ValueError:
        choices = ", ".join(d.value for d in DeviceType)
        raise ValueError(
            f"{DEVICE_ENV_VAR}={env[DEVICE_ENV_VAR]!r} is not a device; use one of {choices} "
            "(or leave it unset to detect)"
        ) from None


def _check_forced(device: DeviceType) -> None:
    if device is DeviceType.CPU:
        return
    torch = _try_torch()
    if torch is None:
        raise RuntimeError(
            f"{DEVICE_ENV_VAR}={device.value} but PyTorch is not installed: "
            + (NPU_INSTALL_HINT if device is DeviceType.NPU else TORCH_INSTALL_HINT)
        )
    if device is DeviceType.NPU and not _npu_available(torch):
        raise RuntimeError(
            f"{DEVICE_ENV_VAR}=npu but no Ascend NPU is usable (torch_npu missing or "
            f"torch.npu.is_available() is False); install: {NPU_INSTALL_HINT}"
        )
    if device is DeviceType.CUDA and not _cuda_available(torch):
        raise RuntimeError(
            f"{DEVICE_ENV_VAR}=cuda but torch.cuda.is_available() is False "
            "(no NVIDIA GPU, no driver, or a CPU-only torch build)"
        )


def detect_device(env: Mapping[str, str] | None = None) -> DeviceType:
    """The device this process should use.

    Args:
        env: Environment to read ``TURNRL_DEVICE`` from (default ``os.environ``).

    Returns:
        ``TURNRL_DEVICE`` if set (after checking that device is usable), else the first
        available of NPU, CUDA, CPU. Without torch: CPU.

    Raises:
        ValueError: ``TURNRL_DEVICE`` holds something other than npu, cuda, cpu or auto.
        RuntimeError: ``TURNRL_DEVICE`` names a device that is not available.
    """
    forced = _parse_forced(os.environ if env is None else env)
    if forced is not None:
        _check_forced(forced)
        return forced
    torch = _try_torch()
    if torch is None:
        return DeviceType.CPU
    if _npu_available(torch):
        return DeviceType.NPU
    if _cuda_available(torch):
        return DeviceType.CUDA
    return DeviceType.CPU


def resolve_device(device: DeviceType | str | None = None) -> DeviceType:
    """``device`` as a :class:`DeviceType` (None: :func:`detect_device`); ``gpu`` is read
    as ``cuda`` (the apps' ``--device gpu``).

    Raises:
        ValueError: ``device`` is not npu, cuda (gpu) or cpu.
    """
    if device is None:
        return detect_device()
    if isinstance(device, DeviceType):
        return device
    try:
        name = str(device).strip().lower()
        return DeviceType("cuda" if name == "gpu" else name)
    except ValueError:
        raise ValueError(
            f"unknown device {device!r}; use one of {', '.join(d.value for d in DeviceType)}"
        ) from None


def device_count(device: DeviceType | str | None = None) -> int:
    """How many devices of this kind the process sees (CPU: 1, the host)."""
    kind = resolve_device(device)
    if kind is DeviceType.CPU:
        return 1
    torch = require_torch()
    if kind is DeviceType.NPU:
        require_torch_npu()
        return int(torch.npu.device_count())
    return int(torch.cuda.device_count())


def torch_device(index: int | None = None, device: DeviceType | str | None = None) -> str:
    """The torch device string: ``npu:0``, ``cuda:1``, ``cpu`` (CPU ignores ``index``).

    Args:
        index: Device index (e.g. the local rank); None gives the bare type (``cuda``).
        device: The device kind (default: detected).

    Raises:
        ValueError: ``index`` is negative.
    """
    kind = resolve_device(device)
    if index is not None and index < 0:
        raise ValueError(f"device index must be >= 0, got {index}")
    if kind is DeviceType.CPU or index is None:
        return kind.value
    return f"{kind.value}:{index}"


def distributed_backend(device: DeviceType | str | None = None) -> str:
    """The ``torch.distributed`` backend for the device: ``hccl``, ``nccl`` or ``gloo``."""
    return resolve_device(device).distributed_backend


def visible_devices_env(device: DeviceType | str | None = None) -> str | None:
    """``ASCEND_RT_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES``, or None on CPU."""
    return resolve_device(device).visible_devices_env


def ray_resource_name(device: DeviceType | str | None = None) -> str | None:
    """Ray's resource name for the device: ``NPU``, ``GPU``, or None on CPU."""
    return resolve_device(device).ray_resource


def require_torch_npu() -> ModuleType:
    """Import and return ``torch_npu``, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as error:
        raise ImportError(f"the NPU path needs torch_npu: {NPU_INSTALL_HINT} ({error})") from error


def accelerator_module(device: DeviceType | str | None = None) -> ModuleType:
    """The torch device module of an accelerator: ``torch.cuda``, or ``torch_npu.npu``.

    For code outside npu-runtime that needs the module's stream and device calls
    (``current_device``, ``set_device``, ``current_stream``) without naming CUDA or Ascend.

    Raises:
        ValueError: ``device`` is the CPU (it has no such module).
        ImportError: NPU without torch_npu installed.
    """
    kind = resolve_device(device)
    if kind is DeviceType.CPU:
        raise ValueError("the CPU has no accelerator module")
    if kind is DeviceType.NPU:  # torch_npu.npu, also registered as torch.npu on import
        module: ModuleType = getattr(require_torch_npu(), "npu", None) or require_torch().npu
        return module
    return require_torch().cuda


def set_device(index: int, device: DeviceType | str | None = None) -> str:
    """Make device ``index`` the current one for this process (no-op on CPU).

    Args:
        index: The device index, usually the local rank.
        device: The device kind (default: detected).

    Returns:
        The torch device string now current (``npu:0``, ``cuda:3``, ``cpu``).

    Raises:
        ValueError: ``index`` is negative or not below the device count.
    """
    kind = resolve_device(device)
    name = torch_device(index, kind)
    if kind is DeviceType.CPU:
        return name
    count = device_count(kind)
    if index >= count:
        env_name = kind.visible_devices_env
        raise ValueError(
            f"device index {index} is out of range: this process sees {count} {kind.value} "
            f"device(s) (check {env_name}={os.environ.get(env_name or '', '<unset>')!r})"
        )
    torch = require_torch()
    module = torch.npu if kind is DeviceType.NPU else torch.cuda
    module.set_device(index)
    return name
