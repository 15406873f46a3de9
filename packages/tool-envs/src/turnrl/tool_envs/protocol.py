"""The small protocols that connect episodes to engines and environments.

Messages are plain OpenAI-format dicts (``{"role", "content", "tool_calls"?, ...}``) so
they render directly through a model's chat template. ``turnrl.rollout_router``'s engine
client meets :class:`TokenEngine` structurally; this package never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Message = dict[str, Any]
FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """Sampling settings for one generation call."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 for all."""
    max_tokens: int = 512
    """Most tokens to generate in this call (the episode may lower it to fit the context)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the engine stops after producing one (not included in the output ids)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop token ids (e.g. ``<|im_end|>``); included in the output ids when produced."""
    seed: int | None = None
    """Per-request seed, for reproducible sampling."""


@dataclass
class Generation:
    """What an engine returns for one token-in/token-out call."""

    token_ids: list[int]
    """Generated token ids, exactly as the engine produced them."""
    logprobs: list[float]
    """Log-probability of each generated token under the sampling distribution."""
    finish_reason: FinishReason
    """``stop`` (stop token/string), ``length`` (max_tokens reached) or ``abort``."""
    stop_reason: str | int | None = None
    """For ``stop``: the stop string matched (str) or stop token id (int); None if unknown."""


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
    """Anything the reward or logs need: tool-call counts, errors, user cost, ..."""


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
