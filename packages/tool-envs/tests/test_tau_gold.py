"""The scripted customer, short tool schemas and gold conversations (tau and tau2).

A gold conversation's assistant turns, stepped through the environment with the scripted
user, must give back its own tool results and user replies and earn reward 1.
"""

from __future__ import annotations

from pathlib import Path

from turnrl.tool_envs.tau import TauEnv
from turnrl.tool_envs.tau.gold import TaskUser, first_person, gold_conversation, short_tool_schemas
from turnrl.tool_envs.tau.synth import TASK_KINDS, generate
from turnrl.tool_envs.tau.tau2 import gold as tau2_gold
from turnrl.tool_envs.tau.tau2.domain import load_domain
from turnrl.tool_envs.tau.tau2.env import Tau2Env
from turnrl.tool_envs.tau.tau2.tasks import load_tasks


async def test_scripted_user() -> None:
    user = TaskUser()
    opening = await user.reset("Your name is Ada and you want to cancel your order #W1.")
    assert opening == "Hi. My name is Ada and I want to cancel my order #W1."
    assert await user.respond("I will cancel it. Please confirm with yes.") == "yes"
    assert await user.respond("Please confirm again?") == "###STOP###"
    assert first_person("You moved.") == "I moved."


def test_short_tools_drop_descriptions_only() -> None:
    schema = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "long",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "description": "d"}},
                "required": ["x"],
            },
        },
    }
    short = short_tool_schemas([schema])[0]
    assert "description" not in short["function"]
    assert short["function"]["parameters"]["properties"]["x"] == {"type": "string"}
    assert short["function"]["parameters"]["required"] == ["x"]


async def _replay(env, conversation, opening_len):
    """Step every assistant turn after the opening; the observations must match."""
    rest = conversation[opening_len:]
    result = None
    for i, message in enumerate(rest):
        if message["role"] != "assistant":
            continue
        result = await env.step(message)
        replies = rest[i + 1 : i + 1 + len(result.observations)]
        if not result.done:
            assert [o["content"] for o in result.observations] == [r["content"] for r in replies]
    assert result is not None and result.done


async def test_synthetic_gold_conversations_earn_reward_one() -> None:
    synthetic = generate(seed=3, num_tasks=10)
    domain = synthetic.domain()
    assert {t.actions[-1].name for t in synthetic.tasks} == set(TASK_KINDS.values())
    for task in synthetic.tasks:
        conversation = gold_conversation(domain, task, synthetic.wiki)
        env = TauEnv(domain, TaskUser())
        assert await env.reset(task) == conversation[:2]
        await _replay(env, conversation, 2)
        assert env.reward().reward == 1.0


async def test_tau2_airline_gold_conversations_earn_reward_one(tau2_data: Path) -> None:
    domain = load_domain("airline", tau2_data / "airline")
    tasks = [t for t in load_tasks(tau2_data / "airline", "train") if not t.needs_judge][:8]
    assert tasks
    for task in tasks:
        conversation = tau2_gold.gold_conversation(domain, task)
        env = Tau2Env(domain, TaskUser())
        assert await env.reset(task) == conversation[:3]
        await _replay(env, conversation, 3)
        assert env.reward().reward == 1.0
