"""How tau-bench calls a tool: argument binding, error texts and the observation string.

tau-bench's tools take the action's keyword arguments unvalidated (the JSON schemas are
not enforced) and any exception inside a tool becomes the observation
``"Error: " + str(exception)``; mutations made before the exception stay. The binding
errors use the texts CPython 3.11 gives for a tool class's ``invoke`` (SPEC §10.1), so
an agent sees exactly what it would see upstream.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from turnrl.tool_envs.tau.db import Database

TRANSFER_TOOL = "transfer_to_human_agents"
"""The tool that ends the episode (tau-bench's ``terminate_tools``)."""
RESPOND_ACTION = "respond"
"""The action name for a message to the user."""

ToolFunc = Callable[..., str | None]


@dataclass(frozen=True)
class TauTool:
    """One tool: its name, upstream class name (for error texts) and implementation."""

    name: str
    """Tool name as the agent calls it, e.g. ``cancel_pending_order``."""
    class_name: str
    """Upstream class name used in argument-binding errors, e.g. ``CancelPendingOrder``."""
    func: ToolFunc
    """``func(db, **kwargs)``; returns the observation text (``None`` only for a broken call)."""
    params: tuple[str, ...]
    """Parameter names in declaration order (all required)."""


def tool(class_name: str) -> Callable[[ToolFunc], ToolFunc]:
    """Decorator recording a tool's upstream class name on its implementation."""

    def mark(func: ToolFunc) -> ToolFunc:
        func._tau_class = class_name  # type: ignore[attr-defined]
        return func

    return mark


def collect_tools(funcs: list[ToolFunc]) -> dict[str, TauTool]:
    """Build the tool table from decorated functions whose first parameter is the database."""
    table = {}
    for func in funcs:
        params = tuple(inspect.signature(func).parameters)[1:]
        table[func.__name__] = TauTool(func.__name__, func._tau_class, func, params)  # type: ignore[attr-defined]
    return table


def _quoted_list(names: list[str]) -> str:
    quoted = [f"'{n}'" for n in names]
    if len(quoted) == 1:
        return quoted[0]
    if len(quoted) == 2:
        return f"{quoted[0]} and {quoted[1]}"
    return ", ".join(quoted[:-1]) + f", and {quoted[-1]}"


def binding_error(domain: str, spec: TauTool, kwargs: Mapping[str, Any]) -> str | None:
    """The ``Error: ...`` text upstream gives when ``kwargs`` do not bind, else ``None``."""
    if "data" in kwargs:
        return (
            f"Error: tau_bench.envs.{domain}.tools.{spec.name}.{spec.class_name}.invoke() "
            "got multiple values for keyword argument 'data'"
        )
    for key in kwargs:
        if key not in spec.params:
            return f"Error: {spec.class_name}.invoke() got an unexpected keyword argument '{key}'"
    missing = [p for p in spec.params if p not in kwargs]
    if missing:
        plural = "argument" if len(missing) == 1 else "arguments"
        return (
            f"Error: {spec.class_name}.invoke() missing {len(missing)} required positional "
            f"{plural}: {_quoted_list(missing)}"
        )
    return None


def invoke(domain: str, tools: Mapping[str, TauTool], db: Database, name: str, kwargs: Any) -> str:
    """Run one action against ``db`` and return the observation, as tau-bench's ``step`` does.

    Unknown tools give ``Unknown action <name>``; every exception becomes ``Error: <text>``.
    A tool that returns no value (airline ``send_certificate`` with all certificate ids
    taken, where upstream's ``step`` crashes) gives an ``Error:`` text instead of raising.
    """
    spec = tools.get(name) if isinstance(name, str) else None
    if spec is None:
        return f"Unknown action {name}"
    if not isinstance(kwargs, Mapping):
        return f"Error: {spec.class_name}.invoke() argument after ** must be a mapping, not {type(kwargs).__name__}"
    error = binding_error(domain, spec, kwargs)
    if error is not None:
        return error
    try:
        out = spec.func(db, **kwargs)
    except Exception as exc:  # upstream turns every tool exception into the observation
        return f"Error: {exc}"
    if out is None:
        return f"Error: {name} returned no output"
    return out
