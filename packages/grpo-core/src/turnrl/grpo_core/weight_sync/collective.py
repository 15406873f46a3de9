"""Weight sync over a collective (NCCL on GPU, HCCL on NPU) through vLLM's weight-transfer API.

Backends (:data:`BACKENDS`) differ only in the trainer's transfer group and in the
``--weight-transfer-config`` backend the engines must run (:meth:`CollectiveSyncConfig.engine_args`):

- ``nccl`` -- vLLM's NCCL engine, joined by ``nccl_unique_id_b64`` (GPU);
- ``hccl`` -- vllm-ascend's HCCL engine, joined through vLLM's ``StatelessProcessGroup``
  TCP rendezvous with vllm-ascend's ``PyHcclCommunicator`` (Ascend NPU);
- ``gloo`` -- a torch gloo group on CPU, for receivers that join with torch (the tests).

Before the first group is made, each engine's ``GET /get_world_size`` must equal its
``workers_per_engine`` (a wrong count would hang the rendezvous instead of failing); with
``workers_per_engine=None`` that reply is the count.

Setup (first sync): trainer rank 0 opens a :mod:`transfer group
<turnrl.npu_runtime.transfer>` with every worker of every engine: it POSTs
``/init_weight_transfer_engine`` to all engines (engine ``i`` gets ``rank_offset`` =
1 + the workers of the engines before it) while joining the rendezvous itself.

Each sync, on rank 0: optionally ``/pause`` the engines, ``/start_weight_update``, then
walk the weights in buckets of about ``bucket_mb`` MB. Per bucket it POSTs
``/update_weights`` (``names``, ``dtype_names``, ``shapes``) to every engine and,
concurrently, broadcasts the bucket's bytes as one packed ``uint8`` tensor -- vLLM's
packed protocol, with ``packed_buffer_size_bytes`` = the bucket size, so each engine cuts
exactly the same bucket (a bucket closes once its size *exceeds* the limit, vLLM's rule).
Then ``/finish_weight_update``, ``/reset_prefix_cache?reset_running_requests=true``,
``/update_weight_version`` with the version, optionally ``/resume``, and each engine's
``/weight_info`` must report the new version.

The prefix cache: vLLM reuses a cached prefix's keys and values for every later prompt
that starts with it, whatever weights were loaded since, and clears the cache only on a
``/pause`` that ends the requests (``abort`` / ``wait``; not ``keep``, nor no pause). The
system prompt and tool list open every episode, so without a reset they would keep the
first weights' KV for the whole run. So every sync resets the cache once the last bucket
has landed and before the version is announced or generation resumes, whatever
``pause_mode``. Requests may still be running then (``pause_mode`` None: the asynchronous
loop syncs while groups generate; ``keep``: they are frozen): their blocks would make vLLM
decline the reset, so ``reset_running_requests`` preempts them -- they go back to the
queue, keep the tokens they have and recompute their KV with the new weights, so no cache
entry of older weights survives (their samples keep the version they were launched under,
the asynchronous loop's staleness tag). An engine that still declines (``{"success": false}``, e.g. KV
transfers in flight) or fails the call stops the sync with a :class:`WeightSyncError`
naming it, before it is told the new version.

Every trainer rank calls :meth:`CollectiveWeightSync.sync`: under FSDP each parameter is
gathered with ``full_tensor()`` (a collective over the trainer ranks); only rank 0 keeps it,
talks to engines and broadcasts.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from turnrl.grpo_core.weight_sync.disk import WeightSyncError
from turnrl.npu_runtime.transfer import (
    HcclTransferGroup,
    NcclUniqueIdTransferGroup,
    TorchTransferGroup,
    TransferGroup,
)
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import EngineError, EngineRequestError

T = TypeVar("T")
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class CollectiveSyncConfig:
    """How the trainer pushes weights to engines over a collective."""

    backend: str = "nccl"
    """``nccl``: vLLM's NCCL weight-transfer engine (GPU, unique-id rendezvous);
    ``hccl``: vllm-ascend's HCCL weight-transfer engine (NPU, TCP-store rendezvous);
    ``gloo``: a torch.distributed gloo group (CPU; receivers that join with torch)."""
    workers_per_engine: int | Sequence[int] | None = 1
    """Workers (TP x PP x DP ranks) of each engine: one number for all, one per engine, or
    None to take each engine's ``GET /get_world_size``."""
    bucket_mb: float = 512.0
    """Target bucket size in MiB (a bucket closes once it exceeds this)."""
    dtype: str | None = None
    """Cast weights to this dtype before sending (e.g. ``bfloat16``); None keeps them."""
    pause_mode: str | None = None
    """``abort`` / ``wait`` / ``keep`` to pause generation during the update; None: no pause.
    The prefix cache is reset after the update either way (see the module docstring)."""
    master_address: str = "127.0.0.1"
    """Address engines reach the trainer's store on (gloo, hccl); set it across hosts."""
    master_port: int = 0
    """Port of that store (gloo, hccl); 0 picks a free one."""
    init_timeout_s: float = 300.0
    """Seconds for the rendezvous (gloo, hccl) and for each gloo collective."""
    request_timeout_s: float = 600.0
    """Seconds for each HTTP call to an engine."""
    device: str | None = None
    """Device the broadcast tensors live on: ``cuda:<i>`` (nccl), ``npu:<i>`` (hccl),
    ``cpu`` (gloo); None: the backend's device type, current index."""
    engine_urls: list[str] = field(default_factory=list)
    """Base URLs of the engines to update."""
    check_world_size: bool = True
    """Compare each engine's ``GET /get_world_size`` with ``workers_per_engine`` first."""

    def __post_init__(self) -> None:
        if not self.engine_urls:
            raise ValueError("CollectiveSyncConfig needs at least one engine url")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        want = BACKENDS[self.backend].device_type
        if self.device is not None and self.device.split(":")[0] != want:
            raise ValueError(
                f"backend {self.backend} sends from {want} devices, got device {self.device!r}"
            )
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.pause_mode is not None and self.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"pause_mode must be None or one of {PAUSE_MODES}, got {self.pause_mode!r}"
            )
        workers = self.engine_workers()
        if workers is not None and (len(workers) != len(self.engine_urls) or min(workers) < 1):
            raise ValueError(
                f"workers_per_engine must be >= 1 per engine ({len(self.engine_urls)} engines), "
                f"got {self.workers_per_engine!r}"
            )
        if self.init_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("init_timeout_s and request_timeout_s must be > 0")

    def engine_workers(self) -> list[int] | None:
        """Workers of each engine, in ``engine_urls`` order (None: asked of the engines)."""
        if self.workers_per_engine is None:
            return None
        if isinstance(self.workers_per_engine, int):
            return [self.workers_per_engine] * len(self.engine_urls)
        return list(self.workers_per_engine)

    def engine_args(self) -> list[str]:
        """vLLM server flags the engines need for this backend (none for gloo receivers)."""
        return engine_args(self.backend)

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes."""
        return max(1, int(self.bucket_mb * 2**20))


@dataclass(frozen=True)
class Backend:
    """One collective backend: the trainer's group and what the engines must run."""

    engine_backend: str | None
    """``backend`` of the engines' ``--weight-transfer-config``; None: a torch receiver."""
    device_type: str
    """Device type of the broadcast tensors."""
    open_group: Callable[[CollectiveSyncConfig, int], TransferGroup]
    """``(config, world size) -> the trainer's group`` (rank 0)."""


