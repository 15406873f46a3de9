"""Free and total memory of the current device, and a margin check before training.

On an NPU or GPU this asks the driver (``torch.npu.mem_get_info`` /
``torch.cuda.mem_get_info``: free and total bytes of the device, whoever uses it). On the
CPU it reads the host's ``MemAvailable`` and ``MemTotal`` from ``/proc/meminfo``, falling
back to ``os.sysconf`` where there is no ``/proc``.

:func:`check_memory_margin` backs the ``--train-memory-margin-bytes`` flag: it raises
before a step would start with less free memory than the margin (e.g. because colocated
inference engines did not release theirs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from turnrl.npu_runtime.device import DeviceType, require_torch, require_torch_npu, resolve_device

__all__ = [
    "InsufficientMemoryError",
    "MemoryInfo",
    "check_memory_margin",
    "format_bytes",
    "host_memory_info",
    "memory_info",
]

_MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one device at one moment."""

    free_bytes: int
    """Bytes that can still be allocated (host: ``MemAvailable``)."""
    total_bytes: int
    """Capacity of the device in bytes."""
    device: str
    """The torch device string measured (``npu:0``, ``cuda:1``, ``cpu``)."""

    @property
    def used_bytes(self) -> int:
        """``total_bytes - free_bytes``."""
        return self.total_bytes - self.free_bytes


class InsufficientMemoryError(RuntimeError):
    """Less memory is free than the required margin.

    Attributes:
        info: The measurement that failed the check.
        margin_bytes: The margin that was required.
    """

    def __init__(self, info: MemoryInfo, margin_bytes: int):
        self.info = info
        self.margin_bytes = margin_bytes
        super().__init__(
            f"only {format_bytes(info.free_bytes)} of {format_bytes(info.total_bytes)} free on "
            f"{info.device}, below the required margin of {format_bytes(margin_bytes)} "
            "(--train-memory-margin-bytes); free memory (e.g. offload or sleep the colocated "
            "inference engines) or lower the margin"
        )


def format_bytes(n: int) -> str:
    """A byte count for people: ``4.00 GiB (4294967296 bytes)``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.2f} {unit} ({n} bytes)"


def _parse_meminfo(text: str) -> tuple[int, int]:
    """(available, total) bytes from the text of /proc/meminfo."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            fields[key.strip()] = int(parts[0]) * scale
    if "MemTotal" not in fields:
        raise ValueError("/proc/meminfo has no MemTotal line")
    # Kernels before 3.14 lack MemAvailable; free + page cache is the usual estimate.
    available = fields.get("MemAvailable")
    if available is None:
        available = fields.get("MemFree", 0) + fields.get("Cached", 0) + fields.get("Buffers", 0)
    return available, fields["MemTotal"]


def host_memory_info() -> MemoryInfo:
    """Available and total host memory (bytes)."""
    try:
        free, total = _parse_meminfo(_MEMINFO.read_text())
    except OSError:
        page = os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * page
        total = os.sysconf("SC_PHYS_PAGES") * page
    return MemoryInfo(free_bytes=free, total_bytes=total, device="cpu")


def memory_info(device: DeviceType | str | None = None, index: int | None = None) -> MemoryInfo:
    """Free and total memory of a device.

    Args:
        device: The device kind (default: detected).
        index: Device index (default: the current device of this process).

    Returns:
        A :class:`MemoryInfo`; on CPU, the host's memory.

    Raises:
        ImportError: An accelerator was asked for and torch / torch_npu is missing.
    """
    kind = resolve_device(device)
    if kind is DeviceType.CPU:
        return host_memory_info()
    torch = require_torch()
    if kind is DeviceType.NPU:
        require_torch_npu()
        module = torch.npu
    else:
        module = torch.cuda
    current = int(module.current_device()) if index is None else index
    free, total = module.mem_get_info(current)
    return MemoryInfo(free_bytes=int(free), total_bytes=int(total), device=f"{kind}:{current}")


def check_memory_margin(
    margin_bytes: int, device: DeviceType | str | None = None, index: int | None = None
) -> MemoryInfo:
    """Raise unless at least ``margin_bytes`` are free on the device.

    Args:
        margin_bytes: Bytes that must be free (``--train-memory-margin-bytes``; 0 disables).
        device: The device kind (default: detected).
        index: Device index (default: the current device).

    Returns:
        The measurement, when the check passes.

    Raises:
        ValueError: ``margin_bytes`` is negative or not an integer.
        InsufficientMemoryError: Less than ``margin_bytes`` is free.
    """
    if isinstance(margin_bytes, bool) or not isinstance(margin_bytes, int):
        raise ValueError(f"margin_bytes must be an integer byte count, got {margin_bytes!r}")
    if margin_bytes < 0:
        raise ValueError(f"margin_bytes must be >= 0, got {margin_bytes}")
    info = memory_info(device, index)
    if info.free_bytes < margin_bytes:
        raise InsufficientMemoryError(info, margin_bytes)
    return info
