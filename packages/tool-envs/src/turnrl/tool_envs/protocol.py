"""The small protocols that connect episodes to engines and environments.

Messages are plain OpenAI-format dicts (``{"role", "content", "tool_calls"?, ...}``) so
they render directly through a model's chat template. The engine records
(:class:`SamplingParams`, :class:`Generation`, ``FinishReason``) are
``turnrl.rollout_router.protocol``'s, re-exported here; its engine client and router meet
:class:`TokenEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from turnrl.rollout_router.protocol import FinishReason, Generation, SamplingParams

__all__ = [
    "Environment",
    "FinishReason",
    "Generation",
    "Message",
    "SamplingParams",
    "StepResult",
    "TokenEngine",
    "UserSimulator",
]

Message = dict[str, Any]


@runtime_checkable
class TokenEngine(Protocol):
    """Anything that generates tokens from token ids (an engine client or a router)."""

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        """Generate a continuation of ``prompt_ids``; ``session_id`` keeps a session sticky."""
        ...


@dataclass
class StepResult:
    """The environment's answer to one assistant turn."""

    observations: list[Message]
    """Messages to append after the assistant turn (tool results, then the user's reply)."""
    done: bool
    """True when the episode is over (user stopped, transfer, max invalid calls, ...)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything the reward or logs need: tool-call counts, errors, user cost, ...; ``user_s``
    (seconds the step spent in the user simulator) is added to the episode's ``timings``."""


@runtime_checkable
class Environment(Protocol):
    """An async multi-turn environment."""

    tools: list[dict[str, Any]]
    """Tool schemas in OpenAI function format (``{"type": "function", "function": {...}}``)."""

    async def reset(self, task: Any) -> list[Message]:
        """Start an episode for ``task``; return the first messages (system, user, ...)."""
        ...

    async def step(self, assistant: Message) -> StepResult:
        """Apply the model's turn (content plus parsed ``tool_calls``) and answer it."""
        ...


@runtime_checkable
class UserSimulator(Protocol):
    """The simulated user of a customer-service episode."""

    async def reset(self, instruction: str) -> str:
        """Start a conversation from the task's instruction; return the user's first message."""
        ...

    async def respond(self, agent_message: str) -> str:
        """Answer the agent's message; ``###STOP###`` in the reply ends the episode."""
        ...