def _nccl_group(cfg: CollectiveSyncConfig, world: int) -> TransferGroup:
    return NcclUniqueIdTransferGroup(world, cfg.device or "cuda")


def _hccl_group(cfg: CollectiveSyncConfig, world: int) -> TransferGroup:
    return HcclTransferGroup(
        world, cfg.master_address, cfg.master_port, cfg.init_timeout_s, cfg.device
    )


def _gloo_group(cfg: CollectiveSyncConfig, world: int) -> TransferGroup:
    return TorchTransferGroup(
        "gloo", world, cfg.master_address, cfg.master_port, cfg.init_timeout_s, cfg.device or "cpu"
    )


BACKENDS: dict[str, Backend] = {
    "nccl": Backend("nccl", "cuda", _nccl_group),
    "hccl": Backend("hccl", "npu", _hccl_group),
    "gloo": Backend(None, "cpu", _gloo_group),
}
"""The collective backends by ``CollectiveSyncConfig.backend``."""


def engine_args(backend: str) -> list[str]:
    """vLLM server flags an engine needs to receive weights over ``backend`` (none for gloo,
    whose receivers join with torch)."""
    name = BACKENDS[backend].engine_backend
    return [] if name is None else ["--weight-transfer-config", json.dumps({"backend": name})]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[int]:
    """Split byte sizes into buckets as vLLM's packer does; returns the count per bucket.

    A bucket takes tensors until its total *exceeds* ``bucket_bytes``.
    """
    counts, total, count = [], 0, 0
    for size in sizes:
        total += size
        count += 1
        if total > bucket_bytes:
            counts.append(count)
            total, count = 0, 0
    if count:
        counts.append(count)
    return counts


