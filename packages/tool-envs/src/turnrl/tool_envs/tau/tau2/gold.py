"""Gold conversations for tau2-bench tasks, answered as tau-bench's scripted
:class:`turnrl.tool_envs.tau.gold.TaskUser` would (for an SFT warm-up)."""

from __future__ import annotations

from typing import Any

from turnrl.tool_envs.tau.gold import (
    action_messages,
    closing_message,
    confirm_message,
    first_person,
)
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain
from turnrl.tool_envs.tau.tau2.env import GREETING
from turnrl.tool_envs.tau.tau2.tasks import Tau2Task
from turnrl.tool_envs.tau.tau2.toolkit import ToolKind


def gold_conversation(domain: Tau2Domain, task: Tau2Task) -> list[dict[str, Any]]:
    """A tau2 task solved by its gold actions: tau2's opening, the scenario in the first
    person, a confirmation before the first write, real tool results, the user asked to
    run its own actions (telecom), and a closing message with the information to
    communicate."""
    agent, phone = domain.start(task)
    kinds = agent.tool_kinds()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": domain.system_prompt},
        {"role": "assistant", "content": GREETING},
        {"role": "user", "content": f"Hi. {first_person(task.scenario)}"},
    ]
    confirmed = False
    for index, (action, side) in enumerate(
        zip(task.gold_actions, task.gold_requestors, strict=True)
    ):
        kwargs = dict(action.arguments)
        if side == "user" and phone is not None:  # the user acts on the phone when asked
            phone.call(action.name, kwargs)
            domain.sync(agent, phone)
            ask = f"Please {action.name.replace('_', ' ')} on your phone and tell me when done."
            messages.append({"role": "assistant", "content": ask})
            messages.append({"role": "user", "content": "Done."})
            continue
        if kinds.get(action.name) == ToolKind.WRITE and not confirmed:
            confirmed = True
            messages.append({"role": "assistant", "content": confirm_message(action.name, kwargs)})
            messages.append({"role": "user", "content": "yes"})
        result, _ = agent.call(action.name, kwargs)
        domain.sync(agent, phone)
        messages += action_messages(index, action.name, kwargs, result)
    messages.append({"role": "assistant", "content": closing_message(task.communicate_info)})
    return messages
