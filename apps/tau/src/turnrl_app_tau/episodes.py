"""Held-out evaluation of tau episodes: task reward, pass^k and their standard errors.

The episodes themselves (rollout hook, reward hooks) are turnrl-tool-envs'
:mod:`turnrl.tool_envs.tau_episodes`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from turnrl.grpo_core.recipe.evaluation import mean_and_stderr, pass_hat_k
from turnrl.tool_envs.rollout import RolloutConfig
from turnrl.tool_envs.tau import Task
from turnrl.tool_envs.tau_episodes import TauEpisodes, score


async def evaluate(
    episodes: TauEpisodes, tasks: Sequence[Task], trials: int, config: RolloutConfig
) -> dict[str, Any]:
    """Every task ``trials`` times: task reward, pass^k, shaped reward, turns, tool calls, tokens/s.

    ``reward`` is tau-bench's 0/1 task reward (database hash and required outputs) averaged
    over the episodes, ``reward_stderr`` its standard error over tasks (each task's mean
    over its trials), ``shaped_reward`` the training reward (task reward plus tool-call
    bonuses, before the group normalisation); ``per_task_reward`` lists each task's mean
    (for a paired comparison of two evaluations of the same tasks). An episode that failed
    outside the policy (engine, user simulator, judge) is left out of every score and
    counted in ``failed`` (a fraction); a task whose every trial failed leaves the lists.

    Raises:
        ValueError: ``trials`` < 1.
        RuntimeError: every episode failed (the first error named).
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    loop = asyncio.get_running_loop()
    start = loop.time()
    items = [(task, f"eval-{i}", t) for i, task in enumerate(tasks) for t in range(trials)]
    trajs = await episodes.run(items, config)
    seconds = loop.time() - start
    failed = [t for t in trajs if t.status == "failed"]
    if failed:
        episodes.last_error = str(failed[0].metadata.get("error", "unknown error"))
    if len(failed) == len(trajs):
        raise RuntimeError(f"every held-out episode failed, e.g. {episodes.last_error}")
    done: list[list[float]] = [[] for _ in tasks]  # each task's task rewards, failures left out
    kept, shaped = [], []
    for index, traj in enumerate(trajs):  # items run task by task, ``trials`` each
        if traj.status != "failed":
            shaped_reward, task_reward = score(traj, shaped=True)
            done[index // trials].append(task_reward)
            kept.append(traj)
            shaped.append(shaped_reward)
    per_task = [sum(r) / len(r) for r in done if r]
    n = len(kept)
    metrics: dict[str, Any] = {
        "failed": len(failed) / len(trajs),
        "reward": sum(sum(r) for r in done) / n,
        "reward_stderr": mean_and_stderr(per_task)[1],
        "shaped_reward": sum(shaped) / n,
        "num_turns": sum(t.num_turns for t in kept) / n,
        "tool_calls": sum(t.num_tool_calls for t in kept) / n,
        "invalid_tool_calls": sum(t.num_invalid_tool_calls for t in kept) / n,
        "generated_tokens": float(sum(t.num_generated_tokens for t in trajs)),
        "tokens_per_s": sum(t.num_generated_tokens for t in trajs) / max(seconds, 1e-9),
        "seconds": seconds,
    }
    metrics["success"] = metrics["reward"]
    if whole := [int(sum(r)) for r in done if len(r) == trials]:  # pass^k: no trial failed
        metrics.update({f"pass^{k}": pass_hat_k(whole, trials, k) for k in range(1, trials + 1)})
    metrics["per_task_reward"] = per_task
    return metrics
