"""GRPOLoop on Ray: a group of trainer actors that looks like one trainer, and a run builder.

:class:`RayTrainerGroup` drives the trainer actors a :class:`RayPlacement` started (one
:class:`~turnrl.grpo_core.training.torch_engine.TorchEngine` per rank, FSDP2-sharded over
the group) through the surface :class:`~turnrl.grpo_core.loop.loop.GRPOLoop`,
:class:`~turnrl.grpo_core.weight_sync.disk.DiskWeightSync` and the reference model use:
``compute_logprobs``, ``train_step``, ``export_hf``, ``save_checkpoint`` and
``load_checkpoint`` (plus :class:`RayReference` for ``attach``).

Data parallelism: a batch's rows are cut into one contiguous shard per data-parallel rank
(``world_size`` of them, or ``world_size / TP`` for a tensor-parallel megatron engine,
whose TP peers get the same shard and return the same results), whose sizes
differ by at most one (uneven shards, no padding rows); a rank left without a row (a batch
smaller than the group) gets one filler row with an all-zero loss mask, which adds no loss,
no gradient and no token. As the engine normalises the loss by the token and sequence
counts of the whole mini-batch across ranks, uneven shards give the same loss as one
process on the whole batch. Results come back in row order; metrics are reduced as the
engine defines them:

- ``loss``, ``pg_loss``, ``kl_loss``, ``grad_norm``, ``lr`` and ``num_tokens`` are already
  the group's values on every rank (rank 0's are returned);
- ``step_time_s`` is the slowest rank's;
- every other metric (``clip_frac``, ``entropy``, ...) is a rank-local token-weighted mean,
  combined weighted by each rank's loss tokens.

Failures: a rank whose actor dies (or whose call fails while others wait in a collective)
leaves the process group unusable; the group then kills its remaining trainer actors, so
nothing hangs, and raises :class:`TrainerGroupError` (a ``RuntimeError``) naming the rank
and the method. Every later call raises too: start a new run and resume from the last
checkpoint (:meth:`GRPOLoop.resume`).

Files: checkpoints and exported weights are written by the ranks, so on several nodes the
folders must be on storage every node (and every engine) sees.

Example (a running Ray, e.g. after ``ray.init()``)::

    placement = PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=1, accelerator="CPU")
    with RayGRPORun(placement, TorchEngineConfig(model_path="tiny"), EngineLaunch(spec=EngineSpec(...))) as run:
        loop = run.make_loop(loop_config, prompts, generate, reward, pad_id=0, sync_root="sync")
        asyncio.run(loop.run())
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.loop.loop import (
    BusyFn,
    EvalFn,
    GenerateFn,
    GRPOLoop,
    MetricsFn,
    RewardFn,
    WeightUpdates,
)
from turnrl.grpo_core.placement.actors import EngineLaunch, RayPlacement, require_ray
from turnrl.grpo_core.placement.plan import PlacementConfig, resolve_accelerator
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.weight_sync.choose import collective_backend
from turnrl.grpo_core.weight_sync.collective import CollectiveSyncConfig
from turnrl.grpo_core.weight_sync.disk import DiskWeightSync, WeightSync
from turnrl.grpo_core.weight_sync.sleep import EngineSleep
from turnrl.npu_runtime.supervise import StartCancelled

__all__ = [
    "GROUP_METRICS",
    "RayCollectiveSync",
    "RayGRPORun",
    "RayReference",
    "RayTrainerGroup",
    "TrainerGroupError",
    "reduce_train_metrics",
    "shard_bounds",
]

GROUP_METRICS = ("loss", "pg_loss", "kl_loss", "grad_norm", "lr", "num_tokens")
"""Train-step metrics every rank reports with the group's value (rank 0's is returned)."""
FAILURE_GRACE_S = 10.0
"""How long the other ranks may take to finish after one rank's call failed, before the
group counts as stuck in a collective and is stopped."""


class TrainerGroupError(RuntimeError):
    """A trainer rank died or failed; the message names the rank and the method."""


def shard_bounds(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` row ranges per rank, sizes differing by at most one.

    Ranks past ``num_rows`` (a batch smaller than the group) get an empty range.
    """
    if num_rows < 1 or world_size < 1:
        raise ValueError(f"need num_rows >= 1 and world_size >= 1, got {num_rows}, {world_size}")
    base, extra = divmod(num_rows, world_size)
    sizes = [base + (1 if r < extra else 0) for r in range(world_size)]
    stops = list(itertools.accumulate(sizes))
    return [(stop - size, stop) for size, stop in zip(sizes, stops, strict=True)]


