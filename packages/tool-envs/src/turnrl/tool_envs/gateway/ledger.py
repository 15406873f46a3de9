"""The token ledger of one gateway session: chains of exact ids, never re-rendered.

A **chain** holds the ids of one conversation so far: its first prompt rendered with the
chat template (tools included), then, alternating, the ids the engine sampled for each
assistant turn (loss mask 1, with their logprobs and weight version) and the **bridge**
to the next request: the chat-template delta of the new non-assistant messages (tool
results, user turns) and the next generation prompt (mask 0). Turns are closed as
:func:`turnrl.tool_envs.trajectory.close_turn` says (stop string, ``<|im_end|>``).

``prepare(messages, tools)`` finds the chain whose messages the request extends — each
assistant message of the request must be one this ledger returned for that turn,
compared normalised: content without a reasoning block and surrounding whitespace, tool
calls by id, name and parsed arguments, other keys ignored — with only non-assistant
messages after it; the prompt is then the chain's ids plus the bridge. Anything else
starts a new chain rendered from scratch, with a logged ``fork_reason``: ``edited`` (an
earlier message differs), ``unknown_assistant`` (an assistant message this ledger never
returned), ``tools_changed``, ``no_extension`` (a retry or resample of an earlier point, an
assistant message last, more messages after an unanswered prompt), ``new_conversation``
(nothing in common, e.g. a sub-agent), ``template_not_prefix`` (the generic bridge could
not prove the template append-only here). Two requests prepared on the same chain end
are both answered: the second ``record`` copies the shared prefix into a new chain with
loss mask 0 (``parallel``), so every sampled token is trained once, under its true prefix.

**Reasoning.** Qwen3's template drops the ``<think>`` block of earlier turns when it
renders a history. The ledger never re-renders: a client that echoes an assistant
message without its reasoning still extends the chain, and the model is trained on the
ids it actually saw (the reasoning included), not on the template's rewrite.

**Bridges.** ``renderer="qwen3"`` (chosen automatically for Qwen3-style templates) uses
:meth:`ChatTokenizer.render_delta` — the text after the end-of-turn token that closes the
history, exact for that family (checked against ``transformers`` in the tests).
``renderer="generic"`` must prove the prefix property: ``render_ids(history)`` is a prefix
of ``render_ids(history + tail, add_generation_prompt=True)``; the bridge is what follows
the history's last end-of-turn token, and without the proof the request forks.

Not thread-safe: calls on one ledger must not overlap (the gateway holds a per-session lock
and runs them in worker threads). Text is encoded with
:meth:`~turnrl.tool_envs.chat.ChatTokenizer.encode_unlocked`, which releases the GIL.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Message
from turnrl.tool_envs.tool_calls import parse_tool_calls, to_openai_tool_calls
from turnrl.tool_envs.trajectory import ContextOverflowError, close_turn

__all__ = ["ContextOverflowError", "Prepared", "SessionLedger"]

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
THINK_START, THINK_END = "<think>", "</think>"
Renderer = Literal["auto", "qwen3", "generic"]


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine; pass it back to :meth:`SessionLedger.record`."""

    chain: int
    """Index of the chain in this session's ledger."""
    prompt_ids: list[int]
    """What the engine is sent."""
    fork_reason: str | None
    """Why a new chain started; None when it extends one (or is the first)."""
    base: int = 0
    """Length of the chain's ids the prompt extends (the rest of the prompt is the bridge)."""
    messages: list[Message] = field(default_factory=list)
    """The request's messages, normalised (text content, tool-call arguments as JSON strings)."""


