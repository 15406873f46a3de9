"""The trainer's end of the weight-transfer process group with the inference engines
(the device communicators: gloo, raw NCCL, HCCL; needs the ``torch`` extra).

vLLM's RL API puts the trainer's rank 0 (the sender, rank 0 of the group) and every
worker of every engine (ranks ``1 ..``) into one communicator that exists only for
weight updates, next to (never inside) the trainer's own ``torch.distributed`` group.
A group is used in two phases, because every rank must enter the rendezvous together:

1. ``init_info()`` -- the rendezvous fields to POST to each engine's
   ``/init_weight_transfer_engine`` (the engine adds its ``rank_offset``);
2. ``join()`` -- blocks until all ranks have joined; run it while those POSTs are in
   flight. Then ``broadcast(tensor)`` sends from rank 0 and ``close()`` tears it down.

Two implementations:

- :class:`TorchTransferGroup` -- a ``torch.distributed`` backend (``gloo``, ``nccl``)
  built directly on a ``TCPStore`` the trainer hosts (``master_address`` /
  ``master_port`` rendezvous). Receivers that join with ``torch.distributed`` use it; the
  CPU tests do, with gloo.
- :class:`NcclUniqueIdTransferGroup` -- raw NCCL through ``ctypes`` with the
  ``nccl_unique_id_b64`` rendezvous, the one vLLM's ``nccl`` weight-transfer engine
  offers to trainers that do not import vLLM (vLLM's own TCP rendezvous pickles vLLM
  classes). It mirrors vLLM's handshake: ``ncclCommInitRank`` then a one-element float32
  ``all_reduce``. It needs a GPU and is not exercised by the CPU test suite.
- :class:`HcclTransferGroup` -- rank 0 of vllm-ascend's ``hccl`` weight-transfer group
  (Ascend NPU). vllm-ascend's ``HCCLWeightTransferEngine`` joins with vLLM's
  ``StatelessProcessGroup`` (a ``TCPStore`` on ``master_address:master_port`` that the
  trainer hosts as rank 0) and a ``PyHcclCommunicator`` on top, whose HCCL unique id
  travels through that store as a pickled vllm-ascend object. The trainer therefore
  builds the same pair from the installed ``vllm`` / ``vllm_ascend`` (as vime's and
  vllm-ascend's own trainer helpers do); it needs ``torch_npu`` and CANN's libhccl.
"""

from __future__ import annotations

import base64
import ctypes
import datetime
import importlib
import inspect
import os
from types import ModuleType
from typing import Any, Protocol

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "turnrl.npu_runtime.transfer needs torch: install turnrl-npu-runtime[torch]"
    ) from exc

from turnrl.npu_runtime.device import DeviceType, accelerator_module
from turnrl.npu_runtime.net import free_port


