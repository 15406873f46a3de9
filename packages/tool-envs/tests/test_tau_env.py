"""TauEnv episodes on the synthetic mini-retail domain with a scripted user of this file."""

import json

import pytest

from turnrl.tool_envs.protocol import Environment
from turnrl.tool_envs.tau import STOP_MARKER, TauEnv, TauEnvConfig
from turnrl.tool_envs.tau.synth import generate


class ScriptedUser:
    """Says the task's instruction first, then the given replies in order."""

    def __init__(self, replies=(STOP_MARKER,), fail=False):
        self.replies = list(replies)
        self.fail = fail
        self.heard = []

    async def reset(self, instruction):
        return f"Hi. {instruction}"

    async def respond(self, agent_message):
        self.heard.append(agent_message)
        if self.fail:
            raise ConnectionError("user model unreachable")
        return self.replies.pop(0) if self.replies else STOP_MARKER


def call(name, args, call_id="c1", raw=None):
    arguments = raw if raw is not None else json.dumps(args)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def turn(*calls, content=""):
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


@pytest.fixture(scope="module")
def synthetic():
    return generate(seed=2, num_tasks=10)


def _task(synthetic, last_action):
    return next(t for t in synthetic.tasks if t.actions[-1].name == last_action)


async def _play_gold(env, task):
    for i, action in enumerate(task.actions):
        result = await env.step(turn(call(action.name, action.kwargs, f"c{i}")))
        assert not result.done and result.info["tool_calls"]["ok"] == 1
        assert result.observations[0]["tool_call_id"] == f"c{i}"


def test_tau_env_meets_the_environment_protocol(synthetic):
    assert isinstance(TauEnv(synthetic.domain(), ScriptedUser()), Environment)


async def test_gold_episode_gets_reward_one(synthetic):
    task = _task(synthetic, "cancel_pending_order")
    env = TauEnv(synthetic.domain(), ScriptedUser(["yes", STOP_MARKER]), tasks=synthetic.tasks)
    first = await env.reset(synthetic.tasks.index(task))
    assert first[0] == {"role": "system", "content": synthetic.wiki}
    assert first[1]["role"] == "user" and task.instruction in first[1]["content"]
    await _play_gold(env, task)
    reply = await env.step({"role": "assistant", "content": "Your order is cancelled."})
    assert reply.observations == [{"role": "user", "content": "yes"}] and not reply.done
    final = await env.step({"role": "assistant", "content": "Anything else?"})
    assert final.done and final.info["done_reason"] == "user_stop"
    assert final.info["user_s"] >= 0.0  # the user simulator's share of the step
    inputs = final.info["reward_inputs"]
    assert inputs.final_data_hash == inputs.gt_data_hash == env.data_hash()
    assert inputs.agent_messages == ("Your order is cancelled.", "Anything else?")
    assert inputs.num_well_formed_tool_calls == inputs.num_successful_tool_calls == 3
    assert env.reward().reward == 1.0
    assert final.info["episode_tool_calls"] == {
        "ok": 3,
        "failed": 0,
        "well_formed": 3,
        "malformed": 0,
    }
    with pytest.raises(RuntimeError, match="episode is over"):
        await env.step({"role": "assistant", "content": "hello?"})


async def test_wrong_write_gets_reward_zero_and_reset_restores_data(synthetic):
    task = _task(synthetic, "cancel_pending_order")
    env = TauEnv(synthetic.domain(), ScriptedUser())
    await env.reset(task)
    pristine = env.data_hash()
    gold = task.actions[-1].kwargs
    other = {"no longer needed": "ordered by mistake", "ordered by mistake": "no longer needed"}
    await env.step(turn(call("cancel_pending_order", {**gold, "reason": other[gold["reason"]]})))
    assert env.data_hash() != pristine
    result = await env.step({"role": "assistant", "content": "done"})
    assert result.done and env.reward().reward == 0.0
    await env.reset(task)
    assert env.data_hash() == pristine


