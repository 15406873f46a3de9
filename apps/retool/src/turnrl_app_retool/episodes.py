"""ReTool episode settings from the app config, and validation metrics (verl's names).

The episodes themselves (run, score, per-problem accuracy) are turnrl-tool-envs'
:mod:`turnrl.tool_envs.retool_episodes`.
"""

from __future__ import annotations

from collections.abc import Sequence

from turnrl.grpo_core.recipe.evaluation import mean_and_stderr
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams
from turnrl.tool_envs.retool import RetoolConfig
from turnrl.tool_envs.retool_episodes import EpisodeSettings, per_problem_accuracy
from turnrl.tool_envs.rollout import RolloutConfig
from turnrl.tool_envs.sandbox import SandboxClient
from turnrl.tool_envs.trajectory import Trajectory, TrajectoryLimits
from turnrl_app_retool.config import RetoolAppConfig


def episode_settings(
    config: RetoolAppConfig,
    chat: ChatTokenizer,
    sandbox: SandboxClient,
    temperature: float,
    top_p: float,
    seed: int | None = None,
) -> EpisodeSettings:
    """Episode settings from the app config, with the given sampling temperature / top-p."""
    rl, box = config.rl, config.sandbox
    env = RetoolConfig(
        max_turns=rl.max_turns,
        run_timeout=box.run_timeout,
        memory_limit_mb=box.memory_limit_mb,
        max_tool_output_chars=box.max_tool_output_chars,
    )
    limits = TrajectoryLimits(
        max_context_tokens=rl.max_prompt_length + rl.max_response_length,
        max_turn_tokens=rl.max_turn_tokens,
        max_turns=rl.max_turns,
        max_tool_output_tokens=min(512, rl.max_response_length),
    )
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=rl.max_turn_tokens, seed=seed
    )
    rollout = RolloutConfig(sampling=sampling, limits=limits, max_inflight=rl.max_inflight)
    return EpisodeSettings(chat, sandbox, env, rollout, config.data.tool_schema_in_prompt)


def summarize(trajectories: Sequence[Trajectory], data_source: str, n: int) -> dict[str, float]:
    """verl-named validation metrics of one dataset's episodes.

    Episodes that ``failed`` (the sandbox or the engine, not the policy) are left out of
    every mean and counted in ``val-aux/{data_source}/failed_episodes``.

    Raises:
        ValueError: no episodes.
        RuntimeError: every episode failed (the first error is named).
    """
    if not trajectories:
        raise ValueError(f"no episodes to summarize for {data_source}")
    failed = [t for t in trajectories if t.status == "failed"]
    trajectories = [t for t in trajectories if t.status != "failed"]
    if not trajectories:
        raise RuntimeError(
            f"every {data_source} episode failed, e.g. {failed[0].metadata.get('error')}"
        )
    count = len(trajectories)

    def mean(values: Sequence[float]) -> float:
        return float(sum(values) / len(values))

    generated = sum(t.num_generated_tokens for t in trajectories)
    _, stderr = mean_and_stderr(per_problem_accuracy(trajectories))
    seconds = max((t.timings.get("generate", 0.0) for t in trajectories), default=0.0)
    return {
        f"val-core/{data_source}/acc/mean@{n}": mean(
            [t.reward_breakdown["correct"] for t in trajectories]
        ),
        f"val-core/{data_source}/reward/mean@{n}": mean([t.reward for t in trajectories]),
        f"val-aux/{data_source}/acc/stderr@{n}": stderr,
        "val-aux/num_turns/mean": mean([float(t.metadata["num_turns_verl"]) for t in trajectories]),
        "val-aux/tool_calls/mean": mean([float(t.num_tool_calls) for t in trajectories]),
        "val-aux/response_length/mean": mean([float(len(t.response_ids)) for t in trajectories]),
        "val-aux/completed_frac": mean([float(t.status == "completed") for t in trajectories]),
        "val-aux/generated_tokens": float(generated),
        "val-aux/num_episodes": float(count),
        f"val-aux/{data_source}/failed_episodes": float(len(failed)),
        "val-aux/generate_seconds_max": seconds,
    }