class TransferGroup(Protocol):
    """Rank 0 of a trainer -> engines broadcast group."""

    device: torch.device
    """Where tensors must be before :meth:`broadcast`."""

    def init_info(self) -> dict[str, Any]:
        """Rendezvous fields for the engines' ``init_info`` (without ``rank_offset``)."""
        ...

    def join(self) -> None:
        """Block until every rank has joined."""
        ...

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` to :attr:`device` (where :meth:`broadcast` reads it)."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (contiguous, on :attr:`device`) from rank 0 to all ranks."""
        ...

    def close(self) -> None:
        """Release the communicator and the rendezvous store."""
        ...


def _check_world_size(world_size: int) -> None:
    if world_size < 2:
        raise ValueError(f"a transfer group needs the trainer and >= 1 worker, got {world_size}")


class _TcpRendezvous:
    """A group whose workers join the TCP store rank 0 hosts at ``master_address:master_port``."""

    master_address: str
    master_port: int
    world_size: int

    def init_info(self) -> dict[str, Any]:
        """``master_address``, ``master_port``, ``world_size``."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "world_size": self.world_size,
        }


class TorchTransferGroup(_TcpRendezvous):
    """A ``torch.distributed`` backend on a trainer-hosted ``TCPStore``; rank 0.

    Args:
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        world_size: 1 (the trainer) + the number of engine workers.
        master_address: Address the engines reach the trainer's store on.
        master_port: Port of the store; 0 picks a free one.
        timeout_s: Rendezvous and per-collective timeout.
        device: Device of the broadcast tensors (``cpu`` for gloo).
    """

    def __init__(
        self,
        backend: str,
        world_size: int,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
        device: str | torch.device = "cpu",
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"TorchTransferGroup backend must be gloo or nccl, got {backend!r}")
        _check_world_size(world_size)
        self.backend = backend
        self.world_size = world_size
        self.device = torch.device(device)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store: dist.TCPStore | None = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=True,
            timeout=self._timeout,
            wait_for_workers=False,
        )
        self.master_address = master_address
        self.master_port = int(self._store.port)
        """The store's port (the one picked when ``master_port`` was 0)."""
        self._group: Any = None

    def join(self) -> None:
        """Create the backend as rank 0 (returns once every worker has connected)."""
        if self._store is None:
            raise RuntimeError("the transfer group is closed")
        store = dist.PrefixStore("turnrl_weight_transfer", self._store)
        if self.backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, 0, self.world_size, self._timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            self._group = dist.ProcessGroupNCCL(store, 0, self.world_size, options)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on :attr:`device`."""
        return tensor.to(self.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast from rank 0 and wait for completion."""
        if self._group is None:
            raise RuntimeError("join() the transfer group before broadcasting")
        self._group.broadcast([tensor], dist.BroadcastOptions()).wait()

    def close(self) -> None:
        """Drop the backend and the store (the engines leave on their own)."""
        self._group = None
        self._store = None


# NCCL's C API, the subset used here (nccl.h).
_NCCL_UNIQUE_ID_BYTES = 128
_NCCL_FLOAT32 = 7
_NCCL_UINT8 = 1
_NCCL_SUM = 0


class _NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _NCCL_UNIQUE_ID_BYTES)]


def load_nccl(path: str | None = None) -> ctypes.CDLL:
    """Open libnccl (``TURNRL_NCCL_LIBRARY``, else the ``libnccl.so.2`` torch loaded)."""
    name = path or os.environ.get("TURNRL_NCCL_LIBRARY") or "libnccl.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise RuntimeError(
            f"cannot load NCCL from {name!r} ({exc}); set TURNRL_NCCL_LIBRARY to libnccl.so.2"
        ) from exc
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclCommInitRank.argtypes = [ctypes.c_void_p, ctypes.c_int, _NcclUniqueId, ctypes.c_int]
    lib.ncclAllReduce.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.ncclBroadcast.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    return lib


class NcclUniqueIdTransferGroup:
    """Rank 0 of vLLM's ``nccl`` weight-transfer group, joined by unique id (GPU only).

    NCCL calls run on the legacy default stream; the device is synchronized before and
    after each one, so tensors written on any stream are complete when sent.

    Args:
        world_size: 1 (the trainer) + the number of engine workers.
        device: The CUDA device of this trainer rank, e.g. ``cuda:0``.
        library: Path of ``libnccl.so.2`` (default: see :func:`load_nccl`).
    """

    def __init__(
        self, world_size: int, device: str | torch.device, library: str | None = None
    ) -> None:
        _check_world_size(world_size)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"the NCCL transfer group needs a cuda device, got {self.device}")
        if self.device.index is None:  # "cuda": this process's current device
            self.device = torch.device("cuda", torch.accelerator.current_device_index())
        self.world_size = world_size
        self._nccl = load_nccl(library)
        self._uid = _NcclUniqueId()
        self._check(self._nccl.ncclGetUniqueId(ctypes.byref(self._uid)), "ncclGetUniqueId")
        self._comm = ctypes.c_void_p()

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            text = self._nccl.ncclGetErrorString(result).decode()
            raise RuntimeError(f"{call} failed with NCCL error {result}: {text}")

    def init_info(self) -> dict[str, Any]:
        """``nccl_unique_id_b64`` (standard base64 of the 128-byte id) and ``world_size``."""
        raw = bytes(bytearray(self._uid.internal))
        return {"nccl_unique_id_b64": base64.b64encode(raw).decode(), "world_size": self.world_size}

    def join(self) -> None:
        """``ncclCommInitRank`` as rank 0, then vLLM's one-element warm-up ``all_reduce``."""
        torch.accelerator.set_device_index(self.device.index or 0)
        self._check(
            self._nccl.ncclCommInitRank(ctypes.byref(self._comm), self.world_size, self._uid, 0),
            "ncclCommInitRank",
        )
        warm = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._check(
            self._nccl.ncclAllReduce(
                ctypes.c_void_p(warm.data_ptr()),
                ctypes.c_void_p(warm.data_ptr()),
                1,
                _NCCL_FLOAT32,
                _NCCL_SUM,
                self._comm,
                None,
            ),
            "ncclAllReduce",
        )
        torch.accelerator.synchronize(self.device)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on :attr:`device`."""
        return tensor.to(self.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send the bytes of ``tensor`` from rank 0 and wait until they are out."""
        if not self._comm.value:
            raise RuntimeError("join() the transfer group before broadcasting")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"broadcast needs a contiguous tensor on {self.device}")
        data = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
        torch.accelerator.synchronize(self.device)
        ptr = ctypes.c_void_p(data.data_ptr())
        self._check(
            self._nccl.ncclBroadcast(ptr, ptr, data.numel(), _NCCL_UINT8, 0, self._comm, None),
            "ncclBroadcast",
        )
        torch.accelerator.synchronize(self.device)

    def close(self) -> None:
        """Destroy the communicator."""
        if self._comm.value:
            self._nccl.ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p()


def _import(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise a RuntimeError saying what it is needed for."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(
            f"HCCL weight transfer needs {what}: cannot import {module} ({exc})"
        ) from exc


class HcclTransferGroup(_TcpRendezvous):
    """Rank 0 of vllm-ascend's ``hccl`` weight-transfer group (Ascend NPU only).

    Imports ``torch_npu``, vLLM's ``StatelessProcessGroup`` and vllm-ascend's
    ``PyHcclCommunicator`` when created, so a missing piece fails here, not mid-sync.
    :meth:`join` and :meth:`broadcast` run in a worker thread: each first selects this
    group's NPU (the current device is per thread) and then runs on its current stream.

    Args:
        world_size: 1 (the trainer) + the number of engine workers.
        master_address: Address the engine workers reach this trainer's store on.
        master_port: Port of that store; 0 picks a free one.
        timeout_s: Rendezvous timeout of the store.
        device: This trainer rank's NPU (``npu:<i>``); None: the current NPU.
    """

    def __init__(
        self,
        world_size: int,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
        device: str | torch.device | None = None,
    ) -> None:
        _check_world_size(world_size)
        try:
            self._npu: Any = accelerator_module(DeviceType.NPU)  # torch_npu's device module
        except ImportError as exc:
            raise RuntimeError(
                "HCCL weight transfer needs torch_npu (Ascend's PyTorch adapter, matching "
                f"CANN): cannot import torch_npu ({exc})"
            ) from exc
        stateless = _import("vllm.distributed.utils", "vLLM in the trainer's environment")
        pyhccl = _import(
            "vllm_ascend.distributed.device_communicators.pyhccl",
            "vllm-ascend in the trainer's environment",
        )
        self._group_cls: Any = stateless.StatelessProcessGroup
        self._comm_cls: Any = pyhccl.PyHcclCommunicator
        self.device = torch.device("npu" if device is None else device)
        if self.device.type != "npu":
            raise ValueError(f"the HCCL transfer group needs an npu device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("npu", self._npu.current_device())
        self.world_size = world_size
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        """The store's port (the one picked when ``master_port`` was 0)."""
        self._timeout_s = timeout_s
        self._comm: Any = None

    def join(self) -> None:
        """Host the store as rank 0 and create the HCCL communicator with every worker.

        Raises:
            RuntimeError: vllm-ascend could not load libhccl (it then disables the
                communicator instead of failing, and every broadcast would be a no-op).
        """
        self._npu.set_device(self.device)
        create = self._group_cls.create
        kwargs: dict[str, Any] = {
            "host": self.master_address,
            "port": self.master_port,
            "rank": 0,
            "world_size": self.world_size,
        }
        if "store_timeout" in inspect.signature(create).parameters:
            kwargs["store_timeout"] = int(self._timeout_s)
        comm = self._comm_cls(create(**kwargs), device=self.device)
        if getattr(comm, "disabled", False) or not getattr(comm, "available", True):
            raise RuntimeError(
                "vllm-ascend's PyHcclCommunicator is disabled: libhccl could not be loaded "
                "(source CANN's set_env.sh, or set HCCL_SO_PATH)"
            )
        self._comm = comm

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on :attr:`device`."""
        return tensor.to(self.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (on :attr:`device`) from rank 0; wait until it is out."""
        if self._comm is None:
            raise RuntimeError("join() the transfer group before broadcasting")
        self._npu.set_device(self.device)
        stream = self._npu.current_stream()
        self._comm.broadcast(tensor, src=0, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        """Destroy the communicator (vllm-ascend releases the store with it)."""
        comm, self._comm = self._comm, None
        close = getattr(comm, "close", None)
        if close is not None:
            close()