async def test_outputs_must_be_said_to_the_user(synthetic):
    task = next(t for t in synthetic.tasks if t.outputs)
    for message, expected in ((f"It is {task.outputs[0].upper()}, sir.", 1.0), ("No idea.", 0.0)):
        env = TauEnv(synthetic.domain(), ScriptedUser())
        await env.reset(task)
        result = await env.step({"role": "assistant", "content": message})
        assert result.done
        reward = env.reward()
        assert reward.reward == expected
        assert reward.breakdown["r_actions"] == 1.0 and reward.breakdown["r_outputs"] == expected
        assert reward.breakdown["outputs"] == {task.outputs[0]: bool(expected)}


async def test_transfer_ends_the_episode_and_skips_later_calls(synthetic):
    env = TauEnv(synthetic.domain(), ScriptedUser())
    await env.reset(synthetic.tasks[0])
    result = await env.step(
        turn(
            call("transfer_to_human_agents", {"summary": "s"}, "a"),
            call("think", {"thought": "t"}, "b"),
        )
    )
    assert result.done and result.info["done_reason"] == "transfer"
    assert [o["content"] for o in result.observations] == [
        "Transfer successful",
        "Error: not executed: the episode already ended",
    ]
    assert "reward_inputs" in result.info


async def test_malformed_and_failing_calls_are_counted_and_shown(synthetic):
    env = TauEnv(synthetic.domain(), ScriptedUser())
    await env.reset(synthetic.tasks[0])
    assistant = turn(
        call("get_order_details", None, "a", raw="{not json"),
        call("no_such_tool", {}, "b"),
        call("get_order_details", {"order_id": 5}, "c"),
        call("get_order_details", {"order_id": "#W0"}, "d"),
        call("think", {"thought": "ok"}, "e"),
    )
    assistant["tool_call_errors"] = ["Tool call is missing its closing </tool_call> tag."]
    result = await env.step(assistant)
    assert not result.done
    contents = [o["content"] for o in result.observations]
    assert contents[0] == "Error: Tool call is missing its closing </tool_call> tag."
    assert contents[1].startswith('Error: Arguments of tool "get_order_details"')
    assert contents[2:] == [
        "Unknown action no_such_tool",
        "Error: order not found",
        "Error: order not found",
        "",
    ]
    assert result.info["tool_calls"] == {"ok": 1, "failed": 5, "well_formed": 2, "malformed": 4}


async def test_first_call_only_mode(synthetic):
    env = TauEnv(
        synthetic.domain(), ScriptedUser(), config=TauEnvConfig(execute_all_tool_calls=False)
    )
    await env.reset(synthetic.tasks[0])
    result = await env.step(
        turn(call("think", {"thought": "a"}, "a"), call("think", {"thought": "b"}, "b"))
    )
    assert result.observations[1]["content"].startswith("Error: not executed: only the first")
    assert env.actions == [{"name": "think", "kwargs": {"thought": "a"}}]


async def test_user_simulator_failure_ends_the_episode_with_a_status(synthetic):
    env = TauEnv(synthetic.domain(), ScriptedUser(fail=True))
    await env.reset(synthetic.tasks[0])
    result = await env.step({"role": "assistant", "content": "Hello"})
    assert result.done and result.info["done_reason"] == "user_error"
    assert result.info["user_error"] == "ConnectionError: user model unreachable"


async def test_bad_use_is_a_clear_error(synthetic):
    env = TauEnv(synthetic.domain(), ScriptedUser(), tasks=synthetic.tasks[:2])
    with pytest.raises(RuntimeError, match="reset"):
        await env.step({"role": "assistant", "content": "hi"})
    with pytest.raises(IndexError, match="out of range"):
        await env.reset(2)
    with pytest.raises(TypeError, match="Task or a task index"):
        await env.reset("task")
    with pytest.raises(RuntimeError, match="reset"):
        env.reward_inputs()
