"""DAPO in the RL stage: the config/CLI switches (including bad values); its console line
is grpo-core's ``format_step_line``.
The shaping and filter values are tool-envs' (``turnrl.tool_envs.retool.dapo``), the filter
grpo-core's RolloutManager (their tests, and the app's vllm smoke run)."""

from __future__ import annotations

import pytest
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.config import preset


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


def test_async_acts_without_dynamic_sampling_and_is_refused_with_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The asynchronous loop draws one group per call; DAPO's filter needs extra groups
    within a step, so the two together are refused, naming both flags."""
    config, _ = resolve(["--async", "--no-dynamic-sampling"])
    assert config.loop.asynchronous and not config.rl.dynamic_sampling
    from turnrl.grpo_core.recipe.schema import loop_config

    assert loop_config(config).asynchronous  # what build_rl builds: an AsyncGRPOLoop
    with pytest.raises(SystemExit):
        resolve(["--async"])  # cpu-default filters
    err = capsys.readouterr().err
    assert "--async with --dynamic-sampling" in err and "--no-dynamic-sampling" in err
