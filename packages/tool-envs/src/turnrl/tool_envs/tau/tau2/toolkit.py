"""How tau2-bench runs a tool: kinds, schemas, result texts and the database hash.

A domain's toolkit is a class whose tool methods are marked with :func:`tool`; it holds
one episode's database. :meth:`Toolkit.call` is tau2's ``Environment.get_response``: the
tool's return value becomes the tool message text (objects as ``json.dumps(...,
default=str)``, strings as they are, numbers and booleans as ``str``), and any exception
becomes ``"Error: <exception>"`` with ``error=True``; what the tool changed before it
raised stays changed, as upstream.

Hidden methods (initialisation actions such as ``turn_airplane_mode_on``, assertions such
as ``assert_mobile_data_status``) are plain public methods without the mark:
:meth:`Toolkit.run_function` reaches them by name, the agent and the user cannot.

The hash is tau2's: SHA-256 of ``json.dumps(state, sort_keys=True, default=str)`` where the
state is the database in the form upstream's pydantic ``model_dump`` gives (optional fields
present as ``None``); each domain loads its data into that form.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

TRANSFER_TOOL = "transfer_to_human_agents"
"""The agent's hand-over tool: it answers "Transfer successful" and changes nothing."""

F = TypeVar("F", bound=Callable[..., Any])


class ToolKind(enum.StrEnum):
    """tau2's tool types; only ``write`` tools are replayed when a trajectory is scored."""

    READ = "read"
    WRITE = "write"
    THINK = "think"
    GENERIC = "generic"


def tool(
    kind: ToolKind, description: str, parameters: dict[str, Any] | None = None
) -> Callable[[F], F]:
    """Mark a toolkit method as a tool of ``kind``.

    Args:
        kind: How the tool touches the database.
        description: What the model reads about the tool.
        parameters: JSON schema of the arguments (an ``object`` schema); none when omitted.
    """

    def mark(func: F) -> F:
        func._tau2_tool = (kind, description, parameters or {"type": "object", "properties": {}})  # type: ignore[attr-defined]
        return func

    return mark


_KINDS: dict[type, Mapping[str, ToolKind]] = {}
"""Each toolkit class's tool kinds (classes do not change after definition)."""


class Toolkit:
    """The tools of one side (agent or user) of a domain, acting on one database.

    Subclasses set :attr:`side` and define tool methods marked with :func:`tool`; their
    ``__init__`` takes the episode's database and :meth:`state` returns it in upstream's
    ``model_dump`` form.
    """

    side: ClassVar[str] = "assistant"
    """``assistant`` (the agent's tools) or ``user`` (the simulated user's, telecom)."""

    @classmethod
    def tool_kinds(cls) -> Mapping[str, ToolKind]:
        """Tool name -> kind, in definition order (base classes first); found once per class."""
        kinds = _KINDS.get(cls)
        if kinds is None:
            found: dict[str, ToolKind] = {}
            for klass in reversed(cls.__mro__):
                for name, attr in vars(klass).items():
                    mark = getattr(attr, "_tau2_tool", None)
                    if mark is not None:
                        found[name] = mark[0]
            kinds = _KINDS[cls] = MappingProxyType(found)
        return kinds

    @classmethod
    def schemas(cls) -> list[dict[str, Any]]:
        """OpenAI function schemas of the tools, sorted by name."""
        out = []
        for name in sorted(cls.tool_kinds()):
            _, description, parameters = getattr(cls, name)._tau2_tool
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": description,
                        "parameters": parameters,
                    },
                }
            )
        return out

    def has_tool(self, name: str) -> bool:
        return name in self.tool_kinds()

    def use(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run a tool and return its raw value (raises as the tool does)."""
        if name not in self.tool_kinds():
            raise ValueError(f"Tool '{name}' not found.")
        return getattr(self, name)(**arguments)

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run a tool as tau2's environment does: ``(tool message text, error)``; never raises."""
        try:
            value = self.use(name, arguments)
        except Exception as exc:
            return f"Error: {exc}", True
        return to_json_str(value), False

    def run_function(self, name: str, arguments: dict[str, Any]) -> Any:
        """Call any public method by name (initialisation actions, assertions)."""
        func = getattr(self, name, None) if not name.startswith("_") else None
        if not callable(func):
            raise ValueError(f"Function {name} not found in {self.side} tools")
        return func(**arguments)

    def state(self) -> Any:
        """The database in upstream's ``model_dump`` form (read-only view)."""
        raise NotImplementedError

    def update_db(self, data: dict[str, Any]) -> None:
        """Deep-merge ``data`` into the database (a task's ``initialization_data``)."""
        raise NotImplementedError

    def db_hash(self) -> str:
        """tau2's hash of the database."""
        return state_hash(self.state())


def state_hash(state: Any) -> str:
    """SHA-256 hex of ``json.dumps(state, sort_keys=True, default=str)`` (tau2's ``get_dict_hash``)."""
    text = json.dumps(state, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Model(dict):  # type: ignore[type-arg]
    """A tool result that upstream returns as a pydantic model: dumped as it is.

    tau2 turns a returned model into its ``model_dump`` (nested numbers stay numbers) but
    walks plain containers and writes every number and boolean in them as a string; tools
    return ``Model(record)`` where upstream returns a model, plain containers elsewhere.
    """


def to_json_str(value: Any) -> str:
    """The text of a tool's return value, as tau2's ``Environment.to_json_str`` writes it."""
    if isinstance(value, str):
        return value
    return json.dumps(_plain(value), default=str)


def _plain(value: Any) -> Any:
    if isinstance(value, Model):
        return dict(value)
    if isinstance(value, enum.Enum) and isinstance(value, str):
        return value.value
    if isinstance(value, bool | int | float):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def deep_merge(target: dict[str, Any], data: dict[str, Any]) -> None:
    """Merge ``data`` into ``target`` in place: nested objects merge, anything else replaces."""
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            deep_merge(target[key], value)
        else:
            target[key] = value
