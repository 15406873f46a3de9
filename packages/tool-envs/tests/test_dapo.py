"""DAPO on scored episodes: overlong shaping (model tokens only), what the dynamic sampling
filter compares, and the per-step counts. The filter itself is grpo-core's RolloutManager
(its tests, and apps/retool's vllm smoke run)."""

from __future__ import annotations

import pytest

from turnrl.tool_envs.retool.dapo import (
    StepStats,
    filter_value,
    group_reward,
    overlong_config,
    shaped_rewards,
)
from turnrl.tool_envs.trajectory import Trajectory


def episode(group: str, correct: bool, model_tokens: int = 4, tool_tokens: int = 2) -> Trajectory:
    """A scored ReTool-like trajectory: ``model_tokens`` policy tokens then tool tokens."""
    mask = [1] * model_tokens + [0] * tool_tokens
    t = Trajectory(
        prompt_ids=[1, 2],
        response_ids=[5] * len(mask),
        loss_mask=mask,
        rollout_logprobs=[-0.5 * m for m in mask],
        group_id=group,
    )
    t.reward = 1.0 if correct else -0.9
    t.reward_breakdown = {"correct": float(correct)}
    return t


def test_overlong_penalty_counts_model_tokens_only() -> None:
    config = overlong_config(100, 20, 0.5)
    short = episode("g", True, model_tokens=80, tool_tokens=500)  # tool output is not the model's
    ramp = episode("g", True, model_tokens=90)
    over = episode("g", False, model_tokens=130)
    assert shaped_rewards([short, ramp, over], config) == pytest.approx([1.0, 0.75, -1.4])
    assert ramp.reward_breakdown["overlong"] == pytest.approx(-0.25)


def test_overlong_off_leaves_rewards_alone() -> None:
    assert overlong_config(100, 0, 1.0) is None
    samples = [episode("g", True, model_tokens=10_000), episode("g", False)]
    assert shaped_rewards(samples, None) == [1.0, -0.9]


def test_filter_values_and_step_stats() -> None:
    samples = [episode("a", True), episode("a", False), episode("b", False), episode("b", False)]
    samples[3].reward = -0.8  # same accuracy, a different tool-use reward
    assert [filter_value("acc")(s) for s in samples] == [1.0, 0.0, 0.0, 0.0]
    assert [filter_value("reward")(s) for s in samples] == [1.0, -0.9, -0.9, -0.8]
    stats = StepStats()
    stats.add(samples[:2])
    stats.add(samples[2:])
    taken = stats.take()
    assert taken["rollout/acc_mean_all"] == 0.25
    assert taken["rollout/reward_mean_all"] == pytest.approx((1.0 - 0.9 - 0.9 - 0.8) / 4)
    assert stats.take()["rollout/acc_mean_all"] == 0.0  # each step counts afresh
    with pytest.raises(ValueError, match="filter metric"):
        filter_value("score")


async def test_the_group_reward_shapes_sets_and_counts() -> None:
    stats = StepStats()
    group = [episode("g", True, model_tokens=130), episode("g", True)]
    assert await group_reward(overlong_config(100, 20, 1.0), stats)(group) == pytest.approx(
        [0.0, 1.0]
    )
    assert [s.reward for s in group] == pytest.approx([0.0, 1.0])  # what the filter sees
    taken = stats.take()
    assert taken["rollout/overlong_frac"] == 0.5 and taken["rollout/reward_mean_all"] == 0.5


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"filter_metric": "score"}, "filter_metric"),
        ({"gen_batch_size": 0}, "gen_batch_size"),
        ({"max_num_gen_batches": 0}, "max_num_gen_batches"),
        ({"overlong_buffer_len": -1}, "overlong_buffer_len"),
        ({"overlong_penalty_factor": -0.5}, "overlong_penalty_factor"),
    ],
)
def test_bad_dapo_settings_are_refused_naming_the_setting(settings: dict, message: str) -> None:
    from turnrl.tool_envs.retool.dapo import DapoConfig

    with pytest.raises(ValueError, match=message):
        DapoConfig(**settings)
    assert DapoConfig(dynamic_sampling=True, gen_batch_size=24).gen_batch_size == 24


def test_dapo_switches_the_loop_cannot_honour_are_refused() -> None:
    from turnrl.tool_envs.retool.dapo import DapoConfig

    dynamic = DapoConfig(dynamic_sampling=True)
    dynamic.check_loop(n_samples_per_prompt=8, asynchronous=False, max_response=256)
    with pytest.raises(ValueError, match="--async with --dynamic-sampling"):
        dynamic.check_loop(8, asynchronous=True, max_response=256)
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        dynamic.check_loop(1, asynchronous=False, max_response=256)
    DapoConfig().check_loop(1, asynchronous=True, max_response=256)  # no filter: any loop
    with pytest.raises(ValueError, match=r"overlong_buffer_len must be in \[0, max_response"):
        DapoConfig(overlong_buffer_len=300).check_loop(8, False, max_response=256)
