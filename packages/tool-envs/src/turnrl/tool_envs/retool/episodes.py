"""ReTool episodes: rollouts with the sandbox, their scoring, per-problem accuracy.

An episode is `turnrl.tool_envs.rollout.run_episode` with a `RetoolEnv` (the
`code_interpreter` tool backed by a sandbox client): a token-exact `Trajectory`. It is
scored by the last `\\boxed{}` of the final assistant message against the ground truth
(`turnrl.rewards.score_math`, strict `\\boxed{}` extraction) and rewarded with ReTool's
rule (+1 correct; -1 raised by 0.1 per tool round, at most -0.6).

Turns are counted as verl counts them for `val-aux/num_turns/mean` and for the reward's
tool rounds: the user prompt, every assistant turn and every block of tool results is one
turn, so a single code round then an answer is 4 turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.rewards import MathRewardConfig, RetoolRewardConfig, retool_reward, score_math
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import TokenEngine
from turnrl.tool_envs.retool.data import MathTask
from turnrl.tool_envs.retool.env import RetoolConfig, RetoolEnv
from turnrl.tool_envs.rollout import RolloutConfig, group_requests, run_episode, run_episodes
from turnrl.tool_envs.sandbox import SandboxClient
from turnrl.tool_envs.trajectory import Trajectory

MATH_SCORING = MathRewardConfig(mode="strict")


@dataclass
class EpisodeSettings:
    """What a batch of episodes needs besides the engine and the tasks."""

    chat: ChatTokenizer
    """Policy tokenizer and chat template."""
    sandbox: SandboxClient
    """The code interpreter's client."""
    env: RetoolConfig
    """ReTool episode settings (max turns, tool output limit)."""
    rollout: RolloutConfig
    """Sampling, token limits, in-flight cap."""
    tools_in_prompt: bool = True
    """Render the tool schema into the prompt (``data.tool_schema_in_prompt``)."""


def verl_num_turns(messages: Sequence[dict[str, Any]]) -> int:
    """Turns as verl counts them: user and assistant messages, a block of tool results as one."""
    turns, previous = 0, None
    for message in messages:
        role = message.get("role")
        if role == "system":
            continue
        if role != "tool" or previous != "tool":
            turns += 1
        previous = role
    return turns


def final_response(trajectory: Trajectory) -> str:
    """The content of the last assistant message ("" when there is none)."""
    for message in reversed(trajectory.messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def score_episode(trajectory: Trajectory, answer: str) -> tuple[bool, float]:
    """(correct, ReTool reward) of one episode; an episode that did not answer is wrong."""
    answered = trajectory.status == "completed" and not trajectory.metadata.get("error")
    correct = answered and score_math(final_response(trajectory), answer, MATH_SCORING).correct
    reward = retool_reward(
        correct,
        num_turns=verl_num_turns(trajectory.messages),
        num_tool_calls=trajectory.num_tool_calls,
        config=RetoolRewardConfig(),
    )
    return correct, reward.reward


def _env(settings: EpisodeSettings) -> RetoolEnv:
    env = RetoolEnv(settings.sandbox, settings.env)
    if not settings.tools_in_prompt:  # the tool still runs; its schema is just not shown
        env.tools = []
    return env


def _scored(traj: Trajectory, answer: str) -> Trajectory:
    correct, reward = score_episode(traj, answer)
    traj.reward = reward
    traj.reward_breakdown = {"correct": float(correct)}
    traj.metadata.update(answer=answer, num_turns_verl=verl_num_turns(traj.messages))
    return traj


async def run_task(
    engine: TokenEngine,
    settings: EpisodeSettings,
    task: MathTask,
    group_id: str,
    index: int,
    session_id: str | None = None,
) -> Trajectory:
    """One scored episode of ``task`` (as :func:`run_tasks` scores them); every engine
    request carries ``session_id`` (e.g. a rollout manager's, so it can abort them)."""
    traj = await run_episode(
        engine,
        _env(settings),
        settings.chat,
        task.as_task(),
        settings.rollout,
        group_id=group_id,
        sample_index=index,
        session_id=session_id,
    )
    return _scored(traj, str(task.answer))


async def run_tasks(
    engine: TokenEngine,
    settings: EpisodeSettings,
    tasks: Sequence[MathTask],
    n: int,
    group_prefix: str = "g",
) -> list[Trajectory]:
    """``n`` episodes of every task (one GRPO group per task), scored.

    Each trajectory gets ``reward``, ``reward_breakdown["correct"]`` and the task's answer in
    ``metadata["answer"]``.
    """
    requests = group_requests(
        [t.as_task() for t in tasks], n, [f"{group_prefix}-{i}" for i in range(len(tasks))]
    )

    trajectories = await run_episodes(
        engine, lambda: _env(settings), settings.chat, requests, settings.rollout
    )
    for request, traj in zip(requests, trajectories, strict=True):
        _scored(traj, str(request.task["answer"]))
    return trajectories


def per_problem_accuracy(trajectories: Sequence[Trajectory]) -> list[float]:
    """Each problem's (group's) fraction of correct samples, in order of first appearance."""
    groups: dict[Any, list[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t.reward_breakdown["correct"])
    return [sum(v) / len(v) for v in groups.values()]


def generations_text(
    trajectories: Sequence[Trajectory], chat: ChatTokenizer, limit: int = 4
) -> str:
    """A few validation episodes as text (for TensorBoard's text tab and the run folder)."""
    parts = []
    for t in trajectories[:limit]:
        body = chat.decode(t.ids)
        parts.append(
            f"### reward {t.reward:+.2f}, answer {t.metadata.get('answer')}, "
            f"status {t.status}\n\n```\n{body}\n```"
        )
    return "\n\n".join(parts)
