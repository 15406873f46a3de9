"""Mocked NPU boundary: fake ``torch_npu``, vLLM ``StatelessProcessGroup`` and vllm-ascend
``PyHcclCommunicator`` modules that record what the trainer side asks of them.

The CI machine has no Ascend NPU, no CANN and no vllm-ascend, so the HCCL path of
:class:`~turnrl.npu_runtime.transfer.HcclTransferGroup` is checked against these
stand-ins: :func:`install` puts them into ``sys.modules`` and every call lands in
:data:`CALLS` (with the thread it ran on), every broadcast's bytes in :data:`SENT`.

Only for a child process: like the real ``torch_npu`` it renames torch's privateuse1
backend to ``npu`` (so ``torch.device("npu:1")`` parses), which cannot be undone; and the
host-to-NPU copy (:meth:`HcclTransferGroup.stage`) is replaced by a CPU copy, since no
tensor can live on an ``npu`` device here. Install after the model is built: transformers
probes for ``torch_npu`` and would take the fake one for the real thing.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any

import torch

CALLS: list[dict[str, Any]] = []
"""Every call into the fake modules, in order."""
SENT: list[bytes] = []
"""The bytes of every broadcast, in order."""
HCCL_LOADS = True
"""False: the fake communicator disables itself, as vllm-ascend's does without libhccl."""


def _record(call: str, **fields: Any) -> None:
    CALLS.append({"call": call, "thread": threading.current_thread().name, **fields})


class FakeStream:
    """``torch_npu.npu.current_stream()``."""

    def synchronize(self) -> None:
        _record("stream.synchronize")


STREAM = FakeStream()


class FakeNpu:
    """The ``torch_npu.npu`` namespace, the part the trainer side uses."""

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        _record("set_device", device=str(device))

    def current_stream(self) -> FakeStream:
        return STREAM


class FakeStatelessProcessGroup:
    """vLLM's ``StatelessProcessGroup`` (``vllm.distributed.utils``)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = 3600,
        store_timeout: int = 300,
    ) -> FakeStatelessProcessGroup:
        _record(
            "StatelessProcessGroup.create",
            host=host,
            port=port,
            rank=rank,
            world_size=world_size,
            store_timeout=store_timeout,
        )
        return FakeStatelessProcessGroup(rank, world_size)


class FakePyHcclCommunicator:
    """vllm-ascend's ``PyHcclCommunicator`` (``...device_communicators.pyhccl``)."""

    def __init__(
        self, group: FakeStatelessProcessGroup, device: Any, library_path: str | None = None
    ) -> None:
        _record(
            "PyHcclCommunicator", rank=group.rank, world_size=group.world_size, device=str(device)
        )
        self.available = HCCL_LOADS
        self.disabled = not HCCL_LOADS

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        _record(
            "broadcast",
            src=src,
            nbytes=tensor.numel() * tensor.element_size(),
            dtype=str(tensor.dtype),
            on_current_stream=stream is STREAM,
        )
        SENT.append(tensor.contiguous().view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        _record("PyHcclCommunicator.close")


def _module(name: str, **attrs: Any) -> ModuleType:
    module = ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def install() -> None:
    """Put the fakes into ``sys.modules`` and stage tensors on the CPU (child process only)."""
    from turnrl.npu_runtime.transfer import HcclTransferGroup

    torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
    sys.modules["torch_npu"] = _module("torch_npu", npu=FakeNpu())
    sys.modules["vllm.distributed.utils"] = _module(
        "vllm.distributed.utils", StatelessProcessGroup=FakeStatelessProcessGroup
    )
    sys.modules["vllm_ascend.distributed.device_communicators.pyhccl"] = _module(
        "vllm_ascend.distributed.device_communicators.pyhccl",
        PyHcclCommunicator=FakePyHcclCommunicator,
    )

    def stage_on_cpu(self: HcclTransferGroup, tensor: torch.Tensor) -> torch.Tensor:
        _record("stage", device=str(self.device))
        return tensor.clone()

    HcclTransferGroup.stage = stage_on_cpu  # type: ignore[method-assign]
