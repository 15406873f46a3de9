"""The three agent APIs in and out of the gateway's canonical form.

In: an OpenAI chat-completions, OpenAI Responses or Anthropic Messages request body becomes a
:class:`ChatRequest`: OpenAI-format messages (``system``/``user``/``assistant`` with
``tool_calls`` and ``reasoning_content``/``tool``) and OpenAI function tools, the form the
token ledger and the chat template take. Out: an :class:`Answer` (the assistant message the
ledger recorded) becomes each API's JSON response or its server-sent event stream.

The run owns sampling: temperature, top-p and top-k in a request are ignored, ``max_tokens``
may only lower the run's cap, and what cannot be honoured (``n > 1``, a forced tool,
``response_format``, ``logit_bias``, stop strings, penalties, top log-probs, images) raises
:class:`RequestError` naming the field (an HTTP 400).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from turnrl.tool_envs.protocol import Message

Api = Literal["chat", "responses", "messages"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
}


class RequestError(ValueError):
    """A request the gateway refuses: the HTTP ``status`` and the offending ``field``."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


@dataclass
class ChatRequest:
    """One agent call in canonical (OpenAI chat) form."""

    api: Api
    messages: list[Message]
    """The conversation, OpenAI format (the Responses API's ``previous_response_id`` history
    is prepended by the service)."""
    tools: list[dict[str, Any]] | None
    """OpenAI function tools (``{"type": "function", "function": {...}}``)."""
    max_tokens: int | None = None
    """The caller's cap on generated tokens (it may only lower the run's)."""
    stream: bool = False
    logprobs: bool = False
    """Chat completions: return the sampled tokens' log-probs."""
    include_usage: bool = False
    """Chat completions stream: end with a usage chunk (``stream_options.include_usage``)."""
    previous_response_id: str | None = None
    """Responses API: continue the stored conversation of this response."""
    store: bool = True
    """Responses API: keep this response's conversation for ``previous_response_id``."""


@dataclass
class Answer:
    """One answered call: the recorded assistant message and its accounting."""

    id: str
    """The call id (``chatcmpl-...``, ``resp_...``, ``msg_...``); rewards may name it."""
    created: int
    model: str
    message: Message
    """The ledger's assistant message: content, tool_calls?, reasoning_content?."""
    finish_reason: str
    """The engine's: ``stop`` or ``length``."""
    prompt_tokens: int
    completion_tokens: int
    token_logprobs: list[tuple[str, float]] | None = None
    """(token text, log-prob) per sampled token, when the request asked for log-probs."""


def error_body(api: Api | None, status: int, message: str, field: str | None = None) -> dict:
    """An error JSON in the style of the API the client speaks."""
    kind = _ERROR_TYPES.get(status, "api_error")
    if api == "messages":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": field, "code": None}}


# -- requests ------------------------------------------------------------------------------


def parse_request(api: Api, body: Any) -> ChatRequest:
    """Parse a request body of ``api``; raises :class:`RequestError` on what it cannot serve."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if api == "chat":
        return _parse_chat(body)
    if api == "responses":
        return _parse_responses(body)
    return _parse_messages(body)


def _refuse(body: dict, field: str, allowed: Any = None) -> None:
    value = body.get(field)
    if value is not None and value != allowed and value not in ({}, [], "", 0, False):
        raise RequestError(
            f"{field} is not supported by this gateway (the training run owns sampling)",
            field=field,
        )


def _cap(body: dict, *fields: str) -> int | None:
    caps = [body[f] for f in fields if body.get(f) is not None]
    for cap in caps:
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise RequestError(f"{fields[0]} must be a positive integer", field=fields[0])
    return min(caps) if caps else None


def _text(content: Any, field: str) -> str:
    """Text of a message content: a string or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text"):
                raise RequestError(f"{field}[{i}] of type {kind!r} is not supported", field=field)
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(f"{field} must be a string or a list of text parts", field=field)


