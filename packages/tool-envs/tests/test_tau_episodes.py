"""tau episodes for a GRPO loop: the rollout hook runs gold turns to reward 1, the reward
hooks score groups, and a user-simulator outage fails an episode unscored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from turnrl.rewards.tau import TauRewardInput
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams
from turnrl.tool_envs.rollout import RolloutConfig
from turnrl.tool_envs.tau.episodes import REWARDS, TauEpisodes, batched_tau_rm, task_rm
from turnrl.tool_envs.tau.gold import TaskUser, gold_conversation
from turnrl.tool_envs.tau.synth import generate
from turnrl.tool_envs.tool_calls import from_openai_tool_calls, render_tool_call
from turnrl.tool_envs.trajectory import Trajectory, TrajectoryLimits

ONE_AT_A_TIME = RolloutConfig(  # episodes in order, so a scripted engine can play their turns
    sampling=SamplingParams(temperature=0.0, max_tokens=256),
    limits=TrajectoryLimits(max_context_tokens=8192, max_turn_tokens=256, max_turns=8),
    max_inflight=1,
)


def assistant_turns(conversation: list[dict[str, Any]]) -> list[str]:
    """The conversation's assistant turns as the model writes them (Hermes tool calls)."""
    turns = []
    for message in conversation:
        if message["role"] == "assistant":
            calls = from_openai_tool_calls(message.get("tool_calls") or []).tool_calls
            parts = [message.get("content") or "", *(render_tool_call(c) for c in calls)]
            turns.append("\n".join(p for p in parts if p))
    return turns


async def test_gold_turns_earn_reward_one_in_groups(
    qwen3: ChatTokenizer, make_engine: Callable[..., Any]
) -> None:
    synthetic = generate(seed=5, num_tasks=4)
    domain, tasks = synthetic.domain(), synthetic.tasks[:2]
    turns = [
        turn
        for task in tasks
        for _ in range(2)  # two samples per task, one after the other
        for turn in assistant_turns(gold_conversation(domain, task, synthetic.wiki))
    ]
    episodes = TauEpisodes(make_engine(turns), qwen3, domain, [], ONE_AT_A_TIME, TaskUser)
    trajs = await episodes.generate(tasks, 2)
    assert [t.status for t in trajs] == ["completed"] * 4
    assert trajs[0].group_id == trajs[1].group_id != trajs[2].group_id == trajs[3].group_id
    assert all(isinstance(t.metadata["tau"], TauRewardInput) for t in trajs)
    assert await task_rm(trajs) == [1.0] * 4
    assert await batched_tau_rm(trajs) == [1.0] * 4  # divided by the group maximum
    assert trajs[0].reward_breakdown["shaped"] > 1.0  # tool-call bonuses before the division


async def test_a_failing_user_fails_the_episode_unscored(
    qwen3: ChatTokenizer, make_engine: Callable[..., Any]
) -> None:
    class DownUser(TaskUser):
        async def respond(self, agent_message: str) -> str:
            raise ConnectionError("user model unreachable")

    synthetic = generate(seed=5, num_tasks=4)
    domain, task = synthetic.domain(), synthetic.tasks[0]
    turns = assistant_turns(gold_conversation(domain, task, synthetic.wiki))
    episodes = TauEpisodes(make_engine(turns), qwen3, domain, [], ONE_AT_A_TIME, DownUser)
    trajs = await episodes.run([(task, "g", 0)])
    assert trajs[0].status == "failed"
    assert "user model unreachable" in str(trajs[0].metadata["error"])
    assert await batched_tau_rm(trajs) == [0.0]


async def test_reward_hooks_normalise_by_group_max_and_skip_failures() -> None:
    def traj(group: str, hashes: tuple[str, str], calls: int) -> Trajectory:
        t = Trajectory([1], [2], [1], [-0.1], group_id=group)
        t.metadata["tau"] = TauRewardInput(
            final_data_hash=hashes[0],
            gt_data_hash=hashes[1],
            num_well_formed_tool_calls=calls,
            num_successful_tool_calls=calls,
        )
        return t

    samples = [
        traj("a", ("x", "x"), 0),
        traj("a", ("x", "y"), 2),
        traj("b", ("x", "y"), 0),
        traj("b", ("x", "y"), 0),
        Trajectory([], [], [], [], status="failed", group_id="c"),
    ]
    rewards = await batched_tau_rm(samples)
    assert rewards[0] == 1.0 and rewards[1] == pytest.approx(0.3)
    assert rewards[2:] == [0.0, 0.0, 0.0]
    assert samples[1].reward_breakdown == {"shaped": pytest.approx(0.3), "task": 0.0}
    # The unshaped choice: the 0/1 task reward only, tool-call bonuses ignored.
    assert await REWARDS["task"](samples) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert samples[0].reward_breakdown == {"shaped": 1.0, "task": 1.0}
    assert REWARDS["shaped-group-max"] is batched_tau_rm
