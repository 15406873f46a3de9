"""Where a rollout's time goes: episode time by part and the engines' busy fraction, as
each loop step logs them (real loop, tiny Qwen3 on the CPU, a stand-in engine clock)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from turnrl.grpo_core.loop import GRPOLoop, LoopConfig
from turnrl.grpo_core.loop.loop import busy_fractions, episode_time_metrics, rollout_metrics
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig


@dataclass
class Timed:
    """A sample with the fields the loop reads, plus episode timings."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    group_id: str | None = "g"
    reward: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


def _timed(generate: float, env: float, user: float, agent: float) -> Timed:
    total = generate + env + agent
    timings = {"generate": generate, "env": env, "user": user, "agent": agent, "total": total}
    return Timed([1, 2], [3, 4], [1, 1], [-1.0, -1.0], timings=timings)


def test_episode_time_metrics_average_each_part_and_the_outside_share() -> None:
    samples = [_timed(3.0, 1.0, 0.5, 0.0), _timed(1.0, 2.0, 1.5, 1.0)]
    metrics = episode_time_metrics(samples)
    assert metrics["rollout/time_generate_s"] == 2.0
    assert metrics["rollout/time_env_s"] == 1.5
    assert metrics["rollout/time_user_s"] == 1.0
    assert metrics["rollout/time_agent_s"] == 0.5
    assert metrics["rollout/outside_engine_frac"] == pytest.approx(4.0 / 8.0)
    assert "rollout/outside_engine_frac" in rollout_metrics(samples, seconds=1.0)


def test_samples_without_timings_add_no_time_metrics() -> None:
    bare = Timed([1], [2], [1], [-1.0])
    assert episode_time_metrics([bare]) == {}


def test_busy_fractions_per_engine_mean_and_min() -> None:
    before = {"a": 10.0, "b": 0.0}
    after = {"a": 14.0, "b": 1.0, "c": 2.0}  # c joined during the interval
    metrics = busy_fractions(before, after, seconds=4.0, prefix="rollout")
    assert metrics["rollout/engine_busy_frac"] == pytest.approx((1.0 + 0.25 + 0.5) / 3)
    assert metrics["rollout/engine_busy_frac_min"] == 0.25
    assert busy_fractions(before, after, seconds=0.0, prefix="perf") == {}


@pytest.mark.slow
async def test_the_loop_logs_the_engines_busy_fraction(tmp_path: Path) -> None:
    """The generate hook 'uses the engine' for 0.2 s of a rollout padded to ~0.4 s; the
    busy clock is read around each rollout and over each whole step."""
    busy = {"engine": 0.0}
    trainer = TorchEngine(TorchEngineConfig(model_path=str(build_tiny_model(tmp_path / "m"))))

    async def generate(prompts: list[list[int]], n: int) -> list[Timed]:
        await asyncio.sleep(0.2)  # the engine is busy ...
        busy["engine"] += 0.2
        await asyncio.sleep(0.2)  # ... then idle while the agent loop works
        return [_timed(0.2, 0.1, 0.0, 0.1) for _ in range(n)]

    async def reward(samples: list[Timed]) -> list[float]:
        return [float(i % 2) for i in range(len(samples))]

    config = LoopConfig(
        num_rollout=2, rollout_batch_size=1, n_samples_per_prompt=2, global_batch_size=2
    )
    busy["engine"] = 5.0  # busy time before the run (e.g. an evaluation) does not count
    loop = GRPOLoop(
        config,
        trainer,
        [[1, 2, 3]],
        generate,
        reward,
        weight_sync=None,
        pad_id=0,
        engine_busy=lambda: dict(busy),
    )
    history = await loop.run()
    for metrics in history:
        assert 0.4 < metrics["rollout/engine_busy_frac"] < 0.55
        step_frac = metrics["perf/engine_busy_frac"]
        assert 0.0 < step_frac < metrics["rollout/engine_busy_frac"]  # training time counts
        assert metrics["rollout/outside_engine_frac"] == pytest.approx(0.5)
