"""ReTool episode settings from the app config, and the validation record.

The episodes themselves (run, score, per-problem accuracy) are turnrl-tool-envs'
:mod:`turnrl.tool_envs.retool.episodes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from turnrl.grpo_core.recipe.evaluation import evaluation_record
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams
from turnrl.tool_envs.retool.env import RetoolConfig
from turnrl.tool_envs.retool.episodes import EpisodeSettings
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


def validation_record(
    datasets: Mapping[str, Sequence[Trajectory]], seconds: float, reruns: int = 0
) -> dict[str, Any]:
    """``recipe.evaluation.evaluation_record`` of each dataset's episodes, by problem (its
    group): accuracy is the score (``correct``), ReTool's reward is averaged too. Episodes
    that ``failed`` (the sandbox or the engine, not the policy) are left out and counted.

    Raises:
        ValueError: no episodes.
        RuntimeError: every episode failed (the first error is named).
    """
    grouped: dict[str, list[list[Trajectory]]] = {}
    for source, trajectories in datasets.items():
        problems: dict[Any, list[Trajectory]] = {}
        for t in trajectories:
            problems.setdefault(t.group_id, []).append(t)
        grouped[source] = list(problems.values())

    def score(t: Trajectory) -> dict[str, float]:
        return {"score": t.reward_breakdown["correct"], "reward": t.reward}

    return evaluation_record(grouped, score, seconds, reruns)
