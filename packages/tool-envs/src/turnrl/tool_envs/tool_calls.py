"""Tool calls in the Hermes / Qwen3 format, their validation and the OpenAI adapter.

A model turn may contain several calls::

    Let me look that up.
    <tool_call>
    {"name": "get_order_details", "arguments": {"order_id": "#W123"}}
    </tool_call>

:func:`parse_tool_calls` splits a turn into its free text and calls; a malformed call
never raises — it becomes an entry in ``errors`` that the episode shows to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass
class ToolCall:
    """One parsed call: a tool name and its arguments as a dict."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")


@dataclass
class ParsedTurn:
    """A model turn split into free text, well-formed calls and parse errors."""

    content: str
    """The text outside ``<tool_call>`` blocks, stripped."""
    tool_calls: list[ToolCall]
    """Calls whose JSON parsed into a name and an arguments object."""
    errors: list[str]
    """One model-readable message per malformed call block."""


def parse_tool_calls(text: str) -> ParsedTurn:
    """Parse every ``<tool_call>`` block of a model turn; never raises on bad input."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _BLOCK.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            errors.append(f"Tool call is missing its closing {TOOL_CALL_CLOSE} tag.")
            continue
        call, error = _parse_call(body)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    content = _BLOCK.sub("", text).strip()
    return ParsedTurn(content=content, tool_calls=calls, errors=errors)


def _parse_call(body: str) -> tuple[ToolCall | None, str]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"Tool call is not valid JSON ({exc.msg} at position {exc.pos}): {body[:200]}"
    if not isinstance(data, dict):
        return None, 'Tool call must be a JSON object {"name": ..., "arguments": {...}}.'
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, 'Tool call has no "name" string.'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the OpenAI wire form: a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None, f'Arguments of tool "{name}" are a string that is not valid JSON.'
    if not isinstance(arguments, dict):
        return None, f'Arguments of tool "{name}" must be a JSON object.'
    return ToolCall(name=name, arguments=arguments), ""


def render_tool_call(call: ToolCall) -> str:
    """Render one call in the Hermes format (as the Qwen3 chat template does)."""
    payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def to_openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` entries; ``arguments`` is always a JSON string, as the spec says."""
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in calls
    ]


def from_openai_tool_calls(entries: list[dict[str, Any]]) -> ParsedTurn:
    """Parse OpenAI ``tool_calls`` (arguments as JSON strings, or dicts from lax clients)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for entry in entries:
        fn = entry.get("function") or {}
        body = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})})
        call, error = _parse_call(body)
        if call is None:
            errors.append(error)
            continue
        call.id = str(entry.get("id") or call.id)
        calls.append(call)
    return ParsedTurn(content="", tool_calls=calls, errors=errors)


def validate_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """Check ``arguments`` against a JSON-schema ``parameters`` object (the subset tools use).

    Returns one message per problem: missing required fields, unexpected fields, wrong
    types (recursively for arrays and objects), values outside an ``enum``.
    """
    return _check_object(parameters, arguments, path="")


def _check_object(schema: dict[str, Any], value: dict[str, Any], path: str) -> list[str]:
    errors = []
    props: dict[str, Any] = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in value:
            errors.append(f"missing required argument '{path}{name}'")
    for name, item in value.items():
        if name not in props:
            if props or schema.get("additionalProperties") is False:
                errors.append(f"unexpected argument '{path}{name}'")
            continue
        errors += _check_value(props[name], item, f"{path}{name}")
    return errors


def _check_value(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    if kinds:
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, (object,)))
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and "boolean" not in kinds):
            return [
                f"argument '{path}' must be of type {' or '.join(kinds)}, got {type(value).__name__}"
            ]
    if "enum" in schema and value not in schema["enum"]:
        return [f"argument '{path}' must be one of {schema['enum']}, got {value!r}"]
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            e for i, v in enumerate(value) for e in _check_value(schema["items"], v, f"{path}[{i}]")
        ]
    if isinstance(value, dict) and "properties" in schema:
        return _check_object(schema, value, path=f"{path}.")
    return []