def _function_tools(tools: Any, *, flat: bool) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", field="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported", field="tools")
        fn = tool if flat else tool.get("function")
        if not isinstance(fn, dict) or not fn.get("name"):
            raise RequestError(f"tools[{i}] has no function name", field="tools")
        spec = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        out.append({"type": "function", "function": spec})
    return out


def _check_tool_choice(choice: Any, ok: tuple[str, ...]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is not None and kind not in ok:
        raise RequestError(
            "tool_choice may only be "
            + " or ".join(ok)
            + ": the gateway cannot force a tool call (the model samples freely)",
            field="tool_choice",
        )


def _parse_chat(body: dict) -> ChatRequest:
    if (body.get("n") or 1) != 1:
        raise RequestError("n > 1 is not supported: send one request per sample", field="n")
    _check_tool_choice(body.get("tool_choice"), ("auto", "none"))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("response_format is not supported", field="response_format")
    for field in ("logit_bias", "stop", "presence_penalty", "frequency_penalty", "top_logprobs"):
        _refuse(body, field)
    for field in ("audio", "prediction", "functions"):
        _refuse(body, field)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", field="messages")
    stream_options = body.get("stream_options") or {}
    return ChatRequest(
        api="chat",
        messages=[_chat_message(m, f"messages[{i}]") for i, m in enumerate(messages)],
        tools=_function_tools(body.get("tools"), flat=False),
        max_tokens=_cap(body, "max_completion_tokens", "max_tokens"),
        stream=bool(body.get("stream")),
        logprobs=bool(body.get("logprobs")),
        include_usage=bool(stream_options.get("include_usage")),
    )


def _chat_message(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object", field="messages")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"{where}.role {role!r} is not supported", field="messages")
    out: Message = {"role": role, "content": _text(message.get("content"), f"{where}.content")}
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    if role == "assistant":
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": dict(c.get("function") or {})}
                for c in message["tool_calls"]
            ]
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            out["reasoning_content"] = reasoning
    return out


def _parse_responses(body: dict) -> ChatRequest:
    _check_tool_choice(body.get("tool_choice"), ("auto", "none"))
    text = body.get("text") or {}
    if text.get("format") not in (None, {"type": "text"}):
        raise RequestError("text.format is not supported", field="text.format")
    _refuse(body, "top_logprobs")
    messages: list[Message] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("input must be a string or a list of items", field="input")
    pending: Message | None = None  # the assistant message being assembled from output items
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        role = item.get("role") if isinstance(item, dict) else None
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            fresh = kind == "reasoning" and pending is not None
            fresh = fresh or (kind == "message" and pending is not None and _spoke(pending))
            if pending is None or fresh:
                pending = {"role": "assistant", "content": ""}
                messages.append(pending)
            _add_output_item(pending, item, where)
            continue
        pending = None
        if kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": content}
            )
        elif kind == "message" and role in ("user", "system", "developer"):
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        else:
            raise RequestError(f"{where} of type {kind!r} is not supported", field="input")
    if not messages:
        raise RequestError("input is empty", field="input")
    return ChatRequest(
        api="responses",
        messages=messages,
        tools=_function_tools(body.get("tools"), flat=True),
        max_tokens=_cap(body, "max_output_tokens"),
        stream=bool(body.get("stream")),
        previous_response_id=body.get("previous_response_id"),
        store=body.get("store") is not False,
    )


def _spoke(message: Message) -> bool:
    return bool(message.get("content") or message.get("tool_calls"))


def _add_output_item(message: Message, item: dict, where: str) -> None:
    kind = item.get("type", "message")
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        message["reasoning_content"] = "".join(str(p.get("text", "")) for p in parts)
    elif kind == "message":
        message["content"] = _text(item.get("content"), f"{where}.content")
    else:
        arguments = item.get("arguments", "{}")
        call = {"name": item.get("name"), "arguments": arguments}
        entry = {"id": item.get("call_id"), "type": "function", "function": call}
        message.setdefault("tool_calls", []).append(entry)


