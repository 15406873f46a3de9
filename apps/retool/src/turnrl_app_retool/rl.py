"""The ReTool app's training engine and its RL stage (GRPO, or DAPO when the config asks).

:func:`run_rl_stage` drives ``turnrl.grpo_core.loop.GRPOLoop`` whose rollout is grpo-core's
``RolloutManager``: each step's groups (``rollout_batch_size`` prompts, or with DAPO's dynamic
sampling rounds of ``gen_batch_size`` more until enough groups vary,
:mod:`turnrl.tool_envs.dapo`) run as episodes with the sandbox, scored as they finish; a
dead engine's episodes re-run, leftovers are aborted. Then learn (advantages, policy update,
weights pushed to the engines). Rewards are ReTool's, plus DAPO's overlong penalty when
``rl.overlong_buffer_len > 0``. Each step is logged to the run folder and printed as one
console line with the number of groups the filter dropped.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.tool_envs.dapo import StepStats, filter_value, group_reward, overlong_config
from turnrl.tool_envs.math_data import MathTask
from turnrl.tool_envs.retool_episodes import run_task
from turnrl_app_retool.config import RetoolAppConfig

if TYPE_CHECKING:
    from turnrl.grpo_core.recipe.driver import Run

VERL_ALIASES = {
    "rollout/reward_mean": "critic/rewards/mean",
    "rollout/response_len_mean": "response_length/mean",
    "rollout/num_turns_mean": "num_turns/mean",
}
"""turnrl loop metric -> the verl name it is also logged under."""


def trainer_config(model_path: Path, config: RetoolAppConfig) -> Any:
    """The engine config of each RL trainer rank (``turnrl.grpo_core.recipe.schema``: torch
    FSDP2, or megatron with the parallelism flags) sampling as the rollouts do."""
    from turnrl.grpo_core.recipe.schema import trainer_config as shared

    return shared(config, model_path, temperature=config.rl.temperature, top_p=config.rl.top_p)


def step_line(step: int, metrics: dict[str, float], filtering: bool) -> str:
    """The console line of one RL step (reward, accuracy, groups filtered, seconds)."""
    line = (
        f"RL step {step}: reward {metrics['rollout/reward_mean']:+.3f}, "
        f"acc {metrics.get('rollout/acc_mean_all', 0.0):.3f}"
    )
    if filtering:
        line += (
            f", groups kept {metrics.get('rollout/groups_kept', 0.0):.0f} / "
            f"filtered {metrics.get('rollout/groups_filtered', 0.0):.0f} "
            f"in {metrics.get('rollout/sampling_rounds', 1.0):.0f} round(s)"
        )
        if metrics.get("rollout/filter_exhausted"):
            line += " (max rounds reached: short of informative groups)"
    else:
        line += (
            f", groups with equal rewards {metrics.get('rollout/groups_uniform', 0.0):.0f}"
            f" of {metrics.get('rollout/groups_generated', 0.0):.0f} (not filtered)"
        )
    if metrics.get("rollout/episode_retries"):
        line += f", {metrics['rollout/episode_retries']:.0f} episode(s) re-run"
    return line + f", {metrics.get('perf/step_s', 0.0):.1f}s"


async def run_rl_stage(
    run: Run[RetoolAppConfig],
    policy: Path,
    urls: list[str],
    router: Any,
    settings: Any,
    train: list[MathTask],
    job: Any = None,
    evaluate: Any = None,
) -> list[dict[str, float]]:
    """Stage 2: GRPO/DAPO steps with the sandbox in the loop; engines get each step's weights
    (through disk). Trains in this process, or on the Ray runner's trainer ranks (``job``, a
    ``RayGRPORun`` whose engines serve ``urls``); with the KL loss, against the frozen
    ``policy`` as reference. ``evaluate(step)`` runs every ``loop.eval_interval`` steps but
    the last (the evaluation after RL follows it). Checkpoints go to the run folder's
    ``checkpoints`` every ``loop.save_interval`` steps and after the last; a folder that
    already has one (a resumed run) continues from the latest (``RLStage``); the trained
    model is exported to ``model/rl``.

    Returns:
        Every step's metrics.
    """
    from turnrl.grpo_core.loop import RolloutManager, RolloutManagerConfig, keep_rewards
    from turnrl.grpo_core.recipe.driver import build_rl

    config, rl, num_rollout = run.config, run.config.rl, run.config.loop.num_rollout
    sampling = replace(settings.rollout.sampling, temperature=rl.temperature, top_p=rl.top_p)
    rl_settings = replace(settings, rollout=replace(settings.rollout, sampling=sampling))
    stats = StepStats()

    async def episode(task: MathTask, index: int, group: str, session: str) -> Any:
        return await run_task(router, rl_settings, task, group, index, session)

    overlong = overlong_config(
        rl.max_response_length, rl.overlong_buffer_len, rl.overlong_penalty_factor
    )
    manager = RolloutManager(
        episode,
        group_reward(overlong, stats),
        router,
        RolloutManagerConfig(
            max_concurrency=rl.max_inflight,
            dynamic_filter=rl.dynamic_sampling,
            over_sampling_batch_size=rl.gen_batch_size if rl.dynamic_sampling else None,
            max_sampling_rounds=rl.max_num_gen_batches,
            train_when_exhausted=True,
        ),
        filter_value=filter_value(rl.filter_metric),
    )

    async def during_rl(step: int) -> dict[str, float]:
        if evaluate is not None and step < num_rollout:
            await evaluate(step)  # logged as its own phase ("val"), not in the step's metrics
        return {}

    def line(step: int, metrics: dict[str, float]) -> str:
        metrics.update(stats.take())  # the same dict lands in the loop's history
        # Also under verl's names, so curves line up with a verl ReTool run.
        metrics.update(
            {name: metrics[ours] for ours, name in VERL_ALIASES.items() if ours in metrics}
        )
        return step_line(step, metrics, rl.dynamic_sampling)

    loop, stage = await build_rl(
        run,
        policy,
        train,
        manager.generate,
        keep_rewards,
        trainer=trainer_config(policy, config),
        router=router,
        urls=urls,
        job=job,
        temperature=rl.temperature,
        evaluate=during_rl,
        step_line=line,
    )
    manager.prompt_source = loop.data.next  # DAPO's extra rounds draw from the loop's data
    history = await stage.run(loop)
    loop.trainer.export_hf(run.folder / "model" / "rl")
    return history
