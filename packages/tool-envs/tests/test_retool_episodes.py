"""ReTool episodes with the real sandbox: run, scored with the strict \\boxed{} rule and
ReTool's reward, counted in verl's turns, and a problem's accuracy over its samples."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams
from turnrl.tool_envs.retool.data import MathTask
from turnrl.tool_envs.retool.env import RetoolConfig
from turnrl.tool_envs.retool.episodes import (
    EpisodeSettings,
    generations_text,
    per_problem_accuracy,
    run_tasks,
    verl_num_turns,
)
from turnrl.tool_envs.rollout import RolloutConfig
from turnrl.tool_envs.sandbox import SandboxClient, SandboxClientConfig
from turnrl.tool_envs.sandbox.embedded import TEST_SERVER_ARGS, shared_sandbox
from turnrl.tool_envs.trajectory import TrajectoryLimits

PROBLEMS = [MathTask("What is 6 * 7?", "42", "toy", 0), MathTask("What is 5 * 9?", "45", "toy", 1)]


@pytest.fixture(scope="module")
def client():
    sandbox = shared_sandbox(*TEST_SERVER_ARGS)
    client = SandboxClient(SandboxClientConfig(url=sandbox.url))
    yield client
    client.close()


def settings(chat: ChatTokenizer, client: SandboxClient) -> EpisodeSettings:
    rollout = RolloutConfig(  # one episode at a time: the scripted engine plays them in order
        sampling=SamplingParams(temperature=1.0, max_tokens=128),
        limits=TrajectoryLimits(max_context_tokens=4096, max_turn_tokens=128, max_turns=4),
        max_inflight=1,
    )
    return EpisodeSettings(chat, client, RetoolConfig(max_turns=4), rollout)


def solve(expression: str, boxed: str) -> list[str]:
    """One code round printing ``expression``, then ``boxed`` as the answer."""
    call = json.dumps({"name": "code_interpreter", "arguments": {"code": f"print({expression})"}})
    return [f"Let me compute.\n<tool_call>\n{call}\n</tool_call>", f"So \\boxed{{{boxed}}}."]


async def test_episodes_are_scored_and_grouped_per_problem(
    qwen3: ChatTokenizer, client: SandboxClient, make_engine: Callable[..., Any]
) -> None:
    turns = [
        *solve("6 * 7", "42"),
        *solve("6 * 7", "41"),  # computed right, answered wrong
        *solve("5 * 9", "45"),
        *solve("5 * 9", "45"),
    ]
    trajs = await run_tasks(make_engine(turns), settings(qwen3, client), PROBLEMS, n=2)
    assert [t.status for t in trajs] == ["completed"] * 4
    assert [t.reward_breakdown["correct"] for t in trajs] == [1.0, 0.0, 1.0, 1.0]
    assert trajs[0].reward == 1.0 and trajs[1].reward < 0  # ReTool's rule: -1 + 0.1 per round
    assert [t.metadata["num_turns_verl"] for t in trajs] == [4] * 4
    assert trajs[0].metadata["answer"] == "42"
    assert per_problem_accuracy(trajs) == [0.5, 1.0]
    assert "\\boxed{42}" in generations_text(trajs, qwen3, limit=1)


async def test_an_episode_without_an_answer_is_wrong(
    qwen3: ChatTokenizer, client: SandboxClient, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine(["I cannot tell."])
    (traj,) = await run_tasks(engine, settings(qwen3, client), PROBLEMS[:1], n=1)
    assert traj.reward_breakdown["correct"] == 0.0 and traj.reward == -1.0


def test_verl_turn_count() -> None:
    one_round = [
        {"role": "system"},
        {"role": "user"},
        {"role": "assistant"},
        {"role": "tool"},
        {"role": "tool"},
        {"role": "assistant"},
    ]
    assert verl_num_turns(one_round) == 4  # user, assistant, tool block, assistant
    assert verl_num_turns([{"role": "user"}, {"role": "assistant"}]) == 2
