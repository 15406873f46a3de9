"""The ``openai-agents`` example through a real gateway served in-process; the engine is the
tau app's replay engine (the test double at the vLLM boundary), so every episode follows its
task's gold conversation. Skipped when ``openai-agents`` is not installed (the ``examples``
dependency group)."""

from __future__ import annotations

import pytest
from conftest import EXAMPLE
from test_gateway_episodes import replaying_gold, smoke_tasks
from turnrl_app_agent.agents import load_agent, load_callable
from turnrl_app_agent.config import AgentSettings
from turnrl_app_agent.stages import GatewayEpisodes, _Named, gateway

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams

pytest.importorskip("agents")
FRAMEWORK = EXAMPLE.parent / "mini_retail_openai_agents.py"


async def test_the_openai_agents_example_through_the_gateway_is_token_exact(
    chat: ChatTokenizer,
) -> None:
    tasks = smoke_tasks()
    engine = replaying_gold(chat, tasks)
    named = _Named(engine)  # type: ignore[arg-type]
    agent = load_agent(AgentSettings(agent=f"{FRAMEWORK}:run"))
    async with gateway(named, chat, SamplingParams(temperature=1.0, max_tokens=256), 4096) as url:
        episodes = GatewayEpisodes(agent, url, named, timeout=60, keep_rows=True)
        for index, task in enumerate(tasks[:2]):
            before = len(engine.outputs)
            traj = await episodes.episode(task, "g0", index, f"s{index}")
            assert traj.status == "completed" and traj.reward == 1.0, traj.metadata
            calls = engine.outputs[before:]
            assert len(calls) == traj.num_turns >= 2
            # One chain (the SDK's history extends it), every engine turn's ids in it.
            assert len(traj.metadata["rows"]) == 1
            sampled = [t for _, _, ids in calls for t in ids]
            assert [
                t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m
            ] == sampled
            assert "<tools>" in chat.decode(calls[0][1])  # the SDK sends the store's tools
    assert not named.names  # every session closed


def test_its_sft_data_carries_the_tools_it_sends() -> None:
    data = load_callable(f"{FRAMEWORK}:sft_data", "--sft-data")(smoke_tasks())
    assert data["chats"] and {t["function"]["name"] for t in data["tools"]}