@dataclass
class _Chain:
    index: int
    fork_reason: str | None
    tools_key: str
    prompt_len: int
    ids: list[int]
    messages: list[Message]
    keys: list[tuple[Any, ...]]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    calls: int = 0

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.mask, self.logprobs, self.versions = [0] * n, [0.0] * n, [None] * n

    def append(
        self,
        ids: list[int],
        mask: int,
        logprobs: list[float] | None = None,
        version: Sequence[int | None] | int | None = None,
    ) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        per_token = version if isinstance(version, Sequence) else [version] * len(ids)
        if len(per_token) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(per_token)} versions")
        self.versions += [v if mask and v is not None and v >= 0 else None for v in per_token]

    @property
    def awaiting_reply(self) -> bool:
        return bool(self.messages[-1]["role"] != "assistant")


class SessionLedger:
    """Every chain of one session, with the exact ids the engine was given and sampled.

    Args:
        tokenizer: The policy model's tokenizer and chat template.
        max_context_tokens: A prompt must leave room for at least one generated token.
        template_kwargs: Extra chat-template variables (e.g. ``enable_thinking=False``).
        renderer: ``qwen3``, ``generic`` or ``auto`` (qwen3 for Qwen3-style templates).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        max_context_tokens: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
        renderer: Renderer = "auto",
    ) -> None:
        if renderer not in ("auto", "qwen3", "generic"):
            raise ValueError(f"renderer must be auto, qwen3 or generic, got {renderer!r}")
        self.chat = tokenizer
        self.max_context_tokens = max_context_tokens
        self.template_kwargs = dict(template_kwargs or {})
        self.renderer = _family(tokenizer.chat_template) if renderer == "auto" else renderer
        self._chains: list[_Chain] = []
        self._returned: set[tuple[Any, ...]] = set()

    # -- requests -------------------------------------------------------------------------

    def prepare(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None
    ) -> Prepared:
        """The engine prompt for a chat request: a chain's ids plus the bridge, or a new chain.

        Raises:
            ValueError: A malformed history (unknown role, a tool result without its call,
                non-text content, tool-call arguments that are not a JSON object).
            ContextOverflowError: The prompt leaves no room to generate.
        """
        msgs = normalise_messages(messages)
        keys = [_key(m) for m in msgs]
        tools_key = json.dumps(tools or [], sort_keys=True)
        reason: str | None = None
        best_k = -1
        for chain in sorted(self._chains, key=lambda c: -len(c.keys)):
            k = _common(chain.keys, keys)
            tail = msgs[k:]
            extends = k == len(chain.keys) and not any(m["role"] == "assistant" for m in tail)
            if extends and chain.tools_key == tools_key and bool(tail) != chain.awaiting_reply:
                bridge = self._bridge(chain, tail, tools)
                if bridge is not None:
                    prompt = chain.ids + bridge
                    self._check_context(prompt)
                    return Prepared(chain.index, prompt, None, len(chain.ids), msgs)
                if best_k < len(keys):
                    reason, best_k = "template_not_prefix", len(keys)
            elif k > best_k:
                reason, best_k = self._why_not(chain, k, msgs, keys, tools_key), k
        prompt = self._render_ids(msgs, tools, True)
        self._check_context(prompt)
        index = len(self._chains)
        if not self._chains:
            reason = None
        chain = _Chain(index, reason, tools_key, len(prompt), list(prompt), msgs, keys)
        self._chains.append(chain)
        if reason:
            logger.info("ledger: new chain %d (%s)", index, reason)
        return Prepared(index, list(prompt), reason, len(prompt), msgs)

    def record(
        self,
        prepared: Prepared,
        ids: list[int],
        logprobs: list[float],
        version: Sequence[int | None] | int | None,
        finish_reason: str,
        *,
        stop_reason: str | int | None = None,
    ) -> Message:
        """Append the engine's sampled ids to the prepared chain; return the assistant message.

        ``version``: the weight version of each id (``Generation.versions``) or one for all;
        None or a negative version where unknown.

        When another call already extended that chain, the prompt is copied into a new
        chain with loss mask 0 (``parallel``) and the ids are appended there.

        Returns:
            ``{"role": "assistant", "content": str | None}`` plus ``tool_calls`` (ids
            ``call_{chain}_{turn}_{i}``) when any and ``reasoning_content`` after a
            ``<think>`` block.
        """
        if len(ids) != len(logprobs):
            raise ValueError(f"engine returned {len(ids)} token ids but {len(logprobs)} logprobs")
        if not 0 <= prepared.chain < len(self._chains):
            raise ValueError(f"chain {prepared.chain} was not prepared by this ledger")
        chain = self._chains[prepared.chain]
        if len(chain.ids) == prepared.base:
            chain.append(prepared.prompt_ids[prepared.base :], 0)
        else:
            index = len(self._chains)
            msgs = prepared.messages
            keys = [_key(m) for m in msgs]
            prompt = list(prepared.prompt_ids)
            chain = _Chain(index, "parallel", chain.tools_key, len(prompt), prompt, msgs, keys)
            self._chains.append(chain)
            logger.info("ledger: new chain %d (parallel to chain %d)", index, prepared.chain)
        chain.append(list(ids), 1, logprobs, version)
        text, closing = close_turn(self.chat, ids, finish_reason, stop_reason)
        chain.append(closing, 0)
        message = _assistant_message(text, f"call_{chain.index}_{chain.calls}_")
        stored = normalise_messages([message], known_call_ids=set())[0]
        chain.messages = [*prepared.messages, stored]
        chain.keys = [*(_key(m) for m in prepared.messages), _key(stored)]
        chain.calls += 1
        self._returned.add(chain.keys[-1])
        return message

    def rows(self) -> list[dict[str, Any]]:
        """One row per chain that made engine calls.

        ``loss_mask``, ``logprobs`` and ``versions`` are aligned with ``ids`` (prompt
        included; logprob 0.0 and version ``None`` where not sampled). ``prompt_ids`` is the
        first rendered prompt, or for a ``parallel`` chain the whole copied prefix.
        """
        return [
            {
                "chain": c.index,
                "fork_reason": c.fork_reason,
                "prompt_ids": c.ids[: c.prompt_len],
                "ids": list(c.ids),
                "loss_mask": list(c.mask),
                "logprobs": list(c.logprobs),
                "versions": list(c.versions),
                "calls": c.calls,
            }
            for c in self._chains
            if c.calls
        ]

    # -- internals ------------------------------------------------------------------------

    def _check_context(self, prompt: list[int]) -> None:
        limit = self.max_context_tokens
        if limit is not None and len(prompt) >= limit:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens; max_context_tokens={limit} leaves no "
                "room to generate"
            )

    def _bridge(
        self, chain: _Chain, tail: list[Message], tools: list[dict[str, Any]] | None
    ) -> list[int] | None:
        """Ids that follow the chain for ``tail`` (empty for a repeated unanswered prompt)."""
        if not tail:
            return []
        eot = self.chat.end_of_turn_id
        close = [] if chain.ids[-1] == eot else [eot]  # a turn cut by length/abort
        kwargs = self.template_kwargs
        if self.renderer == "qwen3":
            try:
                delta = self.chat.render_delta(chain.messages, tail, tools, True, **kwargs)
            except ValueError as exc:
                logger.info("ledger: no delta for chain %d: %s", chain.index, exc)
                return None
            return close + self.chat.encode_unlocked(delta)
        before = self._render_ids(chain.messages, tools, False)
        after = self._render_ids([*chain.messages, *tail], tools, True)
        if eot not in before or after[: len(before)] != before:
            return None
        cut = len(before) - before[::-1].index(eot)
        return close + after[cut:]

    def _render_ids(
        self, messages: list[Message], tools: list[dict[str, Any]] | None, prompt: bool
    ) -> list[int]:
        text = self.chat.render(messages, tools, prompt, **self.template_kwargs)
        return self.chat.encode_unlocked(text)

    def _why_not(
        self,
        chain: _Chain,
        k: int,
        msgs: list[Message],
        keys: list[tuple[Any, ...]],
        tools_key: str,
    ) -> str:
        """Why ``msgs`` (sharing ``k`` messages with ``chain``) does not extend it."""
        if k == len(chain.keys):
            tail = [key for key in keys[k:] if key[0] == "assistant"]
            if tail:
                return "no_extension" if tail[0] in self._returned else "unknown_assistant"
            return "tools_changed" if chain.tools_key != tools_key else "no_extension"
        if k == len(msgs):
            return "no_extension"  # the request is an earlier point of the chain
        if msgs[k]["role"] == "assistant" and keys[k] not in self._returned:
            return "unknown_assistant"
        return "edited" if k else "new_conversation"


def _family(template: str) -> str:
    markers = ("<|im_start|>", "<tool_response>", "last_query_index")
    return "qwen3" if all(m in template for m in markers) else "generic"


def _common(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _strip_reasoning(content: str) -> str:
    if THINK_END in content:
        content = content.split(THINK_END)[-1]
    return content.strip()


def _key(message: Message) -> tuple[Any, ...]:
    """What two messages must share to be the same turn (see the module docstring)."""
    role = message["role"]
    if role == "assistant":
        calls = tuple(
            (
                c["id"],
                c["function"]["name"],
                json.dumps(json.loads(c["function"]["arguments"]), sort_keys=True),
            )
            for c in message.get("tool_calls") or []
        )
        return (role, _strip_reasoning(message["content"]), calls)
    if role == "tool":
        return (role, message["tool_call_id"], message["content"])
    return (role, message["content"])


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}: only text content parts are supported, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, text parts or null, not {content!r}")


def normalise_messages(
    messages: list[Message], known_call_ids: set[str] | None = None
) -> list[Message]:
    """Validate an OpenAI chat history and return it with plain-text content.

    Tool-call arguments become JSON strings (a dict is dumped as the template would);
    keys the template does not use are dropped.

    Raises:
        ValueError: Naming the message at fault.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    calls = set(known_call_ids or ())
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (expected one of {ROLES})")
        clean: Message = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant":
            entries = message.get("tool_calls") or []
            if entries:
                clean["tool_calls"] = [
                    _call(e, f"{where}.tool_calls[{j}]") for j, e in enumerate(entries)
                ]
                calls.update(c["id"] for c in clean["tool_calls"])
            if isinstance(message.get("reasoning_content"), str):
                clean["reasoning_content"] = message["reasoning_content"]
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in calls:
                raise ValueError(
                    f"{where}: tool message with tool_call_id {call_id!r} answers no earlier "
                    "assistant tool call"
                )
            clean["tool_call_id"] = call_id
        out.append(clean)
    return out


