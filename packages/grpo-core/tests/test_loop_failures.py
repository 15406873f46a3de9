"""Infrastructure failures are not training labels: a ``failed`` sample (a user simulator
that gave up, an unreachable sandbox) changes nothing of what the real loop trains, is left
out of group statistics and of the reward mean, and is counted per reason (CPU, tiny Qwen3).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from turnrl.grpo_core.loop import GRPOLoop, LoopConfig
from turnrl.grpo_core.loop.loop import failure_reason, rollout_metrics
from turnrl.grpo_core.loop.rollout_manager import Rollout
from turnrl.grpo_core.testing.golden import ToySample
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig

PROMPT = [1, 40, 90]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def _sample(i: int, **extra: object) -> ToySample:
    response = [100 + i, 200 + i, 300 + i]
    return ToySample(PROMPT, response, [1, 1, 1], [-1.0, -1.0, -1.0], "g", **extra)  # type: ignore[arg-type]


def _failed(error: str) -> ToySample:
    return _sample(9, status="failed", metadata={"error": error})


def test_failure_reason_is_the_exception_type_of_a_failed_sample() -> None:
    assert failure_reason(_sample(0)) is None
    assert failure_reason(_sample(0, status="truncated")) is None  # the policy's own outcome
    assert failure_reason(_failed("UserSimulatorError: gave up after 3 tries")) == (
        "UserSimulatorError"
    )
    assert failure_reason(_failed("")) == "unknown"
    assert failure_reason(_sample(0, status="failed")) == "unknown"


async def _one_step(
    folder: Path, extra: list[ToySample], managed: dict[str, float] | None = None
) -> tuple[dict[str, float], dict]:
    trainer = TorchEngine(
        TorchEngineConfig(model_path=str(folder), seed=0, optimizer=OptimizerConfig(lr=1e-2))
    )

    async def generate(prompts: list[list[int]], n: int) -> list[ToySample]:
        samples = [_sample(i) for i in range(n)] + extra
        return samples if managed is None else Rollout(samples, managed)

    async def reward(samples: list[ToySample]) -> list[float]:
        # what a reward function gives an episode that never ended: 0
        return [REWARDS[i] if i < len(REWARDS) else 0.0 for i in range(len(samples))]

    config = LoopConfig(
        num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=4, global_batch_size=4, seed=0
    )
    loop = GRPOLoop(config, trainer, [PROMPT], generate, reward, weight_sync=None, pad_id=0)
    metrics = (await loop.run())[0]
    return metrics, {k: v.clone() for k, v in trainer.hf_model.state_dict().items()}


@pytest.mark.slow
async def test_a_failed_episode_changes_nothing_that_is_trained(tmp_path: Path, caplog) -> None:
    folder = build_tiny_model(tmp_path / "tiny")
    errors = ["UserSimulatorError: litellm: connection refused", "SandboxUnavailable: down"]
    with caplog.at_level(logging.WARNING, logger="turnrl.grpo_core.loop.loop"):
        with_failures, after = await _one_step(folder, [_failed(e) for e in errors])
    clean, after_clean = await _one_step(folder, [])
    assert with_failures["rollout/failed/UserSimulatorError"] == 1.0
    assert with_failures["rollout/failed/SandboxUnavailable"] == 1.0
    assert with_failures["rollout/failed_frac"] == pytest.approx(2 / 6)
    assert with_failures["rollout/reward_mean"] == clean["rollout/reward_mean"] == 0.5
    for key in ("train/advantage_abs_mean", "train/pg_loss"):
        assert with_failures[key] == clean[key], key
    for name, tensor in after.items():  # bit for bit the step without the failed samples
        assert torch.equal(tensor, after_clean[name]), name
    logged = [r.getMessage() for r in caplog.records if "left out of training" in r.getMessage()]
    assert len(logged) == 2 and "connection refused" in logged[0]


def test_rollout_metrics_count_each_failure_reason() -> None:
    samples = [_sample(0, reward=1.0), _failed("TimeoutError: x"), _failed("TimeoutError: y")]
    metrics = rollout_metrics(samples, seconds=1.0)
    assert metrics["rollout/failed/TimeoutError"] == 2.0
    assert metrics["rollout/reward_mean"] == 1.0


@pytest.mark.slow
async def test_a_rollout_managers_metrics_are_logged_with_its_step(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "tiny")
    managed = {"rollout/episode_retries": 2.0, "rollout/groups_kept": 1.0}
    metrics, _ = await _one_step(folder, [], managed)
    assert metrics["rollout/episode_retries"] == 2.0 and metrics["rollout/groups_kept"] == 1.0
    plain, _ = await _one_step(folder, [])
    assert "rollout/episode_retries" not in plain