def hf_weights(
    trainer: Any, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights as (Hugging Face name, full tensor), gathered on every rank.

    ``trainer`` is a :class:`~turnrl.grpo_core.training.torch_engine.TorchEngine` (names
    as in ``export_hf``: the ``model.`` wrapper prefix stripped, a tied ``lm_head`` left
    out), a ``MegatronEngine`` (its ``hf_weights``) or any ``torch.nn.Module``. DTensor shards are gathered with ``full_tensor()``,
    so every trainer rank must iterate in step.
    """
    if hasattr(trainer, "hf_weights"):  # the megatron backend converts its own names
        yield from trainer.hf_weights(dtype)
        return
    module = getattr(trainer, "module", trainer)
    hf_model = getattr(trainer, "hf_model", None)
    tied = bool(getattr(getattr(hf_model, "config", None), "tie_word_embeddings", False))
    prefix = "model." if module is not trainer else ""
    for key, value in module.state_dict().items():
        name = key.removeprefix(prefix)
        if tied and name == "lm_head.weight":
            continue
        tensor = value.full_tensor() if hasattr(value, "full_tensor") else value
        tensor = tensor.detach()
        yield name, tensor.to(dtype) if dtype is not None else tensor


def _in_daemon_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run a blocking call in a daemon thread (a stuck collective must not block exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(set_outcome: Callable[[], None]) -> None:
        def apply() -> None:
            if not future.done():
                set_outcome()

        try:
            loop.call_soon_threadsafe(apply)
        except RuntimeError:  # the loop is gone: the caller already gave up on this call
            pass

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting task
            error = exc
            settle(lambda: future.set_exception(error))
        else:
            settle(lambda: future.set_result(result))

    threading.Thread(target=run, daemon=True, name="turnrl-weight-transfer").start()
    return future


async def _with_collective(
    calls: Sequence[Awaitable[Any]], collective: Callable[[], None], what: str
) -> None:
    """Await HTTP ``calls`` and the blocking ``collective`` together; fail on the first error."""
    tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(c) for c in calls]
    tasks.append(_in_daemon_thread(collective))
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        if task.exception() is not None:
            for other in pending:
                other.cancel()
            raise WeightSyncError(f"{what} failed: {task.exception()}") from task.exception()


class CollectiveWeightSync:
    """Push weights to vLLM engines over a collective, in buckets; confirm versions.

    Args:
        config: Engines, backend, bucket size, pause mode.
        rank: This trainer process's rank (default: torch.distributed's, else 0).
    """

    def __init__(self, config: CollectiveSyncConfig, rank: int | None = None) -> None:
        self.config = config
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.group: TransferGroup | None = None
        self.workers: list[int] | None = config.engine_workers()
        """Workers of each engine (from the engines at setup when the config leaves it out)."""
        self.versions: list[int] = []
        """Versions synced so far."""
        self._clients: list[EngineClient] = []

    def _connect(self) -> None:
        """Fresh HTTP clients for this event loop (each sync may run in a new one)."""
        self._clients = [
            EngineClient(u, read_timeout=self.config.request_timeout_s)
            for u in self.config.engine_urls
        ]

    async def _disconnect(self) -> None:
        for client in self._clients:
            await client.close()
        self._clients = []

    def _open_group(self, workers: list[int]) -> TransferGroup:
        world = 1 + sum(workers)
        return BACKENDS[self.config.backend].open_group(self.config, world)

    def _no_api(self, client: EngineClient, route: str) -> WeightSyncError:
        flags = " ".join(self.config.engine_args()) or "vLLM's RL routes"
        return WeightSyncError(
            f"engine {client.url} has no weight-transfer API ({route} -> HTTP 404): start it "
            f"with {flags} and VLLM_SERVER_DEV_MODE=1"
        )

    async def _engine_workers(self) -> list[int]:
        """Each engine's workers (``GET /get_world_size``, TP x PP x DP); they must match
        the config's counts where it gives them."""
        want = self.config.engine_workers()

        async def one(client: EngineClient, want: int | None) -> int:
            try:
                reply = await client._call("GET", "/get_world_size?include_dp=true")
            except EngineRequestError as exc:
                if exc.status == 404:
                    raise self._no_api(client, "GET /get_world_size") from exc
                raise WeightSyncError(f"engine {client.url}: get_world_size failed: {exc}") from exc
            except EngineError as exc:
                raise WeightSyncError(f"engine {client.url}: get_world_size failed: {exc}") from exc
            got = reply.get("world_size") if isinstance(reply, dict) else None
            if want is None:
                if isinstance(got, int) and got >= 1:
                    return got
                raise WeightSyncError(f"engine {client.url} runs {got!r} workers (TP x PP x DP)")
            if got != want:
                raise WeightSyncError(
                    f"engine {client.url} runs {got} workers (TP x PP x DP) but "
                    f"workers_per_engine gives it {want}: the group's world size would be wrong"
                )
            return want

        wants: list[int | None] = list(want) if want else [None] * len(self._clients)
        return list(
            await asyncio.gather(*(one(c, w) for c, w in zip(self._clients, wants, strict=True)))
        )

    async def _init_engine(self, client: EngineClient, info: dict[str, Any]) -> None:
        try:
            await client.init_weight_transfer(info)
        except EngineRequestError as exc:
            if exc.status == 404:
                raise self._no_api(client, "POST /init_weight_transfer_engine") from exc
            raise

    async def setup(self, packed_num_buffers: int = 1) -> None:
        """Create the transfer group with every engine (rank 0 only; a no-op elsewhere).

        Raises:
            WeightSyncError: an engine rejected the init or the rendezvous failed.
        """
        if self.rank != 0 or self.group is not None:
            return
        if not self._clients:
            self._connect()
            try:
                await self.setup(packed_num_buffers)
            finally:
                await self._disconnect()
            return
        if self.workers is None or self.config.check_world_size:
            self.workers = await self._engine_workers()
        workers = self.workers
        try:
            group = self._open_group(workers)
        except (RuntimeError, ValueError) as exc:
            raise WeightSyncError(f"{self.config.backend} transfer group: {exc}") from exc
        base = group.init_info()
        offsets, offset = [], 1
        for count in workers:
            offsets.append(offset)
            offset += count
        inits = [
            self._init_engine(
                client,
                {
                    **base,
                    "rank_offset": off,
                    "packed": True,
                    "packed_buffer_size_bytes": self.config.bucket_bytes,
                    "packed_num_buffers": packed_num_buffers,
                },
            )
            for client, off in zip(self._clients, offsets, strict=True)
        ]
        try:
            await _with_collective(inits, group.join, "init_weight_transfer_engine")
        except WeightSyncError:
            group.close()
            raise
        self.group = group

    async def _each(self, what: str, call: Callable[[EngineClient], Awaitable[Any]]) -> list[Any]:
        """Run ``call`` on every engine concurrently; errors name the engine."""

        async def one(client: EngineClient) -> Any:
            try:
                return await call(client)
            except Exception as exc:
                raise WeightSyncError(f"engine {client.url}: {what} failed: {exc}") from exc

        return list(await asyncio.gather(*(one(c) for c in self._clients)))

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        """Send ``trainer``'s weights as ``version`` (every trainer rank must call this).

        Returns:
            ``total_s``, ``transfer_s`` (buckets on the wire), ``bytes``, ``buckets``,
            ``gb_per_s`` (bytes / transfer_s / 1e9). Non-zero ranks return ``total_s`` only.

        Raises:
            ValueError: ``version`` does not increase.
            WeightSyncError: an engine failed a step or reports another version.
        """
        if self.versions and version <= self.versions[-1]:
            raise ValueError(f"weight versions must increase: {version} after {self.versions[-1]}")
        start = time.perf_counter()
        dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
        weights = hf_weights(trainer, dtype)
        if self.rank != 0:
            for _ in weights:  # join the FSDP gathers only
                pass
            self.versions.append(version)
            return {"total_s": time.perf_counter() - start}
        self._connect()
        try:
            sent, buckets, wire = await self._update(weights, str(version))
        finally:
            await self._disconnect()
        self.versions.append(version)
        total = time.perf_counter() - start
        return {
            "total_s": total,
            "transfer_s": wire,
            "bytes": float(sent),
            "buckets": float(buckets),
            "gb_per_s": sent / max(wire, 1e-9) / 1e9,
        }

    async def _update(
        self, weights: Iterator[tuple[str, torch.Tensor]], tag: str
    ) -> tuple[int, int, float]:
        """The update round on rank 0; returns (bytes, buckets, seconds on the wire)."""
        await self.setup()
        if self.config.pause_mode is not None:
            await self._each("pause", lambda c: c.pause(self.config.pause_mode or "abort"))
        await self._each("start_weight_update", lambda c: c.start_weight_update())
        sent, buckets, wire = await self._send_buckets(weights)
        await self._each("finish_weight_update", lambda c: c.finish_weight_update())
        await self._each("reset_prefix_cache", lambda c: c.clear_prefix_cache())
        await self._each("update_weight_version", lambda c: c.set_weight_version(tag))
        if self.config.pause_mode is not None:
            await self._each("resume", lambda c: c.resume())
        served = await self._each("weight_info", lambda c: c.weight_version())
        for client, got in zip(self._clients, served, strict=True):
            if got != tag:
                raise WeightSyncError(
                    f"engine {client.url} serves weight version {got!r}, sent {tag}"
                )
        return sent, buckets, wire

    async def _send_buckets(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> tuple[int, int, float]:
        """Stream ``weights`` out in buckets; returns (bytes, buckets, seconds on the wire)."""
        limit, sent, buckets, wire = self.config.bucket_bytes, 0, 0, 0.0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in weights:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size > limit:
                wire += await self._send_bucket(bucket)
                sent, buckets, bucket, size = sent + size, buckets + 1, [], 0
        if bucket:
            wire += await self._send_bucket(bucket)
            sent, buckets = sent + size, buckets + 1
        return sent, buckets, wire

    async def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> float:
        """POST one bucket's metadata to all engines while broadcasting its bytes."""
        assert self.group is not None, "setup() runs before the first bucket"
        group = self.group
        info = {
            "names": [n for n, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
        }
        packed = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])
        packed = group.stage(packed)
        start = time.perf_counter()
        calls = [client.update_weights(info) for client in self._clients]
        try:
            await _with_collective(calls, lambda: group.broadcast(packed), "update_weights")
        except WeightSyncError:
            # A half-done collective leaves the group unusable: drop it so the next sync
            # starts a fresh one (the engines need a /shutdown_weight_transfer_engine).
            group.close()
            self.group = None
            raise
        return time.perf_counter() - start

    async def close(self) -> None:
        """Leave the transfer group on every engine and release it here."""
        if self.group is None:
            return
        self._connect()
        try:
            await self._each("shutdown_weight_transfer", lambda c: c.shutdown_weight_transfer())
        finally:
            await self._disconnect()
            self.group.close()
            self.group = None
