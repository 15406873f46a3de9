"""tau2-bench tasks: ``tasks.json`` records checked and read, splits, the user's scenario text.

A task (``shared/tau2-bench/README.md``, "Task fields used") has an ``id``, a
``user_scenario`` (persona and instructions for the user simulator), an optional
``initial_state`` (data merged into the databases, functions run on either side, a message
history) and ``evaluation_criteria`` (gold actions, environment assertions, information to
communicate, natural-language assertions, the reward basis).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.rewards.tau2 import COMPONENTS, DEFAULT_BASIS, GoldAction, parse_gold_actions


class TaskFormatError(ValueError):
    """A tau2 task file, split file or task record does not have tau2's shape."""


@dataclass(frozen=True)
class EnvCall:
    """A function run on one side's toolkit (an initialisation action or an assertion)."""

    side: str
    """``assistant`` or ``user``."""
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    assert_value: bool = True
    """For assertions: the value the function must return."""


@dataclass(frozen=True)
class Tau2Task:
    """One tau2 task, as the environment and the reward need it."""

    id: str
    scenario: str
    """The user's scenario, rendered as tau2 gives it to the user simulator."""
    user_tools: tuple[str, ...] | None = None
    """Allow-list of user tool names (``None``: all of the domain's)."""
    agent_data: dict[str, Any] | None = None
    user_data: dict[str, Any] | None = None
    init_calls: tuple[EnvCall, ...] = ()
    has_criteria: bool = True
    gold_actions: tuple[GoldAction, ...] = ()
    gold_requestors: tuple[str, ...] = ()
    """The side that runs each gold action."""
    actions_given: bool = True
    """False when ``actions`` is null (then no database comparison unless assertions exist)."""
    env_assertions: tuple[EnvCall, ...] | None = None
    communicate_info: tuple[str, ...] = ()
    nl_assertions: tuple[str, ...] = ()
    reward_basis: tuple[str, ...] = DEFAULT_BASIS

    @property
    def needs_judge(self) -> bool:
        """True when an LLM judge's verdict on NL assertions gates the reward."""
        return "NL_ASSERTION" in self.reward_basis and bool(self.nl_assertions)

    @property
    def compares_db(self) -> bool:
        """tau2 compares databases unless both ``actions`` and ``env_assertions`` are null."""
        return self.actions_given or self.env_assertions is not None

    @classmethod
    def from_dict(cls, data: Any) -> Tau2Task:
        """Check and convert one record of ``tasks.json``."""
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise TaskFormatError(f"a task must be an object with a string 'id', got {data!r:.80}")
        where = f"task {data['id']!r}"
        try:
            return _task(data)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise TaskFormatError(f"{where}: {type(exc).__name__}: {exc}") from exc


def _task(data: dict[str, Any]) -> Tau2Task:
    scenario = data["user_scenario"]
    state = data.get("initial_state") or {}
    if state.get("message_history"):
        raise ValueError("tasks with a message_history are not supported yet")
    init_data = state.get("initialization_data") or {}
    criteria = data.get("evaluation_criteria")
    crit = criteria or {}
    actions = crit.get("actions")
    assertions = crit.get("env_assertions")
    basis = tuple(crit.get("reward_basis") or DEFAULT_BASIS)
    unknown = [b for b in basis if b not in COMPONENTS]
    if unknown:
        raise ValueError(f"unknown reward_basis {unknown}")
    return Tau2Task(
        id=data["id"],
        scenario=render_scenario(scenario),
        user_tools=None if data.get("user_tools") is None else tuple(data["user_tools"]),
        agent_data=init_data.get("agent_data"),
        user_data=init_data.get("user_data"),
        init_calls=tuple(_env_call(c) for c in state.get("initialization_actions") or ()),
        has_criteria=criteria is not None,
        gold_actions=parse_gold_actions(actions),
        gold_requestors=tuple(str(a.get("requestor") or "assistant") for a in actions or ()),
        actions_given=actions is not None,
        env_assertions=None if assertions is None else tuple(_env_call(a) for a in assertions),
        communicate_info=tuple(crit.get("communicate_info") or ()),
        nl_assertions=tuple(crit.get("nl_assertions") or ()),
        reward_basis=basis,
    )


def _env_call(data: dict[str, Any]) -> EnvCall:
    side = data["env_type"]
    if side not in ("assistant", "user"):
        raise ValueError(f"env_type must be 'assistant' or 'user', got {side!r}")
    value = data.get("assert_value", True)
    return EnvCall(side, str(data["func_name"]), dict(data.get("arguments") or {}), bool(value))


def render_scenario(scenario: Any) -> str:
    """tau2's text of a ``user_scenario``: ``Persona:`` and ``Instructions:``, tab-indented."""
    lines = []
    if scenario.get("persona") is not None:
        lines += ["Persona:", textwrap.indent(scenario["persona"], "\t")]
    instructions = scenario["instructions"]
    if isinstance(instructions, dict):
        parts = [f"Domain: {instructions['domain']}"]
        for key, title in (
            ("reason_for_call", "Reason for call"),
            ("known_info", "Known info"),
            ("unknown_info", "Unknown info"),
            ("task_instructions", "Task instructions"),
        ):
            if instructions.get(key) is not None:
                parts.append(f"{title}:\n{textwrap.indent(instructions[key], chr(9))}")
        instructions = "\n".join(parts)
    elif not isinstance(instructions, str):
        raise TypeError("user_scenario.instructions must be a string or an object")
    lines += ["Instructions:", textwrap.indent(instructions, "\t")]
    return "\n".join(lines)


def load_tasks(domain_dir: str | Path, split: str | None = None) -> list[Tau2Task]:
    """The tasks of a domain folder (``tasks.json``), optionally only those of ``split``
    (from ``split_tasks.json``; ``base`` is the standard evaluation set), in file order."""
    root = Path(domain_dir)
    records = _read_json(root / "tasks.json", list)
    if split is not None:
        splits = _read_json(root / "split_tasks.json", dict)
        if split not in splits:
            raise TaskFormatError(
                f"{root / 'split_tasks.json'} has no split {split!r}; has {sorted(splits)}"
            )
        wanted = set(splits[split])
        records = [r for r in records if isinstance(r, dict) and r.get("id") in wanted]
        missing = wanted - {r["id"] for r in records}
        if missing:
            raise TaskFormatError(
                f"split {split!r} names tasks not in tasks.json: {sorted(missing)[:5]}"
            )
    return [Tau2Task.from_dict(r) for r in records]


def _read_json(path: Path, kind: type) -> Any:
    if not path.is_file():
        raise TaskFormatError(f"missing {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, kind):
        raise TaskFormatError(f"{path} must hold a JSON {kind.__name__}, got {type(data).__name__}")
    return data