def _parse_messages(body: dict) -> ChatRequest:
    _check_tool_choice(body.get("tool_choice"), ("auto", "none"))
    _refuse(body, "stop_sequences")
    messages: list[Message] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("messages must be a non-empty list", field="messages")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where}.role must be user or assistant", field="messages")
        content = turn.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{where}.content must be a string or blocks", field="messages")
        if turn["role"] == "assistant":
            messages.append(_anthropic_assistant(blocks, where))
        else:
            messages.extend(_anthropic_user(blocks, where))
    tools = None
    if body.get("tools"):
        tools = []
        for i, tool in enumerate(body["tools"]):
            if not isinstance(tool, dict) or "input_schema" not in tool:
                raise RequestError(f"tools[{i}]: only custom tools are supported", field="tools")
            spec = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description"):
                spec["description"] = tool["description"]
            tools.append({"type": "function", "function": spec})
    return ChatRequest(
        api="messages",
        messages=messages,
        tools=tools,
        max_tokens=_cap(body, "max_tokens"),
        stream=bool(body.get("stream")),
    )


def _anthropic_assistant(blocks: list, where: str) -> Message:
    out: Message = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            out["content"] += block.get("text", "")
        elif kind == "thinking":
            out["reasoning_content"] = block.get("thinking", "")
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            call = {"name": block.get("name"), "arguments": arguments}
            entry = {"id": block.get("id"), "type": "function", "function": call}
            out.setdefault("tool_calls", []).append(entry)
        elif kind != "redacted_thinking":
            raise RequestError(
                f"{where}.content[{j}] of type {kind!r} unsupported", field="messages"
            )
    return out


def _anthropic_user(blocks: list, where: str) -> list[Message]:
    results: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            content = _text(block.get("content"), f"{where}.content[{j}].content")
            results.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content}
            )
        elif kind == "text":
            texts.append(block.get("text", ""))
        else:
            raise RequestError(
                f"{where}.content[{j}] of type {kind!r} unsupported", field="messages"
            )
    if texts:
        results.append({"role": "user", "content": "".join(texts)})
    return results


# -- responses -----------------------------------------------------------------------------


def _calls(answer: Answer) -> list[dict[str, Any]]:
    return list(answer.message.get("tool_calls") or [])


def _chat_finish(answer: Answer) -> str:
    if answer.finish_reason == "length":
        return "length"
    return "tool_calls" if _calls(answer) else "stop"


def _chat_usage(answer: Answer) -> dict[str, int]:
    total = answer.prompt_tokens + answer.completion_tokens
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": total,
    }


def _chat_logprobs(answer: Answer) -> dict | None:
    if answer.token_logprobs is None:
        return None
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in answer.token_logprobs
    ]
    return {"content": content, "refusal": None}


def chat_completion(answer: Answer) -> dict[str, Any]:
    """The ``chat.completion`` object."""
    message = {k: v for k, v in answer.message.items() if v is not None}
    message.setdefault("content", None)
    choice = {
        "index": 0,
        "message": message,
        "logprobs": _chat_logprobs(answer),
        "finish_reason": _chat_finish(answer),
    }
    return {
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [choice],
        "usage": _chat_usage(answer),
    }


