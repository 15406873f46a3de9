"""A scripted customer and gold conversations for tau-bench tasks.

- :class:`TaskUser`: the scripted customer. It opens with the task's instruction in the
  first person, answers ``yes`` once when the agent asks to confirm, and otherwise ends
  the conversation (``###STOP###``): enough to finish every synthetic task, and a cheap,
  deterministic stand-in for the LLM user on real tasks.
- :func:`gold_conversation`: a task's gold actions played as an agent conversation (tool
  calls with their real results, a confirmation before each write, a closing message that
  states the required outputs), for an SFT warm-up.
- :func:`short_tool_schemas`: tool schemas without descriptions (vime's ``TAU_SHORT_TOOLS``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from turnrl.tool_envs.tau.domain import TauDomain
from turnrl.tool_envs.tau.tasks import Task
from turnrl.tool_envs.user_sim import STOP_TOKEN

READ_ONLY_TOOLS = frozenset(
    {
        "find_user_id_by_email",
        "find_user_id_by_name_zip",
        "get_order_details",
        "get_product_details",
        "get_user_details",
        "list_all_product_types",
        "calculate",
        "think",
        "get_reservation_details",
        "search_direct_flight",
        "search_onestop_flight",
        "list_all_airports",
    }
)
"""Retail and airline tools that change nothing (no confirmation before them)."""
CONFIRM_WORDS = ("confirm", "yes")
"""Words in an agent message that :class:`TaskUser` takes as a request to confirm."""


def first_person(instruction: str) -> str:
    """The instruction rewritten as the customer's own words (You -> I, your -> my)."""
    text = re.sub(r"\bYour\b", "My", instruction)
    text = re.sub(r"\byour\b", "my", text)
    text = re.sub(r"\b[Yy]ou\b", "I", text)
    return text.replace("I no longer need it", "I no longer need it").strip()


class TaskUser:
    """The scripted customer (meets ``turnrl.tool_envs.protocol.UserSimulator``)."""

    def __init__(self) -> None:
        self.instruction = ""
        self.confirmed = False
        self.turns = 0

    async def reset(self, instruction: str) -> str:
        """Open the conversation with the instruction in the first person."""
        self.instruction, self.confirmed, self.turns = instruction, False, 0
        return f"Hi. {first_person(instruction)}"

    async def respond(self, agent_message: str) -> str:
        """``yes`` to the first request for confirmation, else end the conversation."""
        self.turns += 1
        lowered = agent_message.lower()
        if not self.confirmed and any(word in lowered for word in CONFIRM_WORDS):
            self.confirmed = True
            return "yes"
        return STOP_TOKEN


def action_messages(index: int, name: str, kwargs: dict[str, Any], result: str) -> list[dict]:
    """An assistant tool call (id ``call_<index>``) and its tool result, OpenAI format."""
    function = {"name": name, "arguments": json.dumps(kwargs)}
    call = {"id": f"call_{index}", "type": "function", "function": function}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{index}", "name": name, "content": result},
    ]


def confirm_message(name: str, kwargs: dict[str, Any]) -> str:
    """What the agent says before a write action."""
    target = kwargs.get("order_id") or kwargs.get("reservation_id") or kwargs.get("user_id", "")
    return f"I will {name.replace('_', ' ')} for {target}. Please confirm with yes."


def closing_message(outputs: Any) -> str:
    """The agent's last message: the required outputs, or a short done."""
    if outputs:
        return "Here is what I found: " + ", ".join(outputs) + "."
    return "Done. Is there anything else?"


def gold_conversation(domain: TauDomain, task: Task, system: str) -> list[dict[str, Any]]:
    """The task solved by its gold actions, as OpenAI-format messages (tool results real).

    The scripted :class:`TaskUser` answers this conversation exactly as written, so an
    agent that reproduces it earns the task's reward.
    """
    user = TaskUser()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Hi. {first_person(task.instruction)}"},
    ]
    db = domain.new_database()
    for index, action in enumerate(task.actions):
        if action.name not in READ_ONLY_TOOLS and not user.confirmed:
            user.confirmed = True
            messages.append(
                {"role": "assistant", "content": confirm_message(action.name, action.kwargs)}
            )
            messages.append({"role": "user", "content": "yes"})
        result = domain.invoke(db, action.name, action.kwargs)
        messages += action_messages(index, action.name, action.kwargs, result)
    messages.append({"role": "assistant", "content": closing_message(task.outputs)})
    return messages


def short_tool_schemas(schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool schemas with every description removed (names, types and required kept)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "description"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return [strip(schema) for schema in schemas]
