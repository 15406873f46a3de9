"""ToolSet (registration, calls, every failure mode) and the generic ToolEnvironment."""

from __future__ import annotations

import asyncio

import pytest

from turnrl.tool_envs.protocol import Environment
from turnrl.tool_envs.tool_calls import ToolCall, to_openai_tool_calls
from turnrl.tool_envs.tools import ToolEnvironment, ToolSet, visible_text
from turnrl.tool_envs.user_sim import ScriptedUser

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
DIVIDE = {
    "name": "divide",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}


async def _slow_echo(text: str) -> str:
    await asyncio.sleep(0)
    return f"echo: {text}"


def make_tools() -> ToolSet:
    tools = ToolSet()
    tools.add(ADD, lambda a, b: a + b)
    tools.add(DIVIDE, lambda a, b: a / b)  # inner-dict schema form
    tools.add(
        {
            "name": "echo",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
        _slow_echo,
    )
    return tools


def test_registration_and_schemas():
    tools = make_tools()
    assert tools.names == ["add", "divide", "echo"]
    assert all(s["type"] == "function" and "name" in s["function"] for s in tools.schemas)
    assert tools.schemas[1]["function"] is DIVIDE


def test_bad_registrations_raise():
    tools = make_tools()
    with pytest.raises(ValueError, match="registered twice"):
        tools.add(ADD, lambda a, b: 0)
    with pytest.raises(ValueError, match="no name"):
        tools.add({"type": "function", "function": {"parameters": {}}}, print)
    with pytest.raises(ValueError, match="no name"):
        tools.add({"name": ""}, print)


async def test_successful_sync_and_async_calls():
    tools = make_tools()
    result = await tools.call(ToolCall("add", {"a": 2, "b": 40}))
    assert (result.content, result.ok, result.well_formed) == ("42", True, True)
    result = await tools.call(ToolCall("echo", {"text": "hi"}))
    assert (result.content, result.ok) == ("echo: hi", True)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (ToolCall("mul", {"a": 1}), "unknown tool 'mul'; available tools: add, divide, echo"),
        (ToolCall("add", {"a": 1}), "missing required argument 'b'"),
        (ToolCall("add", {"a": 1, "b": "2"}), "argument 'b' must be of type integer"),
        (ToolCall("add", {"a": 1, "b": 2, "c": 3}), "unexpected argument 'c'"),
    ],
)
async def test_model_mistakes_become_error_text(call, fragment):
    result = await make_tools().call(call)
    assert not result.ok and not result.well_formed
    assert result.content.startswith("Error: ") and fragment in result.content


async def test_tool_exception_becomes_error_text():
    result = await make_tools().call(ToolCall("divide", {"a": 1, "b": 0}))
    assert not result.ok and result.well_formed
    assert result.content == "Error: ZeroDivisionError: division by zero"


def test_visible_text_drops_reasoning():
    assert visible_text("<think>\nplan\n</think>\n\nHello!") == "Hello!"
    assert visible_text(" Hi ") == "Hi"


async def test_environment_runs_tools_and_reports_invalid_calls():
    env = ToolEnvironment(make_tools(), system_prompt="Be exact.")
    assert isinstance(env, Environment)
    first = await env.reset({"prompt": "What is 2+3?"})
    assert first == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    calls = [ToolCall("add", {"a": 2, "b": 3}, id="c1"), ToolCall("mul", {}, id="c2")]
    result = await env.step(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": to_openai_tool_calls(calls),
            "tool_call_errors": ["Tool call is not valid JSON"],
        }
    )
    assert not result.done
    assert [(m["role"], m.get("tool_call_id"), m["content"][:12]) for m in result.observations] == [
        ("tool", "c1", "5"),
        ("tool", "c2", "Error: unkno"),
        ("tool", None, "Error: Tool "),
    ]
    assert (
        result.info["num_invalid_tool_calls"] == 1
    )  # the unknown tool; parse errors are the rollout's
    assert result.info["num_tool_calls"] == 3
    final = await env.step({"role": "assistant", "content": "5"})
    assert final.done and final.observations == []


async def test_environment_with_user_stops_on_stop_token():
    user = ScriptedUser(["I need 2+2.", "Thanks! ###STOP###"])
    env = ToolEnvironment(make_tools(), user)
    first = await env.reset({"instruction": "You want to know 2+2."})
    assert first == [{"role": "user", "content": "I need 2+2."}]
    assert user.instruction == "You want to know 2+2."
    result = await env.step({"role": "assistant", "content": "<think>\nadd\n</think>\n\nIt is 4."})
    assert result.done and result.observations == [
        {"role": "user", "content": "Thanks! ###STOP###"}
    ]
    assert user.transcript[-1] == ("It is 4.", "Thanks! ###STOP###")


async def test_environment_bad_tasks():
    with pytest.raises(ValueError, match="'prompt' string"):
        await ToolEnvironment(make_tools()).reset({"question": "x"})
    with pytest.raises(ValueError, match="'instruction' string"):
        await ToolEnvironment(make_tools(), ScriptedUser(["hi"])).reset({"prompt": "x"})
    with pytest.raises(TypeError, match="dict or a string"):
        await ToolEnvironment(make_tools()).reset(42)
    first = await ToolEnvironment(make_tools()).reset("plain question")
    assert first == [{"role": "user", "content": "plain question"}]