def chat_chunks(answer: Answer, include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects streaming the finished message."""
    head = {
        "id": answer.id,
        "object": "chat.completion.chunk",
        "created": answer.created,
        "model": answer.model,
    }

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice]}

    yield chunk({"role": "assistant", "content": ""})
    if answer.message.get("reasoning_content"):
        yield chunk({"reasoning_content": answer.message["reasoning_content"]})
    if answer.message.get("content"):
        yield chunk({"content": answer.message["content"]}, logprobs=_chat_logprobs(answer))
    for index, call in enumerate(_calls(answer)):
        name = call["function"]["name"]
        start = {"index": index, "id": call["id"], "type": "function"}
        yield chunk({"tool_calls": [{**start, "function": {"name": name, "arguments": ""}}]})
        arguments = {"index": index, "function": {"arguments": call["function"]["arguments"]}}
        yield chunk({"tool_calls": [arguments]})
    yield chunk({}, _chat_finish(answer))
    if include_usage:
        yield {**head, "choices": [], "usage": _chat_usage(answer)}


def _response_items(answer: Answer) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    suffix = answer.id.removeprefix("resp_")
    if answer.message.get("reasoning_content"):
        text = answer.message["reasoning_content"]
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{suffix}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": text}],
            }
        )
    if answer.message.get("content") or not _calls(answer):
        part = {"type": "output_text", "text": answer.message.get("content") or ""}
        items.append(
            {
                "type": "message",
                "id": f"msg_{suffix}",
                "role": "assistant",
                "status": "completed",
                "content": [{**part, "annotations": [], "logprobs": []}],
            }
        )
    for index, call in enumerate(_calls(answer)):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{suffix}_{index}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_object(answer: Answer, status: str | None = None) -> dict[str, Any]:
    """The Responses API ``response`` object (``status`` overrides, for the stream's start)."""
    length = answer.finish_reason == "length"
    done = status is None
    return {
        "id": answer.id,
        "object": "response",
        "created_at": answer.created,
        "model": answer.model,
        "status": status or ("incomplete" if length else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if length and done else None,
        "error": None,
        "output": _response_items(answer) if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        }
        if done
        else None,
    }


def response_events(answer: Answer) -> Iterator[tuple[str, dict[str, Any]]]:
    """The Responses API stream: (event name, data) pairs for the finished response."""
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(seq), **data}

    yield event("response.created", response=response_object(answer, "in_progress"))
    for index, item in enumerate(_response_items(answer)):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event(
                "response.output_item.added", output_index=index, item={**item, "content": []}
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.content_part.added", **at, content_index=0, part=empty)
            yield event(
                "response.output_text.delta", **at, content_index=0, delta=text, logprobs=[]
            )
            yield event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            part = item["content"][0]
            yield event("response.content_part.done", **at, content_index=0, part=part)
        elif item["type"] == "function_call":
            arguments = item["arguments"]
            yield event(
                "response.output_item.added", output_index=index, item={**item, "arguments": ""}
            )
            yield event("response.function_call_arguments.delta", **at, delta=arguments)
            yield event("response.function_call_arguments.done", **at, arguments=arguments)
        else:
            yield event("response.output_item.added", output_index=index, item=item)
        yield event("response.output_item.done", output_index=index, item=item)
    final = response_object(answer)
    name = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield event(name, response=final)


def _anthropic_blocks(answer: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.message.get("reasoning_content"):
        thinking = answer.message["reasoning_content"]
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if answer.message.get("content") or not _calls(answer):
        blocks.append({"type": "text", "text": answer.message.get("content") or ""})
    for call in _calls(answer):
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (TypeError, ValueError):
            arguments = {}
        name = call["function"]["name"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": name, "input": arguments})
    return blocks


def _stop_reason(answer: Answer) -> str:
    if answer.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if _calls(answer) else "end_turn"


def anthropic_message(answer: Answer) -> dict[str, Any]:
    """The Anthropic ``message`` object."""
    return {
        "id": answer.id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": _anthropic_blocks(answer),
        "stop_reason": _stop_reason(answer),
        "stop_sequence": None,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
    }


def anthropic_events(answer: Answer) -> Iterator[tuple[str, dict[str, Any]]]:
    """The Anthropic Messages stream: (event name, data) pairs for the finished message."""
    start = {**anthropic_message(answer), "content": [], "stop_reason": None}
    start["usage"] = {"input_tokens": answer.prompt_tokens, "output_tokens": 0}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(_anthropic_blocks(answer)):
        kind = block["type"]
        empty: dict[str, Any]
        if kind == "text":
            empty = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        elif kind == "thinking":
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": empty,
            },
        )
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    stop = {"stop_reason": _stop_reason(answer), "stop_sequence": None}
    usage = {"output_tokens": answer.completion_tokens}
    yield "message_delta", {"type": "message_delta", "delta": stop, "usage": usage}
    yield "message_stop", {"type": "message_stop"}