def _call(entry: Any, where: str) -> dict[str, Any]:
    fn = entry.get("function") if isinstance(entry, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: a tool call needs function.name")
    if not isinstance(entry.get("id"), str) or not entry["id"]:
        raise ValueError(f"{where}: a tool call needs an id")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: function.arguments must be a JSON object, got {arguments!r}")
    return {
        "id": entry["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": arguments},
    }


def _assistant_message(text: str, call_prefix: str) -> Message:
    """The OpenAI assistant message for a turn's text: reasoning, content and tool calls.

    Calls inside the reasoning block are not calls. When a call block is malformed the
    text is returned as content, with no tool calls, so the agent sees what the model wrote.
    """
    reasoning = None
    body = text
    if THINK_END in text:
        head, body = text.split(THINK_END, 1)
        reasoning = head.split(THINK_START, 1)[-1].strip()
    elif text.lstrip().startswith(THINK_START):  # cut inside the reasoning
        reasoning, body = text.lstrip()[len(THINK_START) :].strip(), ""
    parsed = parse_tool_calls(body)
    message: Message = {"role": "assistant", "content": body.strip()}
    if not parsed.errors and parsed.tool_calls:
        for i, call in enumerate(parsed.tool_calls):
            call.id = f"{call_prefix}{i}"
        message["content"] = parsed.content or None
        message["tool_calls"] = to_openai_tool_calls(parsed.tool_calls)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message
