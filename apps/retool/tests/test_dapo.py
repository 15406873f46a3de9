"""DAPO in the RL stage: overlong shaping, what the dynamic sampling filter compares, the
per-step group counts and console lines, and the config/CLI switches (including bad values).
The filter itself is grpo-core's RolloutManager (its tests, and the app's vllm smoke run)."""

from __future__ import annotations

import pytest
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.config import RLStageConfig, preset
from turnrl_app_retool.dapo import (
    StepStats,
    filter_value,
    group_reward,
    overlong_config,
    shaped_rewards,
)
from turnrl_app_retool.rl import step_line

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
    rl = RLStageConfig(max_response_length=100, overlong_buffer_len=20, overlong_penalty_factor=0.5)
    config = overlong_config(rl)
    short = episode("g", True, model_tokens=80, tool_tokens=500)  # tool output is not the model's
    ramp = episode("g", True, model_tokens=90)
    over = episode("g", False, model_tokens=130)
    assert shaped_rewards([short, ramp, over], config) == pytest.approx([1.0, 0.75, -1.4])
    assert ramp.reward_breakdown["overlong"] == pytest.approx(-0.25)


def test_overlong_off_leaves_rewards_alone() -> None:
    assert overlong_config(RLStageConfig()) is None
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
    rl = RLStageConfig(max_response_length=100, overlong_buffer_len=20)
    stats = StepStats()
    group = [episode("g", True, model_tokens=130), episode("g", True)]
    assert await group_reward(rl, stats)(group) == pytest.approx([0.0, 1.0])
    assert [s.reward for s in group] == pytest.approx([0.0, 1.0])  # what the filter sees
    taken = stats.take()
    assert taken["rollout/overlong_frac"] == 0.5 and taken["rollout/reward_mean_all"] == 0.5


def test_step_lines_say_what_the_filter_did() -> None:
    exhausted = {
        "rollout/reward_mean": -0.9,
        "rollout/groups_kept": 1.0,
        "rollout/groups_filtered": 6.0,
        "rollout/sampling_rounds": 3.0,
        "rollout/filter_exhausted": 1.0,
        "rollout/episode_retries": 2.0,
    }
    line = step_line(1, exhausted, filtering=True)
    assert "kept 1 / filtered 6 in 3 round(s)" in line and "max rounds reached" in line
    assert "2 episode(s) re-run" in line
    plain = {"rollout/reward_mean": 0.1, "rollout/groups_uniform": 3, "rollout/groups_generated": 8}
    assert "equal rewards 3 of 8 (not filtered)" in step_line(2, plain, filtering=False)


def test_dapo_presets_and_flags() -> None:
    for name in ("qwen3-4b-npu", "qwen3-4b-gpu"):
        config = preset(name)
        rl = config.rl
        assert rl.dynamic_sampling and rl.filter_metric == "acc" and rl.overlong_buffer_len == 4096
        assert rl.gen_batch_size == 3 * config.loop.rollout_batch_size
    assert not preset("qwen2.5-7b-npu").rl.dynamic_sampling  # GRPO with the rule reward
    config, _ = resolve(
        [
            "--dynamic-sampling",
            "--filter-metric",
            "reward",
            "--gen-batch-size",
            "16",
            "--overlong-buffer-len",
            "64",
            "--max-num-gen-batches",
            "2",
        ]
    )
    rl = config.rl
    assert rl.dynamic_sampling and rl.filter_metric == "reward" and rl.gen_batch_size == 16
    assert (rl.overlong_buffer_len, rl.max_num_gen_batches) == (64, 2)
    off, _ = resolve(["--preset", "qwen3-4b-npu", "--no-dynamic-sampling"])
    assert not off.rl.dynamic_sampling


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--filter-metric", "score"], "filter_metric"),
        (["--gen-batch-size", "0"], "gen_batch_size"),
        (["--max-num-gen-batches", "0"], "max_num_gen_batches"),
        (
            ["--dynamic-sampling", "--n-samples-per-prompt", "1", "--global-batch-size", "8"],
            "n_samples_per_prompt >= 2",
        ),
        (["--overlong-buffer-len", "100000"], "overlong_buffer_len"),
        (["--overlong-penalty-factor", "-1"], "overlong_penalty_factor"),
    ],
)
def test_bad_dapo_settings_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        resolve(flags)
    assert message in capsys.readouterr().err
