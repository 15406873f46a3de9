"""The mini-retail agent of ``mini_retail_agent.py`` written with the ``openai-agents`` SDK.

The same store, scripted customer and 0/1 reward (imported from the plain example); the
SDK's ``Agent`` and ``Runner`` run the tool loop: the store's tools are SDK function tools
that act on the episode's environment, and each final answer goes to the customer, whose
reply starts the next ``Runner.run``. The SDK talks chat completions to the endpoint
(``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client), its tracing is off (nothing
leaves the machine), and it sends the store's tool schemas with every request (it runs the
tools itself), so train it with them: ``sft_data`` here adds them to the SFT conversations.

    uv sync --group examples    # openai-agents
    uv run apps/agent --agent apps/agent/examples/mini_retail_openai_agents.py:run \\
        --tasks tasks.jsonl --sft-data apps/agent/examples/mini_retail_openai_agents.py:sft_data
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import openai
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunContextWrapper,
    Runner,
    set_tracing_disabled,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path: the plain example
import mini_retail_agent as plain

set_tracing_disabled(True)
MAX_TOOL_CALLS = 6
"""Model calls one ``Runner.run`` (one customer turn) may make."""


def store_tools(env: Any, schemas: list[dict[str, Any]]) -> list[FunctionTool]:
    """The store's tools as SDK function tools, each call run by the episode's ``env``."""

    def tool(schema: dict[str, Any]) -> FunctionTool:
        name = schema["function"]["name"]

        async def invoke(ctx: RunContextWrapper[Any], arguments: str) -> str:
            call = {"id": f"call_{name}", "type": "function",
                    "function": {"name": name, "arguments": arguments or "{}"}}  # fmt: skip
            step = await env.step({"role": "assistant", "content": None, "tool_calls": [call]})
            return "\n".join(str(m.get("content") or "") for m in step.observations)

        return FunctionTool(
            name=name,
            description=schema["function"].get("description", ""),
            params_json_schema=schema["function"].get("parameters") or {"type": "object"},
            on_invoke_tool=invoke,
            strict_json_schema=False,
        )

    return [tool(s) for s in schemas]


async def run(task: dict[str, Any], endpoint: Any) -> float:
    """Serve the task's customer with an SDK agent; returns the task reward (1.0 or 0.0)."""
    store = task["store"]
    data = plain._store(json.dumps(store, sort_keys=True))
    env = plain.TauEnv(data.domain, plain.TaskUser())
    system, first = await env.reset((data.train + data.heldout)[task["index"]])
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
    agent = Agent(
        name="mini-retail",
        instructions=system["content"],
        model=OpenAIChatCompletionsModel(model=endpoint.model, openai_client=client),
        model_settings=ModelSettings(),  # the run owns sampling: nothing set here
        tools=store_tools(env, plain._tools(store, always=True)),
    )
    items: list[Any] = [first]
    try:
        for _ in range(plain.MAX_TURNS):
            try:
                result = await Runner.run(agent, items, max_turns=MAX_TOOL_CALLS)
            except openai.APIStatusError as exc:
                if exc.status_code == 413:  # the conversation outgrew the context
                    break
                raise
            items = result.to_input_list()
            step = await env.step({"role": "assistant", "content": str(result.final_output)})
            if step.done:
                break
            items += step.observations
    finally:
        await client.close()
    return float(env.reward().reward)


def sft_data(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """The plain example's SFT conversations, with the tool schemas this agent sends."""
    return {**plain.sft_data(tasks), "tools": plain._tools(tasks[0]["store"], always=True)}
