"""A set of tools: OpenAI schemas plus the Python callables behind them.

:meth:`ToolSet.call` never raises for the model's mistakes: an unknown tool, wrong
arguments or an exception inside the tool become an error text for the tool message,
and ``ToolResult.ok`` says whether the call succeeded (rewards count both).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.tool_envs.tool_calls import ToolCall, validate_arguments


@dataclass
class ToolResult:
    """The outcome of one tool call."""

    content: str
    """The text for the tool message (the tool's output, or an ``Error: ...`` text)."""
    ok: bool
    """True when the tool ran and returned normally."""
    well_formed: bool
    """True when the call named a known tool with valid arguments (it may still have failed)."""


class ToolSet:
    """Tools by name; each has an OpenAI function schema and a (sync or async) callable."""

    def __init__(self) -> None:
        self._schemas: dict[str, dict[str, Any]] = {}
        self._funcs: dict[str, Callable[..., Any]] = {}

    def add(self, schema: dict[str, Any], func: Callable[..., Any]) -> None:
        """Register a tool; ``schema`` is ``{"type": "function", "function": {...}}`` or its inner dict."""
        fn = schema.get("function", schema)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool schema has no name: {schema!r}")
        if name in self._schemas:
            raise ValueError(f"tool {name!r} is registered twice")
        self._schemas[name] = {"type": "function", "function": fn}
        self._funcs[name] = func

    @property
    def names(self) -> list[str]:
        return list(self._schemas)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """Schemas in OpenAI function format, in registration order."""
        return list(self._schemas.values())

    def check(self, call: ToolCall) -> list[str]:
        """Problems with a call before running it (unknown tool, bad arguments)."""
        if call.name not in self._schemas:
            return [f"unknown tool '{call.name}'; available tools: {', '.join(self._schemas)}"]
        params = self._schemas[call.name]["function"].get("parameters", {})
        return validate_arguments(params, call.arguments)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; errors become ``ToolResult(ok=False)`` with a model-readable text."""
        problems = self.check(call)
        if problems:
            return ToolResult(f"Error: {'; '.join(problems)}", ok=False, well_formed=False)
        try:
            out = self._funcs[call.name](**call.arguments)
            if inspect.isawaitable(out):
                out = await out
        except Exception as exc:  # a tool's failure is the model's observation, not a crash
            return ToolResult(f"Error: {type(exc).__name__}: {exc}", ok=False, well_formed=True)
        return ToolResult(out if isinstance(out, str) else str(out), ok=True, well_formed=True)
