"""A set of tools (OpenAI schemas plus the Python callables behind them) and a generic env.

:meth:`ToolSet.call` never raises for the model's mistakes: an unknown tool, wrong
arguments or an exception inside the tool become an error text for the tool message,
and ``ToolResult.ok`` says whether the call succeeded (rewards count both).

:class:`ToolEnvironment` is the simplest useful :class:`~turnrl.tool_envs.protocol.Environment`:
a system prompt, a tool set and an optional simulated user. Turns with tool calls get
one tool message per call; a turn without calls goes to the user, whose ``###STOP###``
ends the episode (without a user, the first plain answer ends it).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.tool_envs.protocol import Message, StepResult, UserSimulator
from turnrl.tool_envs.tool_calls import ToolCall, from_openai_tool_calls, validate_arguments
from turnrl.tool_envs.user_sim import STOP_TOKEN


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


def visible_text(content: str) -> str:
    """The part of a model message a user sees: without a leading ``<think>`` block."""
    return content.split("</think>")[-1].strip() if "</think>" in content else content.strip()


class ToolEnvironment:
    """An episode of a system prompt, tools and (optionally) a simulated user.

    ``reset`` takes a task: a dict with ``instruction`` (given to the user simulator) or
    ``prompt`` (the first user message, when there is no simulator), or a plain string.

    Args:
        toolset: The tools the agent may call.
        user: The simulated user; None for single-question tasks.
        system_prompt: The agent's system message ("" for none).
    """

    def __init__(
        self, toolset: ToolSet, user: UserSimulator | None = None, system_prompt: str = ""
    ) -> None:
        self.toolset = toolset
        self.user = user
        self.system_prompt = system_prompt
        self.tools = toolset.schemas
        self.num_tool_calls = 0
        self.num_tool_errors = 0

    async def reset(self, task: Any) -> list[Message]:
        """First messages: the system prompt and the user's opening message."""
        if isinstance(task, str):
            task = {"instruction": task} if self.user else {"prompt": task}
        if not isinstance(task, dict):
            raise TypeError(f"task must be a dict or a string, got {type(task).__name__}")
        self.num_tool_calls = self.num_tool_errors = 0
        if self.user is not None:
            if not isinstance(task.get("instruction"), str):
                raise ValueError("a task for a simulated user needs an 'instruction' string")
            first = await self.user.reset(task["instruction"])
        elif isinstance(task.get("prompt"), str):
            first = task["prompt"]
        else:
            raise ValueError("a task without a user simulator needs a 'prompt' string")
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": first}]

    async def step(self, assistant: Message) -> StepResult:
        """Run the turn's tool calls, or pass its text to the user."""
        parsed = from_openai_tool_calls(assistant.get("tool_calls") or [])
        errors = [*assistant.get("tool_call_errors", []), *parsed.errors]
        if parsed.tool_calls or errors:
            return await self._run_tools(parsed.tool_calls, errors, len(parsed.errors))
        if self.user is None:
            return StepResult([], done=True, info=self._info(0))
        start = time.perf_counter()
        reply = await self.user.respond(visible_text(str(assistant.get("content") or "")))
        info = {**self._info(0), "user_s": time.perf_counter() - start}
        return StepResult([{"role": "user", "content": reply}], done=STOP_TOKEN in reply, info=info)

    async def _run_tools(
        self, calls: list[ToolCall], errors: list[str], rejected: int
    ) -> StepResult:
        """One tool message per call, then one per parse error; ``rejected`` counts the
        invalid calls this environment found (parse errors it was handed are the rollout's)."""
        observations: list[Message] = []
        for call in calls:
            result = await self.toolset.call(call)
            rejected += not result.well_formed
            self.num_tool_errors += not result.ok
            observations.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "name": call.name,
                    "content": result.content,
                }
            )
        observations += [{"role": "tool", "content": f"Error: {e}"} for e in errors]
        self.num_tool_calls += len(calls) + len(errors)
        return StepResult(observations, done=False, info=self._info(rejected))

    def _info(self, rejected: int) -> dict[str, Any]:
        info: dict[str, Any] = {
            "num_invalid_tool_calls": rejected,
            "num_tool_calls": self.num_tool_calls,
            "num_tool_errors": self.num_tool_errors,
        }
        usage = getattr(self.user, "usage", None)  # LiteLLMUser: tokens and cost so far
        if dataclasses.is_dataclass(usage) and not isinstance(usage, type):
            info["user_usage"] = dataclasses.asdict(usage)
        return info
