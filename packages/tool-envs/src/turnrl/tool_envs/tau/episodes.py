"""tau and tau2 episodes for a GRPO loop: the rollout hook and the reward hooks.

:class:`TauEpisodes` runs episodes against a token engine (a router over vLLM engines)
with one fresh :class:`TauEnv` (or :class:`Tau2Env`) and user per episode, at most
``max_inflight`` at once. Right after an episode, while its environment is alive, the
reward inputs (database hashes, required outputs, the agent's messages, tool-call counts)
go into the trajectory's ``metadata["tau"]``; the reward hooks then score them with
``turnrl.rewards``: :func:`task_rm` the 0/1 task reward, :func:`batched_tau_rm` vime's
shaping divided by the group maximum. An episode whose user simulator or NL judge failed
ends ``failed`` and scores nothing (an infrastructure fault, not the policy's outcome).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.rewards.tau import TauRewardInput, TauShapingConfig, normalize_by_group_max, tau_reward
from turnrl.rewards.tau2 import Tau2RewardInput, tau2_reward
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import TokenEngine, UserSimulator
from turnrl.tool_envs.rollout import RolloutConfig, run_episode
from turnrl.tool_envs.tau import Task, TauDomain, TauEnv
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain
from turnrl.tool_envs.tau.tau2.env import Tau2Env
from turnrl.tool_envs.trajectory import Trajectory

Judge = Callable[[list[dict[str, Any]], tuple[str, ...]], Awaitable[tuple[bool, ...]]]
"""tau2's NL-assertion judge: (conversation, assertions) -> verdicts."""

SHAPING = TauShapingConfig(per_successful_call=0.1, per_well_formed_call=0.05, cap=1.5)


@dataclass
class TauEpisodes:
    """Runs tau episodes; the loop's generate hook is :meth:`generate`."""

    engine: TokenEngine
    """Token-in/token-out engine or router."""
    chat: ChatTokenizer
    """The policy's tokenizer and chat template."""
    domain: TauDomain | Tau2Domain
    """Shared domain (data, tools, policy): tau-bench's or tau2-bench's."""
    tools: list[dict[str, Any]]
    """Tool schemas shown to the model."""
    config: RolloutConfig
    """Sampling, limits, in-flight cap."""
    user_factory: Callable[[], UserSimulator]
    """A fresh user simulator per episode."""
    judge: Judge | None = None
    """tau2: judges NL assertions where they gate a task's reward (none: such tasks are not run)."""

    async def episode(
        self,
        task: Any,
        group_id: str,
        index: int,
        config: RolloutConfig | None = None,
        session_id: str | None = None,
    ) -> Trajectory:
        """One episode of ``task``, its reward inputs in ``metadata["tau"]``; every engine
        request carries ``session_id`` (e.g. a rollout manager's, so it can abort them)."""
        env: TauEnv | Tau2Env
        if isinstance(self.domain, Tau2Domain):
            env = Tau2Env(self.domain, self.user_factory())
        else:
            env = TauEnv(self.domain, self.user_factory())
        env.tools = self.tools
        traj = await run_episode(
            self.engine,
            env,
            self.chat,
            task,
            config or self.config,
            group_id=group_id,
            sample_index=index,
            session_id=session_id,
        )
        if isinstance(env, Tau2Env):
            traj.metadata["tau"] = await self._tau2_inputs(env, traj)
        elif env.user_error is not None:  # the user simulator failed: unscored, not trained on
            traj.status = "failed"
            traj.metadata["error"] = env.user_error
        else:
            traj.metadata["tau"] = episode_reward_inputs(env)
        return traj

    async def _tau2_inputs(self, env: Tau2Env, traj: Trajectory) -> Tau2RewardInput | None:
        """The tau2 reward's input; the judge's verdicts when NL assertions gate the task. A
        judge that fails marks the episode failed (an infrastructure fault, never scored)."""
        task = env.task
        if task is None or traj.status == "failed":
            return None
        verdicts = None
        if task.needs_judge and env.ending == "user_stop":
            if self.judge is None:
                raise ValueError(f"tau2 task {task.id!r} needs an NL-assertion judge")
            try:
                verdicts = await self.judge(env.conversation, task.nl_assertions)
            except Exception as exc:
                traj.status = "failed"
                traj.metadata["error"] = f"NL judge: {type(exc).__name__}: {exc}"
                return None
        return env.reward_inputs(verdicts)

    async def run(
        self, tasks: Sequence[tuple[Task, str, int]], config: RolloutConfig | None = None
    ) -> list[Trajectory]:
        """Episodes of (task, group id, sample index), at most ``max_inflight`` at once."""
        cap = (config or self.config).max_inflight
        gate = asyncio.Semaphore(cap)

        async def one(task: Task, group: str, index: int) -> Trajectory:
            async with gate:
                return await self.episode(task, group, index, config)

        return list(await asyncio.gather(*(one(*item) for item in tasks)))

    async def generate(self, prompts: list[Any], n: int) -> list[Trajectory]:
        """The loop's rollout hook: ``n`` samples per task, one GRPO group per task."""
        items = [
            (task, f"task-{id(task):x}-{k}", s) for k, task in enumerate(prompts) for s in range(n)
        ]
        return await self.run(items)


def episode_reward_inputs(env: TauEnv) -> TauRewardInput | None:
    """The tau reward's input from a finished episode's environment (None: never reset)."""
    return None if env.task is None else env.reward_inputs()


def score(traj: Trajectory, shaped: bool) -> tuple[float, float]:
    """(reward, 0/1 task reward) of one episode; failed or reset-less episodes score 0."""
    inputs = traj.metadata.get("tau")
    if inputs is None or traj.status == "failed":
        return 0.0, 0.0
    if isinstance(inputs, Tau2RewardInput):  # tau2 has no shaping: the 0/1 reward both ways
        value = tau2_reward(inputs).reward
        return value, value
    result = tau_reward(inputs, SHAPING if shaped else None)
    task = float(result.breakdown.get("task_reward", result.reward))
    return float(result.reward), task


def _score_all(samples: list[Trajectory]) -> list[tuple[float, float]]:
    out = []
    for traj in samples:
        value, task = score(traj, shaped=True)
        traj.reward_breakdown = {"shaped": value, "task": task}
        out.append((value, task))
    return out


async def task_rm(samples: list[Trajectory]) -> list[float]:
    """tau-bench's 0/1 task reward, unshaped (pair it with group-normalised advantages)."""
    return [task for _, task in _score_all(samples)]


async def batched_tau_rm(samples: list[Trajectory]) -> list[float]:
    """vime's ``batched_tau_bench_rm``: shaped reward divided by its group's maximum."""
    groups: dict[str | None, list[int]] = defaultdict(list)
    raw = [value for value, _ in _score_all(samples)]
    for i, traj in enumerate(samples):
        groups[traj.group_id].append(i)
    out = list(raw)
    for members in groups.values():
        for i, value in zip(
            members, normalize_by_group_max([raw[i] for i in members]), strict=True
        ):
            out[i] = value
    return out


REWARDS = {"shaped-group-max": batched_tau_rm, "task": task_rm}
"""Reward hooks by ``--tau-reward`` name."""
