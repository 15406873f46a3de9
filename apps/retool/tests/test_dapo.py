"""DAPO in the RL stage: overlong shaping, the dynamic sampling filter over GRPOLoop.collect,
the per-step group counts, and the config/CLI switches (including bad values)."""

from __future__ import annotations

import pytest
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.config import RLStageConfig, preset
from turnrl_app_retool.dapo import (
    collect_informative,
    filter_values,
    group_stats,
    overlong_config,
    shaped_rewards,
)
from turnrl_app_retool.rl import step_line

from turnrl.grpo_core.loop import GRPOLoop, LoopConfig
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


def test_filter_values_and_group_stats() -> None:
    samples = [episode("a", True), episode("a", False), episode("b", False), episode("b", False)]
    samples[3].reward = -0.8  # same accuracy, a different tool-use reward
    assert filter_values(samples, "acc") == [1.0, 0.0, 0.0, 0.0]
    assert group_stats(samples, "acc")["rollout/dynamic_sampling/filtered_groups"] == 1.0
    stats = group_stats(samples, "reward")
    assert stats["rollout/dynamic_sampling/informative_groups"] == 2.0
    assert stats["rollout/acc_mean_all"] == 0.25
    with pytest.raises(ValueError, match="filter metric"):
        filter_values(samples, "score")


def scripted_loop(solvable: set[int], rl: RLStageConfig) -> tuple[GRPOLoop, list[list[int]]]:
    """A real GRPOLoop whose generate hook answers prompt p correctly on even samples when
    p is in ``solvable`` and never otherwise (all-wrong groups carry no signal)."""
    calls: list[list[int]] = []

    async def generate(prompts: list[int], n: int) -> list[Trajectory]:
        calls.append(list(prompts))
        return [
            episode(f"r{len(calls)}-{i}", p in solvable and k % 2 == 0)
            for i, p in enumerate(prompts)
            for k in range(n)
        ]

    async def reward(samples: list[Trajectory]) -> list[float]:
        return [s.reward for s in samples]

    config = LoopConfig(
        rollout_batch_size=rl.rollout_batch_size,
        n_samples_per_prompt=rl.n_samples_per_prompt,
        global_batch_size=4,
    )
    loop = GRPOLoop(config, None, list(range(12)), generate, reward, weight_sync=None, pad_id=0)
    return loop, calls


async def test_dynamic_sampling_refills_until_enough_informative_groups() -> None:
    rl = RLStageConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, dynamic_sampling=True, gen_batch_size=3
    )
    loop, calls = scripted_loop({1, 4, 5}, rl)
    kept, seconds, stats = await collect_informative(loop, rl)
    assert len(calls) == 2 and len(calls[0]) == 3  # round 1 finds one, round 2 the second
    assert sorted({s.group_id for s in kept}) == ["r1-1", "r2-1"] and len(kept) == 4
    assert stats["rollout/dynamic_sampling/gen_batches"] == 2.0
    assert stats["rollout/dynamic_sampling/generated_groups"] == 6.0
    assert stats["rollout/dynamic_sampling/filtered_groups"] == 3.0  # prompts 0, 2 and 3
    assert stats["rollout/dynamic_sampling/kept_groups"] == 2.0
    assert stats["rollout/dynamic_sampling/exhausted"] == 0.0 and seconds >= 0.0


async def test_dynamic_sampling_gives_up_after_max_rounds_and_trains_what_it_has() -> None:
    rl = RLStageConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, dynamic_sampling=True, max_num_gen_batches=3
    )
    loop, calls = scripted_loop(set(), rl)  # nothing solvable: every group is filtered
    kept, _, stats = await collect_informative(loop, rl)
    assert len(calls) == 3
    assert stats["rollout/dynamic_sampling/exhausted"] == 1.0
    assert len({s.group_id for s in kept}) == 2  # a step's worth of (zero-advantage) groups
    line = step_line(1, {"rollout/reward_mean": -0.9, **stats})
    assert "filtered 6" in line and "3 round(s)" in line and "max rounds reached" in line


def test_dapo_presets_and_flags() -> None:
    for name in ("qwen3-4b-npu", "qwen3-4b-gpu"):
        rl = preset(name).rl
        assert rl.dynamic_sampling and rl.filter_metric == "acc" and rl.overlong_buffer_len == 4096
        assert rl.gen_batch_size == 3 * rl.rollout_batch_size
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
