"""Simulated users for customer-service episodes: an LLM through litellm, and a scripted one.

Both meet :class:`turnrl.tool_envs.protocol.UserSimulator`: ``reset(instruction)`` returns
the user's first message, ``respond(agent_message)`` the next one; a reply containing
``###STOP###`` means the user is done.

:class:`LiteLLMUser` asks any litellm model (``"openai/<name>"`` plus ``api_base`` for a
local OpenAI-compatible server such as turnrl's HTTP router) to play the user described
by the task's instruction. Each call is retried with exponential backoff
(``max_retries``, vime's ``TAU_USER_LITELLM_RETRIES``); when every try fails it raises
:class:`UserSimulatorError`, which the rollout records as a ``failed`` episode. Tokens
and cost are summed over the episode in :attr:`LiteLLMUser.usage`.

litellm is an optional dependency: ``pip install 'turnrl-tool-envs[litellm]'``.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

STOP_TOKEN = "###STOP###"

USER_SYSTEM_PROMPT = """You play a customer talking to a customer-service agent. Stay in \
this role for the whole conversation; you are not an assistant.

Your situation and goal:
{instruction}

How to behave:
- Write only your next message to the agent, one short turn at a time.
- Reveal details only when they are needed for the current step; never recite the whole \
situation at once, and never copy the text above word for word.
- Use only facts given above. If the agent asks for something you were not told, say \
that you do not know or do not have it; do not invent order numbers, names or other data.
- Keep the personality and constraints described above.
- When your goal has been met, or it clearly cannot be met, reply with exactly \
{stop} and nothing else."""

AGENT_GREETING = "Hi! How can I help you today?"


class UserSimulatorError(RuntimeError):
    """The user simulator could not produce a reply (after its retries)."""


def is_stop(message: str) -> bool:
    """True when a user message ends the conversation."""
    return STOP_TOKEN in message


class ScriptedUser:
    """A deterministic user: a list of replies, or a function of (agent message, turn).

    Args:
        replies: The user's messages in order; the first answers ``reset``. When they run out
            the user sends ``###STOP###``. Or a callable ``(agent_message, turn) -> str``
            (``agent_message`` is ``""`` and ``turn`` 0 for the first message).
    """

    def __init__(self, replies: Sequence[str] | Callable[[str, int], str]) -> None:
        if not callable(replies):
            if isinstance(replies, str) or not all(isinstance(r, str) for r in replies):
                raise TypeError("replies must be a sequence of strings or a callable")
            if not replies:
                raise ValueError("a scripted user needs at least one reply")
        self._replies = replies
        self.instruction = ""
        self.turn = 0
        self.transcript: list[tuple[str, str]] = []
        """(agent message, user reply) pairs, for tests and logs."""

    def _next(self, agent_message: str) -> str:
        if callable(self._replies):
            reply = self._replies(agent_message, self.turn)
            if not isinstance(reply, str):
                raise UserSimulatorError(f"scripted user returned {type(reply).__name__}, not str")
        else:
            reply = self._replies[self.turn] if self.turn < len(self._replies) else STOP_TOKEN
        self.turn += 1
        self.transcript.append((agent_message, reply))
        return reply

    async def reset(self, instruction: str) -> str:
        """Start over; return the first scripted message."""
        self.instruction, self.turn, self.transcript = instruction, 0, []
        return self._next("")

    async def respond(self, agent_message: str) -> str:
        """The next scripted message (``###STOP###`` once the script is exhausted)."""
        return self._next(agent_message)


@dataclass
class LiteLLMUserConfig:
    """Model, retries and sampling of the LLM user."""

    model: str
    """litellm model string, e.g. ``"openai/qwen3-4b"`` or ``"gpt-4o"``."""
    api_base: str | None = None
    """Base URL of an OpenAI-compatible server (e.g. ``http://127.0.0.1:8000/v1``)."""
    api_key: str | None = None
    """API key; a placeholder is sent to servers that need none."""
    temperature: float = 0.0
    """Sampling temperature of the user model."""
    max_tokens: int | None = 512
    """Most tokens per user reply."""
    max_retries: int = 3
    """Retries after a failed call (``TAU_USER_LITELLM_RETRIES``); 0 tries once."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled each retry, with up to 25% jitter."""
    max_backoff_s: float = 30.0
    """Longest wait between tries."""
    timeout_s: float = 120.0
    """Timeout of one call."""
    system_prompt: str = USER_SYSTEM_PROMPT
    """Template with ``{instruction}`` and ``{stop}`` placeholders."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for ``litellm.acompletion``."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a litellm model string, e.g. 'openai/<name>'")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff_s and max_backoff_s must be >= 0")
        if "{instruction}" not in self.system_prompt:
            raise ValueError("system_prompt must contain an {instruction} placeholder")

    @classmethod
    def from_env(cls, model: str, **kwargs: Any) -> LiteLLMUserConfig:
        """A config whose ``max_retries`` comes from ``TAU_USER_LITELLM_RETRIES`` when set."""
        raw = os.environ.get("TAU_USER_LITELLM_RETRIES", "").strip()
        if raw:
            try:
                kwargs["max_retries"] = int(raw)
            except ValueError:
                raise ValueError(
                    f"environment variable TAU_USER_LITELLM_RETRIES must be an integer, got {raw!r}"
                ) from None
        return cls(model=model, **kwargs)


@dataclass
class UserUsage:
    """Tokens and cost of the user model, summed over an episode."""

    calls: int = 0
    """Successful calls."""
    failed_calls: int = 0
    """Calls that raised (each retry counts)."""
    prompt_tokens: int = 0
    """Prompt tokens reported by the server."""
    completion_tokens: int = 0
    """Completion tokens reported by the server."""
    cost_usd: float = 0.0
    """Cost from litellm's (local) price map; 0 for models it does not price."""


def _import_litellm() -> Any:
    # Without this litellm fetches its price map from the network at import time.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError as exc:
        raise ImportError(
            "LiteLLMUser needs litellm: pip install 'turnrl-tool-envs[litellm]'"
        ) from exc
    litellm.suppress_debug_info = True  # our errors say what failed; no banner per failure
    return litellm


class LiteLLMUser:
    """A user simulated by an LLM through ``litellm.acompletion`` with retries and accounting."""

    def __init__(self, config: LiteLLMUserConfig) -> None:
        self.config = config
        self._litellm = _import_litellm()
        self.messages: list[dict[str, Any]] = []
        self.usage = UserUsage()
        self.tools: list[dict[str, Any]] = []

    async def reset(self, instruction: str) -> Any:
        """Start a conversation for ``instruction``; return the user's first message (with
        tools offered, it may be an assistant message whose ``tool_calls`` use them)."""
        system = self.config.system_prompt.format(instruction=instruction, stop=STOP_TOKEN)
        self.messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": AGENT_GREETING},
        ]
        self.usage = UserUsage()
        return await self._reply()

    async def respond(self, agent_message: str) -> Any:
        """Answer the agent; ``###STOP###`` in the answer ends the episode."""
        if not self.messages:
            raise UserSimulatorError("respond() called before reset()")
        self.messages.append({"role": "user", "content": agent_message})
        return await self._reply()

    def use_tools(self, schemas: list[dict[str, Any]]) -> None:
        """Offer the user these tools (tau2 telecom's phone); its replies may then call them."""
        self.tools = list(schemas)

    async def tool_results(self, results: list[dict[str, Any]]) -> Any:
        """The results of the user's own tool calls; returns its next reply."""
        for result in results:
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": result.get("tool_call_id", ""),
                    "content": str(result.get("content", "")),
                }
            )
        return await self._reply()

    async def _reply(self) -> Any:
        reply = await complete(self._litellm, self.config, self.messages, self.usage, self.tools)
        if isinstance(reply, dict):
            self.messages.append(reply)
        else:
            self.messages.append({"role": "assistant", "content": reply})
        return reply