def _filler(batch: TrainBatch) -> TrainBatch:
    """One row of ``batch`` with an all-zero loss mask: no loss, no gradient, no token."""
    row = batch.select(slice(0, 1))
    return replace(row, loss_mask=torch.zeros_like(row.loss_mask))


class RayTrainerGroup:
    """The trainer ranks of a :class:`RayPlacement`, driven as one data-parallel trainer.

    Args:
        placement: A started placement whose :meth:`RayPlacement.start_trainers` built the
            engines (it was given a ``TorchEngineConfig``).
        call_timeout_s: Longest a call may take on every rank (None: no limit); past it the
            group is stopped and the call raises :class:`TrainerGroupError`.
    """

    def __init__(self, placement: RayPlacement, call_timeout_s: float | None = None) -> None:
        if not placement.trainers:
            raise ValueError("the placement has no trainers: call start_trainers(config) first")
        if call_timeout_s is not None and call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0 or None, got {call_timeout_s}")
        self.placement = placement
        self.actors = list(placement.trainers)
        self.call_timeout_s = call_timeout_s
        self.broken: str | None = None
        """Why the group can no longer be used (None while it can)."""
        self._model_parallel: int | None = None

    @property
    def world_size(self) -> int:
        """Number of trainer ranks."""
        return len(self.actors)

    @property
    def model_parallel_size(self) -> int:
        """Adjacent ranks that hold one model copy (its tensor-parallel size; asked once)."""
        if self._model_parallel is None:
            layouts = self._call("parallel_layout")
            self._model_parallel = int(layouts[0][1])
        return self._model_parallel

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: a list of micro-batches is dealt to them in contiguous runs."""
        return self.world_size // self.model_parallel_size

    # -- calls ---------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        per_rank: Sequence[Any] | None = None,
        *,
        actor_method: str | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``Trainer.<method>(per_rank[r], **kwargs)`` on every rank at once.

        Args:
            method: The engine method (named in errors).
            per_rank: Each rank's positional argument (None: no positional argument).
            actor_method: Call this ``TrainerActor`` method instead of the engine's.
            **kwargs: Keyword arguments for every rank.

        Returns:
            One result per rank, in rank order.
        """
        ray = require_ray()
        if self.broken is not None:
            raise TrainerGroupError(
                f"the trainer group is stopped ({self.broken}); {method} cannot run"
            )
        if per_rank is not None and len(per_rank) != self.world_size:
            raise ValueError(f"{len(per_rank)} per-rank arguments for {self.world_size} ranks")
        refs = {}
        for rank, actor in enumerate(self.actors):
            args = () if per_rank is None else (per_rank[rank],)
            if actor_method is None:
                ref = actor.call.remote(method, *args, **kwargs)
            else:
                ref = getattr(actor, actor_method).remote(*args, **kwargs)
            refs[ref] = rank
        results: list[Any] = [None] * self.world_size
        deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
        while refs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(refs.values())
                self._stop(f"rank(s) {ranks} did not finish {method} in {self.call_timeout_s:g} s")
                raise TrainerGroupError(
                    f"trainer rank(s) {ranks} did not finish {method} within "
                    f"{self.call_timeout_s:g} s; the group was stopped"
                )
            rank = refs.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayError as error:
                self._fail(rank, method, error, list(refs))
        return results

    def _fail(self, rank: int, method: str, error: Exception, pending: list[Any]) -> None:
        """Raise for a failed rank; stop the group when it is dead or others are stuck."""
        ray = require_ray()
        if isinstance(error, ray.exceptions.RayActorError):
            why = f"trainer rank {rank} died during {method}"
            self._stop(why)
            raise TrainerGroupError(f"{why}: {error}; the group was stopped") from error
        cause = getattr(error, "cause", None) or error
        why = f"trainer rank {rank} failed in {method}: {type(cause).__name__}: {cause}"
        stuck = []
        if pending:
            _, stuck = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
        if stuck:
            self._stop(why)
            raise TrainerGroupError(f"{why}; other ranks stayed blocked, the group was stopped")
        raise TrainerGroupError(why) from cause

    def _stop(self, why: str) -> None:
        """Mark the group unusable and kill its actors (ranks may wait in a collective)."""
        ray = require_ray()
        self.broken = why
        for actor in self.actors:
            ray.kill(actor)

    def _sharded(self, batch: TrainBatch) -> tuple[list[TrainBatch], list[tuple[int, int]]]:
        """Each rank's rows (TP peers share theirs) and each data-parallel shard's bounds."""
        mp = self.model_parallel_size
        bounds = shard_bounds(batch.num_sequences, self.world_size // mp)
        shards = [batch.select(slice(a, b)) if b > a else _filler(batch) for a, b in bounds]
        return [shards[r // mp] for r in range(self.world_size)], bounds

    def _gathered(self, batch: TrainBatch, method: str, **kwargs: Any) -> torch.Tensor:
        """Run a row-wise scoring ``method`` over the ranks; ``[B, L]`` in row order."""
        per_rank, bounds = self._sharded(batch)
        parts = self._call(method, per_rank, **kwargs)
        return _gather_rows(batch, parts[:: self.model_parallel_size], bounds)

    # -- the trainer surface -------------------------------------------------------------

    def compute_logprobs(
        self, batch: TrainBatch, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """``[B, L]`` log-probs of ``batch`` under the current weights, rows split over ranks."""
        return self._gathered(batch, "compute_logprobs", micro_batch_size=micro_batch_size)

    def train_step(
        self, batch: TrainBatch | Sequence[TrainBatch], objective: str = "rl"
    ) -> dict[str, float]:
        """One optimizer step of the group over a mini-batch (see ``Trainer.train_step``).

        Args:
            batch: The mini-batch (its rows are split over ranks), or its micro-batches
                (whole micro-batches are split over ranks, contiguously).
            objective: ``rl`` or ``sft``.
        """
        if objective not in ("rl", "sft"):
            raise ValueError(f"objective must be 'rl' or 'sft', got {objective!r}")
        per_rank: list[Any]
        if isinstance(batch, TrainBatch):
            per_rank, _ = self._sharded(batch)
            tokens = [s.num_loss_tokens for s in per_rank]
        else:
            micro = list(batch)
            if not micro:
                raise ValueError("train_step got no micro-batches")
            mp = self.model_parallel_size
            bounds = shard_bounds(len(micro), self.world_size // mp)
            shares = [micro[a:b] if b > a else [_filler(micro[0])] for a, b in bounds]
            per_rank = [shares[r // mp] for r in range(self.world_size)]
            tokens = [sum(m.num_loss_tokens for m in ms) for ms in per_rank]
        metrics = self._call("train_step", per_rank, objective=objective)
        return reduce_train_metrics(metrics, tokens)

    def save_checkpoint(self, folder: str | Path, data_state: dict[str, Any] | None = None) -> Path:
        """Every rank saves its shard, RNG states and the step; ``data_state`` goes to rank 0's."""
        paths = self._call(
            "save_checkpoint", [Path(folder)] * self.world_size, data_state=data_state
        )
        return Path(paths[0])

    def load_checkpoint(self, folder: str | Path) -> dict[str, Any]:
        """Every rank restores its state from ``folder``; returns the saved ``data_state``."""
        states = self._call("load_checkpoint", [Path(folder)] * self.world_size)
        return dict(states[0])

    def export_hf(self, folder: str | Path, dtype: Any = None) -> Path:
        """Write the full weights as a Hugging Face folder (gathered on rank 0)."""
        paths = self._call("export_hf", [Path(folder)] * self.world_size, dtype=dtype)
        return Path(paths[0])

    # -- reference model -----------------------------------------------------------------

    def build_reference(self, model_path: str | Path, **kwargs: Any) -> RayReference:
        """Load a frozen reference policy on every rank (see ``ReferencePolicy``)."""
        config = {"model_path": str(model_path), **kwargs}
        self._call("build_reference", [config] * self.world_size, actor_method="build_reference")
        return RayReference(self)


class RayReference:
    """Reference-model log-probs computed by the trainer ranks (``attach`` for GRPOLoop)."""

    def __init__(self, group: RayTrainerGroup) -> None:
        self.group = group

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L]`` reference log-probs, rows split over ranks."""
        return self.group._gathered(batch, "reference_logprobs", actor_method="reference_logprobs")

    def attach(self, batch: TrainBatch) -> TrainBatch:
        """``batch`` with its ``ref_logprobs`` filled in."""
        return replace(batch, ref_logprobs=self.compute_logprobs(batch))


class RayCollectiveSync:
    """:class:`~turnrl.grpo_core.weight_sync.collective.CollectiveWeightSync` on every rank
    of a trainer group: each rank gathers its shards, rank 0 broadcasts them to the engines.

    Args:
        group: The trainer ranks.
        config: Engines and backend (``workers_per_engine=None`` asks each engine).
    """

    def __init__(self, group: RayTrainerGroup, config: CollectiveSyncConfig) -> None:
        self.group, self.config = group, config

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        """Send the group's weights as ``version`` (``trainer`` is the group itself); rank
        0's timings (``total_s``, ``transfer_s``, ``bytes``, ``buckets``, ``gb_per_s``)."""
        import asyncio

        call = self.group._call
        results = await asyncio.to_thread(
            call, "sync_weights", actor_method="sync_weights", config=self.config, version=version
        )
        return dict(results[0])

    async def close(self) -> None:
        """Leave the engines' transfer group."""
        import asyncio

        await asyncio.to_thread(
            self.group._call, "close_weight_sync", actor_method="close_weight_sync"
        )


def group_weight_sync(
    placement: PlacementConfig,
    group: RayTrainerGroup,
    urls: Sequence[str],
    sync_root: str | Path,
    keep_last: int = 1,
) -> WeightSync:
    """The weight sync of a Ray run (:mod:`~turnrl.grpo_core.weight_sync.choose`): a
    collective from the ranks on GPUs / NPUs whose engines have devices of their own, else
    disk under ``sync_root``."""
    # Ray's GPU / NPU / CPU read as npu-runtime's device names (resolve_device: gpu = cuda).
    backend = collective_backend(
        resolve_accelerator(placement.accelerator).lower(), placement.colocate
    )
    if backend is None:
        return DiskWeightSync(list(urls), sync_root, keep_last=keep_last)
    config = CollectiveSyncConfig(engine_urls=list(urls), backend=backend, workers_per_engine=None)
    return RayCollectiveSync(group, config)


def _gather_rows(
    batch: TrainBatch, parts: list[torch.Tensor], bounds: list[tuple[int, int]]
) -> torch.Tensor:
    """Place each rank's ``[rows, L_r]`` block back into a zero ``[B, L]`` tensor."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for (start, stop), part in zip(bounds, parts, strict=True):
        if stop > start:
            out[start:stop, : part.shape[1]] = part
    return out


def reduce_train_metrics(per_rank: list[dict[str, float]], tokens: list[int]) -> dict[str, float]:
    """One metrics dict from every rank's ``train_step`` metrics (see the module docstring).

    Args:
        per_rank: Each rank's metrics, in rank order.
        tokens: Each rank's loss tokens (the weights of the rank-local means).
    """
    out: dict[str, float] = {}
    weights = [float(t) for t in tokens]
    for key in per_rank[0]:
        values = [float(m[key]) for m in per_rank if key in m]
        if key in GROUP_METRICS:
            out[key] = float(per_rank[0][key])
        elif key == "step_time_s":
            out[key] = max(values)
        else:
            pairs = [
                (float(m[key]), w)
                for m, w in zip(per_rank, weights, strict=True)
                if w > 0 and key in m
            ]
            total = sum(w for _, w in pairs)
            out[key] = sum(v * w for v, w in pairs) / total if total > 0 else values[0]
    return out


class RayGRPORun:
    """Placement, trainer group and engines of one GRPO run on Ray; builds its GRPOLoop.

    Args:
        placement: Device counts and colocation of trainers and engines.
        trainer: The ``TorchEngineConfig`` every trainer rank builds.
        launch: What every engine serves (None: no engines, no weight sync).
        env: Variables set in every actor (e.g. ``OMP_NUM_THREADS``).
        ready_timeout_s: How long to wait for the cluster to grant the placement.
        call_timeout_s: Longest a trainer call may take (None: no limit).
    """

    def __init__(
        self,
        placement: PlacementConfig,
        trainer: Any,
        launch: EngineLaunch | None = None,
        *,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 60.0,
        call_timeout_s: float | None = None,
    ) -> None:
        self.placement = RayPlacement(placement, ready_timeout_s=ready_timeout_s, env=env)
        self.trainer_config, self.launch = trainer, launch
        self.call_timeout_s = call_timeout_s
        self.trainers: RayTrainerGroup | None = None
        self.engine_urls: list[str] = []

    def __enter__(self) -> RayGRPORun:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> RayGRPORun:
        """Reserve the placement, start and join the trainers, start the engines."""
        self.start_trainers()
        self.start_engines()
        return self

    def _reserve(self) -> None:
        if self.placement.pg is None:
            self.placement.start()

    def start_trainers(self, trainer: Any = None) -> RayTrainerGroup:
        """Reserve the placement if not yet, start and join the trainer ranks.

        Args:
            trainer: The ``TorchEngineConfig`` to build (default: the one given at init), e.g.
                a model that exists only once the engines are up (an SFT stage between).
        """
        if self.trainers is not None:
            raise RuntimeError("the trainers are already started")
        try:
            self._reserve()
            self.placement.start_trainers(trainer if trainer is not None else self.trainer_config)
            self.trainers = RayTrainerGroup(self.placement, self.call_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self.trainers

    def start_engines(self, cancel: threading.Event | None = None) -> list[str]:
        """Reserve the placement if not yet, start the engines (none without ``launch``).

        Raises:
            StartCancelled: ``cancel`` was set meanwhile (from another thread): the engines
                still starting are stopped at once, not waited for.
        """
        try:
            self._reserve()
            if self.launch is not None:
                self.engine_urls = self.placement.start_engines(self.launch, cancel)
        except BaseException as exc:
            # Cancelled: the engine actors are still busy starting, so they are killed at once.
            self.shutdown(grace_s=0 if isinstance(exc, StartCancelled) else 60.0)
            raise
        return self.engine_urls

    def restart_engine(self, url: str) -> None:
        """Start the engine serving at ``url`` again, on its node, port and devices; blocks
        until it is healthy (it serves the launch model until a weight sync reaches it)."""
        self.placement.restart_engine(self.engine_urls.index(url))

    def make_loop(
        self,
        config: LoopConfig,
        prompts: Sequence[Any],
        generate: GenerateFn,
        reward: RewardFn,
        *,
        pad_id: int,
        sync_root: str | Path | None = None,
        keep_last: int = 1,
        reference: Any = None,
        evaluate: EvalFn | None = None,
        on_metrics: MetricsFn | None = None,
        checkpoint_dir: str | Path | None = None,
        engine_busy: BusyFn | None = None,
        weight_updates: WeightUpdates | None = None,
    ) -> GRPOLoop:
        """A :class:`GRPOLoop` training with the trainer group, syncing the engines as
        :func:`group_weight_sync` chooses (a collective on devices, disk on the CPU or
        colocated; an :class:`~turnrl.grpo_core.loop.async_loop.AsyncGRPOLoop` when
        ``config.asynchronous``); colocated engines sleep while the ranks train
        (:class:`~turnrl.grpo_core.weight_sync.sleep.EngineSleep`).

        Args:
            config, prompts, generate, reward, pad_id, reference, evaluate, on_metrics,
                checkpoint_dir, engine_busy, weight_updates: As for :class:`GRPOLoop`
                (``reference`` may come from :meth:`RayTrainerGroup.build_reference`).
            sync_root: Folder of the exported weight versions (required with engines).
            keep_last: Exported versions kept on disk.
        """
        if self.trainers is None:
            raise RuntimeError("call RayGRPORun.start() first")
        weight_sync, engine_sleep = None, None
        if self.engine_urls:
            if sync_root is None:
                raise ValueError("the run has engines: give sync_root for the weight sync")
            weight_sync = group_weight_sync(
                self.placement.config, self.trainers, self.engine_urls, sync_root, keep_last
            )
            if self.placement.config.colocate:  # the engines sleep while the ranks train
                engine_sleep = EngineSleep(self.engine_urls)
        from turnrl.grpo_core.loop.async_loop import loop_class

        return loop_class(config)(
            config,
            self.trainers,
            prompts,
            generate,
            reward,
            weight_sync=weight_sync,
            pad_id=pad_id,
            reference=reference,
            evaluate=evaluate,
            on_metrics=on_metrics,
            checkpoint_dir=checkpoint_dir,
            engine_busy=engine_busy,
            engine_sleep=engine_sleep,
            weight_updates=weight_updates,
        )

    def shutdown(self, grace_s: float = 60.0) -> None:
        """Stop engines and trainers (each actor given ``grace_s``, then killed) and free the
        placement; safe to call twice."""
        self.placement.shutdown(grace_s)
        self.trainers, self.engine_urls = None, []
