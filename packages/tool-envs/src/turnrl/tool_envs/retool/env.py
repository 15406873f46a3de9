"""The ReTool environment: a math problem, a ``code_interpreter`` tool, an answer in ``\\boxed{}``.

As in verl's ReTool recipe, the model may call one tool, ``code_interpreter``, with a
``code`` argument (a Hermes ``<tool_call>``); the code runs in the sandbox (turnrl's or a
SandboxFusion server, through :class:`~turnrl.tool_envs.sandbox.SandboxClient`) and its
stdout/stderr comes back as the tool message. The episode ends when the model answers
without a tool call (its final answer is the last ``\\boxed{...}``) or after ``max_turns``
assistant turns.

Tool messages are cut here by characters (head and tail kept, a marker in between); the
trajectory layer then enforces its token budget. A sandbox that cannot run the code (down,
erroring, after the client's retries) is not the policy's doing: :meth:`RetoolEnv.step`
raises :class:`SandboxUnavailableError`, so the rollout marks the episode ``failed`` and
training leaves it out, instead of scoring the model against an outage.

``StepResult.info`` carries what the ReTool reward needs: ``num_turns``,
``num_tool_calls``, ``num_tool_errors``, ``final_answer`` and ``done_reason``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from turnrl.tool_envs.protocol import Message, StepResult
from turnrl.tool_envs.sandbox.client import RunResult, SandboxClient
from turnrl.tool_envs.tool_calls import ToolCall, from_openai_tool_calls
from turnrl.tool_envs.tools import ToolSet

CODE_INTERPRETER = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "A tool for executing code. Runs the code and returns its standard "
        "output and standard error. Print the values you need.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to execute."}},
            "required": ["code"],
        },
    },
}
DEFAULT_INSTRUCTION = (
    "Solve the problem. You may call the code_interpreter tool to run Python code. "
    "Put your final answer within \\boxed{}."
)


@dataclass
class RetoolConfig:
    """Settings of a ReTool episode."""

    max_turns: int = 16
    """Most assistant turns; the episode ends (``done_reason="max_turns"``) after the last."""
    language: str = "python"
    """Sandbox language the tool's code runs as."""
    run_timeout: float = 30.0
    """Wall-clock seconds per code run (the recipe's sandbox default)."""
    memory_limit_mb: int = 1024
    """Memory limit per code run."""
    max_tool_output_chars: int = 8192
    """Longest tool message in characters; longer output keeps its head and tail."""
    instruction: str = DEFAULT_INSTRUCTION
    """Appended to the problem as the user's message."""
    system_prompt: str | None = None
    """Optional system message before the problem."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_tool_output_chars < 64:
            raise ValueError(
                f"max_tool_output_chars must be >= 64, got {self.max_tool_output_chars}"
            )
        if self.run_timeout <= 0:
            raise ValueError(f"run_timeout must be > 0, got {self.run_timeout}")


def truncate_chars(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters: head and tail with a marker between."""
    if len(text) <= limit:
        return text
    marker = "\n...[{} characters truncated]...\n"
    keep = max(limit - len(marker.format(len(text))), 0)
    head, tail = text[: keep // 2], text[len(text) - (keep - keep // 2) :]
    return head + marker.format(len(text) - keep) + tail


def format_run(result: RunResult, limit: int) -> str:
    """The tool message for one sandbox run."""
    if not result.ran:
        return truncate_chars(
            f"Error: the code interpreter is unavailable ({result.status}): {result.message}", limit
        )
    parts = []
    if result.stdout:
        parts.append(result.stdout)
    if result.stderr:
        parts.append(result.stderr)
    if result.status == "timeout":
        parts.append(f"Error: execution timed out ({result.message}).")
    elif result.truncated:
        parts.append(f"[output truncated by the sandbox: {result.message}]")
    if not parts:
        parts.append("The code ran successfully and printed nothing; use print() to show values.")
    return truncate_chars("\n".join(p.rstrip("\n") for p in parts), limit)


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` in ``text`` (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def problem_text(task: Any) -> str:
    """The problem of a task: a string, or a dict with ``prompt``/``problem``/``Problem``/``question``."""
    if isinstance(task, str):
        return task
    if isinstance(task, dict):
        for key in ("prompt", "problem", "Problem", "question"):
            if isinstance(task.get(key), str):
                return str(task[key])
    raise TypeError(f"a ReTool task is a string or a dict with a 'problem' text, got {task!r:.200}")


class SandboxUnavailableError(RuntimeError):
    """The sandbox could not run a valid call's code (an infrastructure failure)."""


class RetoolEnv:
    """One ReTool episode at a time (make one environment per concurrent episode)."""

    def __init__(self, client: SandboxClient, config: RetoolConfig | None = None) -> None:
        self.client = client
        self.config = config or RetoolConfig()
        self.tools: list[dict[str, Any]] = [CODE_INTERPRETER]
        self._toolset = ToolSet()
        self._toolset.add(CODE_INTERPRETER, lambda code: code)  # used for argument checks only
        self.num_turns = 0
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        self.sandbox_statuses: dict[str, int] = {}
        self.started = False
        self.done = False

    async def reset(self, task: Any) -> list[Message]:
        """Start an episode for ``task``; return the system (optional) and user messages."""
        problem = problem_text(task)
        self.num_turns = self.num_tool_calls = self.num_tool_errors = 0
        self.sandbox_statuses = {}
        self.started, self.done = True, False
        messages: list[Message] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        messages.append({"role": "user", "content": f"{problem}\n\n{self.config.instruction}"})
        return messages

    async def step(self, assistant: Message) -> StepResult:
        """Run the turn's code calls, or end the episode when the turn has none."""
        if not self.started:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("the episode is over; call reset() to start another")
        self.num_turns += 1
        parsed = from_openai_tool_calls(list(assistant.get("tool_calls") or []))
        errors = [str(e) for e in assistant.get("tool_call_errors") or []] + parsed.errors
        observations: list[Message] = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
        invalid = len(errors)
        outputs = await asyncio.gather(*(self._run(call) for call in parsed.tool_calls))
        for call, (text, ok) in zip(parsed.tool_calls, outputs, strict=True):
            observations.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}
            )
            invalid += 0 if ok else 1
        self.num_tool_calls += len(parsed.tool_calls) + len(errors)
        self.num_tool_errors += invalid
        reason = None
        if not parsed.tool_calls and not errors:
            reason = "answered"
        elif self.num_turns >= self.config.max_turns:
            reason = "max_turns"
        self.done = reason is not None
        content = str(assistant.get("content") or "")
        info: dict[str, Any] = {
            "num_turns": self.num_turns,
            "num_tool_calls": self.num_tool_calls,
            "num_tool_errors": self.num_tool_errors,
            "num_invalid_tool_calls": invalid,
            "sandbox_statuses": dict(self.sandbox_statuses),
            "done_reason": reason,
            "final_answer": last_boxed(content) if reason == "answered" else None,
        }
        return StepResult(
            observations=[] if reason == "answered" else observations, done=self.done, info=info
        )

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        """One call's tool message and whether it was a valid call whose code ran."""
        problems = self._toolset.check(call)
        if problems:
            return f"Error: {'; '.join(problems)}", False
        result = await self.client.arun_code(
            call.arguments["code"],
            self.config.language,
            run_timeout=self.config.run_timeout,
            memory_limit_mb=self.config.memory_limit_mb,
        )
        self.sandbox_statuses[result.status] = self.sandbox_statuses.get(result.status, 0) + 1
        if not result.ran:
            raise SandboxUnavailableError(
                f"the sandbox did not run the code ({result.status} after {result.attempts} "
                f"attempt(s)): {result.message}"
            )
        return format_run(result, self.config.max_tool_output_chars), result.ran
