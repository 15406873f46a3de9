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
    over every episode, ``reward_stderr`` its standard error over tasks (each task's mean
    over its trials), ``shaped_reward`` the training reward (task reward plus tool-call
    bonuses, before the group normalisation); ``per_task_reward`` lists each task's mean
    (for a paired comparison of two evaluations of the same tasks).
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    loop = asyncio.get_running_loop()
    start = loop.time()
    items = [(task, f"eval-{i}", t) for i, task in enumerate(tasks) for t in range(trials)]
    trajs = await episodes.run(items, config)
    seconds = loop.time() - start
    scores = [score(t, shaped=True) for t in trajs]
    successes = [0] * len(tasks)
    for (task_index, _), (_, task_reward) in zip(
        ((i, t) for i in range(len(tasks)) for t in range(trials)), scores, strict=True
    ):
        successes[task_index] += int(task_reward == 1.0)
    n = len(trajs)
    failed = [t for t in trajs if t.status == "failed"]
    if failed:
        episodes.last_error = str(failed[0].metadata.get("error", "unknown error"))
    per_task = [c / trials for c in successes]
    metrics: dict[str, Any] = {
        "failed": len(failed) / n,
        "reward": sum(t for _, t in scores) / n,
        "reward_stderr": mean_and_stderr(per_task)[1],
        "success": sum(t for _, t in scores) / n,
        "shaped_reward": sum(s for s, _ in scores) / n,
        "num_turns": sum(t.num_turns for t in trajs) / n,
        "tool_calls": sum(t.num_tool_calls for t in trajs) / n,
        "invalid_tool_calls": sum(t.num_invalid_tool_calls for t in trajs) / n,
        "generated_tokens": float(sum(t.num_generated_tokens for t in trajs)),
        "tokens_per_s": sum(t.num_generated_tokens for t in trajs) / max(seconds, 1e-9),
        "seconds": seconds,
    }
    for k in range(1, trials + 1):
        metrics[f"pass^{k}"] = pass_hat_k(successes, trials, k)
    metrics["per_task_reward"] = per_task
    return metrics
