"""Episodes through a real gateway served in-process, the real ``openai`` SDK in the example
agent, and the export -> Trajectory conversion. The engine is the tau app's replay engine (the
test double at the vLLM boundary), so every episode follows its task's gold conversation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import EXAMPLE, tau_replay
from turnrl_app_agent.agents import load_agent, load_callable
from turnrl_app_agent.config import AgentSettings, preset
from turnrl_app_agent.stages import (
    AgentServing,
    AgentStages,
    GatewayEpisodes,
    _Named,
    gateway,
    to_trajectory,
)

from turnrl.grpo_core.loop.rollout_manager import engine_failed
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Generation, SamplingParams
from turnrl.tool_envs.tau.data import TauTaskConfig, load_tasks_and_domain
from turnrl.tool_envs.tau.gold import gold_conversation

ROW = {"chain": 0, "fork_reason": None, "prompt_ids": [1, 2], "ids": [1, 2, 3, 4, 5],
       "loss_mask": [0, 0, 1, 1, 0], "logprobs": [0.0, 0.0, -0.5, -0.25, 0.0],
       "versions": [None] * 5, "calls": 1}  # fmt: skip


def session(**fields: Any) -> dict[str, Any]:
    return {"id": "s1", "status": "finished", "reason": None, "reward": 1.0, "rows": [ROW]} | fields


def test_one_chain_becomes_the_trajectory_the_tau_app_trains_on() -> None:
    traj = to_trajectory(session(reward=0.5), None, "g", 3)
    assert traj.status == "completed" and traj.reward == 0.5 and traj.num_turns == 1
    assert traj.prompt_ids == [1, 2] and traj.response_ids == [3, 4, 5]
    assert traj.loss_mask == [1, 1, 0] and traj.rollout_logprobs == [-0.5, -0.25, 0.0]
    assert (traj.group_id, traj.sample_index) == ("g", 3)


@pytest.mark.parametrize(
    ("fields", "agent_error", "error"),
    [
        (
            {"rows": [ROW, ROW | {"chain": 1, "fork_reason": "edited"}]},
            None,
            "ForkedSession: 2 chains (forks: edited)",
        ),
        (
            {"status": "failed", "reason": "call c1 was generated but never delivered"},
            None,
            "LostCall: call c1",
        ),
        ({}, "AgentError: ValueError: bad", "AgentError: ValueError: bad"),
        ({"rows": []}, None, "NoModelCall"),
        ({"reward": None}, None, "NoReward"),
    ],
)
def test_forks_lost_calls_and_agent_failures_fail_the_episode(
    fields: dict[str, Any], agent_error: str | None, error: str
) -> None:
    traj = to_trajectory(session(**fields), agent_error)
    assert traj.status == "failed" and traj.metadata["error"].startswith(error)
    assert traj.response_ids == [] and not engine_failed(traj)  # not re-run: counted


def test_a_call_lost_to_a_dead_engine_is_re_run_by_the_rollout_manager() -> None:
    reason = "engine call lost: EngineUnavailableError('http://e:1 is down')"
    traj = to_trajectory(session(status="failed", reason=reason), None)
    assert traj.status == "failed" and engine_failed(traj)


class Recorded:
    """The replay engine, every generation kept (what the engine returned)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.outputs = engine, []  # type: ignore[var-annotated]

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        out = await self.engine.generate(prompt_ids, sampling, session_id)
        self.outputs.append((session_id, list(prompt_ids), out.token_ids))
        return out


def smoke_tasks() -> list[dict[str, Any]]:
    lines = (EXAMPLE.parent / "mini_retail_smoke.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def replaying_gold(chat: ChatTokenizer, tasks: list[dict[str, Any]]) -> Recorded:
    """The tau app's replay engine over the gold conversations of the smoke tasks' store,
    recorded (the test double at the vLLM boundary)."""
    store = tasks[0]["store"]
    data = load_tasks_and_domain(
        TauTaskConfig(domain="synthetic", synthetic_num_users=store["users"],
                      synthetic_num_tasks=store["tasks"], synthetic_kinds=store["kinds"],
                      num_heldout=store["heldout"], policy_in_prompt=False)
    )  # fmt: skip
    gold = [gold_conversation(data.domain, t, data.domain.wiki) for t in data.train + data.heldout]
    return Recorded(tau_replay.ReplayEngine(chat, gold))


async def test_the_example_agent_through_the_gateway_is_token_exact(chat: ChatTokenizer) -> None:
    tasks = smoke_tasks()
    engine = replaying_gold(chat, tasks)
    named = _Named(engine)  # type: ignore[arg-type]
    agent = load_agent(AgentSettings(agent=f"{EXAMPLE}:run"))
    async with gateway(named, chat, SamplingParams(temperature=1.0, max_tokens=256), 4096) as url:
        episodes = GatewayEpisodes(agent, url, named, timeout=60)
        traj = await episodes.episode(tasks[0], "g0", 1, "manager-session-1")
        assert traj.status == "completed" and traj.reward == 1.0, traj.metadata
        calls = [o for o in engine.outputs if o[0] == "manager-session-1"]
        assert len(calls) == len(engine.outputs) == traj.num_turns >= 2
        # Every engine turn's ids are in the trajectory with loss mask 1, the rest mask 0.
        sampled = [t for _, _, ids in calls for t in ids]
        assert [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m] == sampled
        assert traj.ids[: len(calls[-1][1])] == calls[-1][1]  # the last prompt: a prefix

        config = preset("smoke")
        stages = AgentStages(config, (tasks[:8], tasks[8:]), logger=None)
        serving = AgentServing(stages, episodes, episodes, router=None)  # type: ignore[arg-type]
        record = await serving.evaluate(0)
        assert record["score"] == 1.0 and record["failed"] == 0.0 and record["trials"] == 4
        sft = stages.sft_data()
        assert sft is not None and len(sft.probe) == config.sft.probe_size and sft.chats
    assert not named.names  # every session closed


def test_sft_data_loads_by_path() -> None:
    function = load_callable(f"{EXAMPLE}:sft_data", "--sft-data")
    data = function(smoke_tasks())
    assert data["chats"][0][0]["role"] == "system" and data["tools"] is None