async def complete(
    litellm: Any,
    cfg: LiteLLMUserConfig,
    messages: list[dict[str, Any]],
    usage: UserUsage,
    tools: list[dict[str, Any]] | None = None,
) -> Any:
    """One chat completion through ``litellm.acompletion`` with ``cfg``'s retries and backoff.

    Shared by the LLM user and the tau2 judge; tokens and cost go to ``usage``. Returns the
    text, or with ``tools`` offered and called, the assistant message (OpenAI format, with
    ``tool_calls``). Raises :class:`UserSimulatorError` when every try failed or returned
    an empty message.
    """
    last_error: BaseException | None = None
    for attempt in range(cfg.max_retries + 1):
        if attempt:
            delay = min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * (1 + 0.25 * random.random()))
        try:
            response = await litellm.acompletion(
                model=cfg.model,
                messages=list(messages),
                api_base=cfg.api_base,
                api_key=cfg.api_key or "not-needed",
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                timeout=cfg.timeout_s,
                num_retries=0,
                max_retries=0,  # retries are ours, counted and backed off
                **({"tools": tools} if tools else {}),
                **cfg.extra,
            )
            message = response.choices[0].message
            calls = _tool_calls(message) if tools else []
            content = message.content
            if not calls and (not isinstance(content, str) or not content.strip()):
                raise UserSimulatorError(f"{cfg.model!r} returned an empty message")
        except Exception as exc:
            usage.failed_calls += 1
            last_error = exc
            continue
        _account(litellm, usage, response)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": calls}
        return content.strip()
    raise UserSimulatorError(
        f"{cfg.model!r} failed after {cfg.max_retries + 1} tries: "
        f"{type(last_error).__name__}: {last_error}"
    ) from last_error


def _tool_calls(message: Any) -> list[dict[str, Any]]:
    """The tool calls of a litellm message as plain OpenAI dicts (arguments as JSON text)."""
    out = []
    for call in getattr(message, "tool_calls", None) or []:
        function = call.function
        out.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": function.name, "arguments": function.arguments or "{}"},
            }
        )
    return out


def _account(litellm: Any, usage: UserUsage, response: Any) -> None:
    usage.calls += 1
    counts = getattr(response, "usage", None)
    usage.prompt_tokens += int(getattr(counts, "prompt_tokens", 0) or 0)
    usage.completion_tokens += int(getattr(counts, "completion_tokens", 0) or 0)
    try:
        cost = litellm.completion_cost(completion_response=response)
    except Exception:  # models missing from the price map cost nothing here
        cost = 0.0
    usage.cost_usd += float(cost or 0.0)
