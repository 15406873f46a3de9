"""The token-exact trajectory of one episode and the builder that assembles it turn by turn.

A trajectory is ``prompt_ids`` (the first messages rendered with the chat template and
the generation prompt) followed by ``response_ids``: every model turn exactly as the
engine produced it (``loss_mask`` 1, with the engine's logprobs and the weight version each
token was sampled with), and between turns the tool results and user replies as token
**deltas** of the chat template (``loss_mask`` 0, logprob 0, version -1). Text is never
re-tokenised into the trained tokens.

Rules turnrl follows (see the package README):

* **End of turn after a stop string.** When the engine stops on a stop string and not on
  ``<|im_end|>``, the stop string (if the engine left it out) and ``<|im_end|>`` are
  appended with mask 0: the policy did not sample them, so they are not trained on and
  carry no logprob. A turn that ends on the end-of-turn token keeps it with mask 1.
* **Budgets.** A model turn may use ``min(max_turn_tokens, max_context_tokens - length)``
  tokens; observations that do not fit in the context end the episode as ``truncated``.
* **Tool output** longer than ``max_tool_output_tokens`` is cut by tokens and a visible
  marker says how many were dropped.
* **Prefix stability.** After each turn's observations the whole conversation is rendered
  afresh and compared with the accumulated ids; the first mismatch (token index, turn,
  likely cause) goes to ``metadata["prefix_check"]``, or raises in strict mode. With
  Qwen3's template a mismatch is expected once a user speaks after a turn that had a
  ``<think>`` block: the template drops earlier reasoning, while turnrl keeps the ids the
  model actually saw (cause ``reasoning_stripped``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from turnrl.rollout_router.protocol import UNKNOWN_VERSION
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Generation, Message

Status = Literal["completed", "truncated", "aborted", "failed"]
STATUSES: tuple[str, ...] = get_args(Status)


class PrefixMismatchError(RuntimeError):
    """Strict mode: a fresh render of the conversation differs from the accumulated ids."""


class ContextOverflowError(ValueError):
    """The first messages alone do not fit in the context."""


@dataclass
class Trajectory:
    """One episode, token-exact (the core record every trainer consumes)."""

    prompt_ids: list[int]
    """The first messages rendered with the chat template, ending with the generation prompt."""
    response_ids: list[int]
    """Everything after the prompt: model turns, tool results, user turns."""
    loss_mask: list[int]
    """1 on tokens the policy generated, 0 on tool/user/template tokens; one per response id."""
    rollout_logprobs: list[float]
    """The engine's logprob of each response token; 0.0 where ``loss_mask`` is 0."""
    messages: list[Message] = field(default_factory=list)
    """The conversation in OpenAI format (for rewards, logs and the prefix check)."""
    status: Status = "completed"
    """completed / truncated (context, turns) / aborted (engine abort) / failed (exception)."""
    reward: float = 0.0
    """Scalar reward, set by a reward function after the episode."""
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    """Named reward components (e.g. ``db_match``, ``outputs``, ``shaping``)."""
    num_turns: int = 0
    """Model turns generated."""
    num_tool_calls: int = 0
    """Tool calls the model made (well-formed or not)."""
    num_invalid_tool_calls: int = 0
    """Tool calls that could not be parsed, named an unknown tool or had invalid arguments."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent: ``generate`` (awaiting the engine, queue and HTTP included), ``env``
    (reset and steps: tools and the user simulator), ``user`` (the user simulator alone,
    part of ``env``), ``agent`` (the rest: render, tokenize, parse) and ``total``."""
    group_id: str | None = None
    """The GRPO group (one prompt/task) this sample belongs to."""
    sample_index: int = 0
    """Index of this sample within its group."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything else: ``end_reason``, ``prefix_check``, ``error``, task id, user cost, ..."""
    versions: list[int] = field(default_factory=list)
    """The weight version each response token was sampled with; -1 where ``loss_mask`` is 0
    or the version is unknown (None is read as -1; empty: unknown everywhere)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"response_ids ({n}), loss_mask ({len(self.loss_mask)}) and rollout_logprobs "
                f"({len(self.rollout_logprobs)}) must have the same length"
            )
        versions = self.versions or [UNKNOWN_VERSION] * n
        self.versions = [UNKNOWN_VERSION if v is None else int(v) for v in versions]
        if len(self.versions) != n:
            raise ValueError(f"versions ({len(self.versions)}) must have one per response id ({n})")
        if any(
            m == 0 and v != UNKNOWN_VERSION
            for m, v in zip(self.loss_mask, self.versions, strict=True)
        ):
            raise ValueError(f"versions must be {UNKNOWN_VERSION} where loss_mask is 0")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask values must be 0 or 1")
        if any(
            m == 0 and lp != 0.0
            for m, lp in zip(self.loss_mask, self.rollout_logprobs, strict=True)
        ):
            raise ValueError("rollout_logprobs must be 0.0 where loss_mask is 0")

    @property
    def ids(self) -> list[int]:
        """Prompt and response ids, the full sequence."""
        return self.prompt_ids + self.response_ids

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the policy generated (``sum(loss_mask)``)."""
        return sum(self.loss_mask)

    def text(self) -> str:
        """The episode as plain text for logs: every message with its role (tool calls as
        JSON), then status and reward."""
        lines = []
        for message in self.messages:
            calls = message.get("tool_calls")
            parts = [message.get("content") or "", json.dumps(calls, default=str) if calls else ""]
            lines.append(f"[{message.get('role', '?')}] {' '.join(p for p in parts if p)}".rstrip())
        lines.append(f"status={self.status} reward={self.reward}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


@dataclass
class TrajectoryLimits:
    """Token and turn limits of one episode."""

    max_context_tokens: int = 16384
    """Most tokens in prompt + response (the engine's context length)."""
    max_turn_tokens: int = 2048
    """Most tokens one model turn may generate (further capped by the remaining context)."""
    max_turns: int = 10
    """Most model turns (vime's ``TAU_MAX_TURNS``)."""
    max_tool_output_tokens: int | None = 2048
    """Tool results longer than this are cut (by tokens) with a marker; None keeps them whole."""
    truncation_marker: str = "\n[... {n} tokens truncated]"
    """Appended to a cut tool result; ``{n}`` is the number of tokens dropped."""
    check_prefix: bool = True
    """After each turn, compare a fresh render of the conversation with the accumulated ids."""
    strict_prefix: bool = False
    """Raise :class:`PrefixMismatchError` on a mismatch instead of recording it."""

    def __post_init__(self) -> None:
        for name in ("max_context_tokens", "max_turn_tokens", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tool_output_tokens is not None and self.max_tool_output_tokens < 1:
            raise ValueError(
                f"max_tool_output_tokens must be >= 1 or None, got {self.max_tool_output_tokens}"
            )
        if self.strict_prefix and not self.check_prefix:
            raise ValueError("strict_prefix needs check_prefix")


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def close_turn(
    chat: ChatTokenizer, ids: Sequence[int], finish_reason: str, stop_reason: str | int | None
) -> tuple[str, list[int]]:
    """The text of one engine turn and the ids (mask 0) that close it, per the rule above.

    A turn ending on a stop token needs nothing; one that stopped on a stop string gets the
    string (when the engine left it out) and the end-of-turn token; a turn cut by ``length``
    or ``abort`` stays open (empty closing ids).

    Returns:
        The turn's text without the end-of-turn token (stop string included), and the
        closing ids.
    """
    ends_on_token = bool(ids) and ids[-1] in set(chat.stop_token_ids)
    text = chat.decode(ids[:-1] if ends_on_token else ids)
    closing: list[int] = []
    if finish_reason == "stop" and not ends_on_token:
        if isinstance(stop_reason, str) and stop_reason and not text.endswith(stop_reason):
            closing += chat.encode(stop_reason)
            text += stop_reason
        closing.append(chat.end_of_turn_id)
    return text, closing


class TrajectoryBuilder:
    """Accumulates one episode's tokens: engine turns (mask 1) and observation deltas (mask 0).

    Args:
        chat: Tokenizer and chat template of the policy model.
        messages: The episode's first messages (from ``Environment.reset``).
        tools: Tool schemas rendered into the prompt.
        limits: Token and turn limits.
        template_kwargs: Extra chat-template variables (e.g. ``enable_thinking``).

    Raises:
        ContextOverflowError: The first messages leave no room to generate.
    """

    def __init__(
        self,
        chat: ChatTokenizer,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        limits: TrajectoryLimits | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.chat = chat
        self.tools = list(tools) if tools else None
        self.limits = limits or TrajectoryLimits()
        self.template_kwargs = dict(template_kwargs or {})
        self.messages: list[Message] = [dict(m) for m in messages]
        self.prompt_ids = chat.render_ids(self.messages, self.tools, True, **self.template_kwargs)
        if len(self.prompt_ids) >= self.limits.max_context_tokens:
            raise ContextOverflowError(
                f"prompt has {len(self.prompt_ids)} tokens, context is "
                f"{self.limits.max_context_tokens}"
            )
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.num_turns = 0
        self.num_appended_end_of_turn = 0
        self.num_truncated_tool_outputs = 0
        self._prefix: dict[str, Any] = {
            "checked_turns": 0,
            "mismatched_turns": 0,
            "first_mismatch_index": None,
        }
        self._turn_open = False
        self._stable: tuple[str, int] = ("", 0)  # verified (text, ids) prefix of the last check

    @property
    def ids(self) -> list[int]:
        """The full sequence so far: the next engine input."""
        return self.prompt_ids + self.response_ids

    def turn_budget(self) -> int:
        """Tokens the next model turn may generate (0 when the context is full)."""
        room = self.limits.max_context_tokens - len(self.prompt_ids) - len(self.response_ids)
        return max(0, min(self.limits.max_turn_tokens, room))

    def _append(
        self,
        ids: Sequence[int],
        mask: int,
        logprobs: Sequence[float] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend(versions if versions is not None else [UNKNOWN_VERSION] * len(ids))

    def add_generation(self, generation: Generation) -> str:
        """Append one engine turn (mask 1) and close it with end-of-turn if it stopped on a string.

        Returns:
            The turn's text without the end-of-turn token (stop string included), to parse.

        Raises:
            ValueError: Token ids and logprobs differ in length, or a turn is already open.
        """
        ids, logprobs = list(generation.token_ids), list(generation.logprobs)
        versions = list(generation.versions) or [UNKNOWN_VERSION] * len(ids)
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"engine returned {len(ids)} token ids but {len(logprobs)} logprobs and "
                f"{len(versions)} versions"
            )
        if self._turn_open:
            raise ValueError("add_message() must record the previous turn before a new generation")
        self._append(ids, 1, logprobs, versions)
        self.num_turns += 1
        self._turn_open = True
        text, closing = close_turn(self.chat, ids, generation.finish_reason, generation.stop_reason)
        if closing:
            self._append(closing, 0)
            self.num_appended_end_of_turn += 1
        return text

    def add_message(self, assistant: Message) -> None:
        """Record the assistant message of the turn just generated (for renders and rewards)."""
        if not self._turn_open:
            raise ValueError("add_message() called without a generated turn")
        self.messages.append(dict(assistant))
        self._turn_open = False

    def _truncate(self, message: Message) -> Message:
        limit = self.limits.max_tool_output_tokens
        content = message.get("content")
        if message.get("role") != "tool" or limit is None or not isinstance(content, str):
            return dict(message)
        ids = self.chat.encode(content)
        if len(ids) <= limit:
            return dict(message)
        kept = self.chat.decode(ids[:limit]).rstrip("\ufffd")  # drop a cut multi-byte char
        self.num_truncated_tool_outputs += 1
        marker = self.limits.truncation_marker.format(n=len(ids) - limit)
        return {**message, "content": kept + marker}

    def add_observations(self, observations: Sequence[Message]) -> bool:
        """Append tool results / user replies as a template delta (mask 0), then check the prefix.

        Returns:
            False (and appends nothing) when the delta would leave no room for another turn.

        Raises:
            ValueError: Called before the turn's assistant message was recorded.
            PrefixMismatchError: Strict mode and the fresh render differs.
        """
        if self._turn_open:
            raise ValueError("add_message() must record the assistant turn before observations")
        if not observations:
            raise ValueError("add_observations needs at least one message")
        new = [self._truncate(m) for m in observations]
        delta = self.chat.render_delta(self.messages, new, self.tools, True, **self.template_kwargs)
        delta_ids = self.chat.encode(delta)
        if len(self.ids) + len(delta_ids) >= self.limits.max_context_tokens:
            return False
        self._append(delta_ids, 0)
        self.messages.extend(new)
        if self.limits.check_prefix:
            self.check_prefix()
        return True

    def check_prefix(self) -> int | None:
        """Compare a fresh render of the conversation with the accumulated ids.

        Returns:
            The first differing token index, or None when they are identical.
        """
        ids = self.ids
        text, fresh = self._fresh_render()
        index = _first_difference(ids, fresh)
        self._prefix["checked_turns"] += 1
        if index is None:
            self._remember_stable(text, fresh)
            return None
        self._prefix["mismatched_turns"] += 1
        if self._prefix["first_mismatch_index"] is None:
            self._prefix.update(
                first_mismatch_index=index,
                first_mismatch_turn=self.num_turns,
                cause=self._mismatch_cause(ids, fresh, index),
            )
        if self.limits.strict_prefix:
            raise PrefixMismatchError(
                f"turn {self.num_turns}: accumulated ids differ from a fresh render at token "
                f"{index} ({self._mismatch_cause(ids, fresh, index)}): "
                f"{self.chat.decode(ids[index : index + 12])!r} vs "
                f"{self.chat.decode(fresh[index : index + 12])!r}"
            )
        return index

    def _fresh_render(self) -> tuple[str, list[int]]:
        """Token ids of a fresh render, encoding only what follows the last verified prefix.

        Tokenizers split text at special tokens before anything else, so the ids of a
        render that starts with the text verified last time (cut right after an end-of-turn
        token) are the verified ids followed by the encoding of the rest. When the template
        rewrote earlier text (``<think>`` stripping) the whole render is encoded.
        """
        text = self.chat.render(self.messages, self.tools, True, **self.template_kwargs)
        stable_text, stable_len = self._stable
        if stable_text and text.startswith(stable_text):
            return text, self.ids[:stable_len] + self.chat.encode(text[len(stable_text) :])
        return text, self.chat.encode(text)

    def _remember_stable(self, text: str, fresh: list[int]) -> None:
        """After a match: the text and ids up to (and with) the last end-of-turn token."""
        eot_text, eot = self.chat.end_of_turn, self.chat.end_of_turn_id
        cut = text.rfind(eot_text)
        count = text.count(eot_text)
        if cut < 0 or fresh.count(eot) != count:
            return  # a content that spells the token differently: keep full re-encoding
        last = len(fresh) - 1 - fresh[::-1].index(eot)
        self._stable = (text[: cut + len(eot_text)], last + 1)

    def _mismatch_cause(self, ids: list[int], fresh: list[int], index: int) -> str:
        if self.chat.decode(ids[index:]).startswith(self.chat.think_start) and not (
            self.chat.decode(fresh[index:]).startswith(self.chat.think_start)
        ):
            return "reasoning_stripped"
        if self.chat.decode(ids) == self.chat.decode(fresh):
            return "tokenization"
        return "template"

    def finish(self, status: Status, end_reason: str, **fields: Any) -> Trajectory:
        """Freeze the episode into a :class:`Trajectory`.

        Args:
            status: The episode's status.
            end_reason: Why it ended (``done``, ``max_turns``, ``context``, ``abort``, ...).
            **fields: Other :class:`Trajectory` fields (counts, timings, group id, metadata).
        """
        metadata = dict(fields.pop("metadata", {}))
        metadata.update(
            end_reason=end_reason,
            prefix_check=dict(self._prefix),
            appended_end_of_turn=self.num_appended_end_of_turn,
            truncated_tool_outputs=self.num_truncated_tool_outputs,
        )
        return Trajectory(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.logprobs),
            versions=list(self.versions),
            messages=[dict(m) for m in self.messages],
            status=status,
            num_turns=self.num_turns,
            metadata=metadata,
            **fields,
        )
