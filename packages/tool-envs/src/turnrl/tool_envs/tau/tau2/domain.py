"""A tau2 domain: its policy, a factory of fresh toolkits per episode, and its ``sync_tools``.

Each domain module (``airline``, ``retail``, ``telecom``) has ``load(data_dir)`` returning a
:class:`Tau2Domain`; :func:`load_domain` picks it by name. The data is parsed once; every
episode (and every scoring replay) gets new toolkits whose databases start from it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau.tau2.tasks import EnvCall, Tau2Task
from turnrl.tool_envs.tau.tau2.toolkit import Toolkit

DOMAINS = ("airline", "retail", "telecom")

AGENT_INSTRUCTION = (
    "You are a customer service agent that helps the user according to the <policy> provided "
    "below.\nIn each turn you can either:\n- Send a message to the user.\n- Make a tool call.\n"
    "You cannot do both at the same time.\n\nTry to be helpful and always follow the policy. "
    "Always make sure you generate valid JSON only."
)
"""The fixed instruction tau2's conversational agent puts before the policy."""


def _no_sync(tools: Toolkit, user_tools: Toolkit | None) -> None:
    return None


@dataclass
class Tau2Domain:
    """Everything the episodes of one domain share."""

    name: str
    """``airline``, ``retail`` or ``telecom``."""
    policy: str
    """The agent's policy document (telecom: main policy and tech-support manual, tagged)."""
    new_tools: Callable[[], Toolkit]
    """A fresh agent toolkit on a fresh copy of the agent database."""
    new_user_tools: Callable[[], Toolkit] | None = None
    """A fresh user toolkit on a fresh user database (telecom); ``None`` when the user has no tools."""
    sync: Callable[[Toolkit, Toolkit | None], None] = _no_sync
    """tau2's ``sync_tools``: run after every step (telecom copies backend facts to the phone)."""
    gold_cache: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Task id -> the (agent, user) database hashes its gold actions produce."""

    def start(self, task: Tau2Task) -> tuple[Toolkit, Toolkit | None]:
        """Fresh agent and user toolkits in ``task``'s initial state: its data merged in, then
        its initialisation functions run, ``sync`` after each and once at the end."""
        agent = self.new_tools()
        phone = self.new_user_tools() if self.new_user_tools else None
        if task.agent_data:
            agent.update_db(task.agent_data)
        if task.user_data:
            if phone is None:
                raise ValueError(f"task {task.id!r} sets user data; {self.name} has no user side")
            phone.update_db(task.user_data)
        for call in task.init_calls:
            side(agent, phone, call).run_function(call.name, call.arguments)
            self.sync(agent, phone)
        self.sync(agent, phone)
        return agent, phone

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The agent's tool schemas."""
        return self.new_tools().schemas()

    @property
    def system_prompt(self) -> str:
        """The agent's system prompt: tau2's fixed instruction, then the policy."""
        return f"<instructions>\n{AGENT_INSTRUCTION}\n</instructions>\n<policy>\n{self.policy}\n</policy>"


def load_domain(name: str, data_dir: str | Path) -> Tau2Domain:
    """Load ``<data_dir>`` (a tau2 domain folder: db, policy, tasks) as domain ``name``."""
    if name not in DOMAINS:
        raise ValueError(f"unknown tau2 domain {name!r}; expected one of {list(DOMAINS)}")
    module = importlib.import_module(f"turnrl.tool_envs.tau.tau2.{name}")
    domain: Tau2Domain = module.load(Path(data_dir))
    return domain


def side(agent: Toolkit, phone: Toolkit | None, call: EnvCall) -> Toolkit:
    """The toolkit an initialisation function or assertion runs on."""
    if call.side == "assistant":
        return agent
    if phone is None:
        raise ValueError(f"{call.name} runs on the user side, which this domain does not have")
    return phone
