"""Hermes tool-call parsing, the OpenAI adapter and argument validation, with bad inputs."""

from __future__ import annotations

import json

import pytest

from turnrl.tool_envs.tool_calls import (
    ToolCall,
    from_openai_tool_calls,
    parse_tool_calls,
    render_tool_call,
    to_openai_tool_calls,
    validate_arguments,
)

ORDER = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>'


def test_single_call_and_free_text():
    turn = parse_tool_calls(f"Let me look that up.\n{ORDER}")
    assert turn.content == "Let me look that up."
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("get_order", {"order_id": "#W1"})]
    assert turn.errors == []


def test_several_calls_per_turn_keep_order_and_unique_ids():
    second = (
        '<tool_call>{"name": "cancel", "arguments": {"order_id": "#W1", "reason": "x"}}</tool_call>'
    )
    turn = parse_tool_calls(f"{ORDER}\nand then\n{second}")
    assert [c.name for c in turn.tool_calls] == ["get_order", "cancel"]
    assert turn.content == "and then"
    assert len({c.id for c in turn.tool_calls}) == 2


def test_plain_text_has_no_calls():
    turn = parse_tool_calls("  Your order has shipped.  ")
    assert (turn.content, turn.tool_calls, turn.errors) == ("Your order has shipped.", [], [])


def test_malformed_json_is_an_error_and_other_calls_survive():
    turn = parse_tool_calls('<tool_call>{"name": "get_order", "arguments": {</tool_call>' + ORDER)
    assert [c.name for c in turn.tool_calls] == ["get_order"]
    assert len(turn.errors) == 1 and "not valid JSON" in turn.errors[0]


def test_unterminated_block_is_an_error():
    turn = parse_tool_calls('text <tool_call>{"name": "get_order", "arguments": {}}')
    assert turn.tool_calls == []
    assert "missing its closing </tool_call>" in turn.errors[0]
    assert turn.content == "text"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('["get_order"]', "must be a JSON object"),
        ('{"arguments": {}}', 'no "name" string'),
        ('{"name": "", "arguments": {}}', 'no "name" string'),
        ('{"name": 3, "arguments": {}}', 'no "name" string'),
        ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "f", "arguments": "{not json"}', "not valid JSON"),
    ],
)
def test_bad_call_shapes_become_errors(body, fragment):
    turn = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert turn.tool_calls == []
    assert len(turn.errors) == 1 and fragment in turn.errors[0]


def test_arguments_as_json_string_and_missing_arguments():
    turn = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "g"}</tool_call><tool_call>{"name": "h", "arguments": " "}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("f", {"a": 1}),
        ("g", {}),
        ("h", {}),
    ]


def test_render_then_parse_round_trips():
    call = ToolCall("book", {"seat": "12A", "passengers": [{"name": "Zoë"}], "n": 2})
    parsed = parse_tool_calls(render_tool_call(call)).tool_calls[0]
    assert (parsed.name, parsed.arguments) == (call.name, call.arguments)
    assert "Zoë" in render_tool_call(call)  # not \u-escaped, as the Qwen3 template writes it


def test_openai_adapter_arguments_are_json_strings_and_round_trip():
    calls = [ToolCall("f", {"a": 1, "b": [True, None]}, id="call_1"), ToolCall("g", {})]
    entries = to_openai_tool_calls(calls)
    assert all(isinstance(e["function"]["arguments"], str) for e in entries)
    assert entries[0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1, "b": [true, null]}'},
    }
    back = from_openai_tool_calls(entries)
    assert [(c.id, c.name, c.arguments) for c in back.tool_calls] == [
        ("call_1", "f", {"a": 1, "b": [True, None]}),
        (calls[1].id, "g", {}),
    ]


def test_openai_adapter_accepts_dict_arguments_and_reports_bad_ones():
    back = from_openai_tool_calls(
        [
            {"id": "a", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "b", "function": {"name": "f", "arguments": "{oops"}},
            {"id": "c", "function": {"arguments": "{}"}},
            {"id": "d"},
        ]
    )
    assert [(c.id, c.arguments) for c in back.tool_calls] == [("a", {"x": 1})]
    assert len(back.errors) == 3
    assert "not valid JSON" in back.errors[0] and 'no "name"' in back.errors[1]


SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "count": {"type": "integer"},
        "price": {"type": "number"},
        "express": {"type": "boolean"},
        "reason": {"type": "string", "enum": ["no longer needed", "ordered by mistake"]},
        "item_ids": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string"}},
            "required": ["zip"],
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id"],
}


def test_valid_arguments_have_no_problems():
    args = {
        "order_id": "#W1",
        "count": 2,
        "price": 3,
        "express": False,
        "reason": "ordered by mistake",
        "item_ids": ["1", "2"],
        "address": {"zip": "02110"},
        "note": None,
    }
    assert validate_arguments(SCHEMA, args) == []
    assert validate_arguments(SCHEMA, {"order_id": "#W1", "price": 2.5, "note": "x"}) == []


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({}, "missing required argument 'order_id'"),
        ({"order_id": "#W1", "colour": "red"}, "unexpected argument 'colour'"),
        ({"order_id": 12}, "argument 'order_id' must be of type string, got int"),
        ({"order_id": "#W1", "count": "2"}, "argument 'count' must be of type integer, got str"),
        ({"order_id": "#W1", "count": 2.5}, "argument 'count' must be of type integer, got float"),
        ({"order_id": "#W1", "count": True}, "argument 'count' must be of type integer, got bool"),
        ({"order_id": "#W1", "express": 1}, "argument 'express' must be of type boolean, got int"),
        ({"order_id": "#W1", "reason": "bored"}, "argument 'reason' must be one of"),
        (
            {"order_id": "#W1", "item_ids": ["1", 2]},
            "argument 'item_ids[1]' must be of type string",
        ),
        ({"order_id": "#W1", "item_ids": "1"}, "argument 'item_ids' must be of type array"),
        ({"order_id": "#W1", "address": {}}, "missing required argument 'address.zip'"),
        (
            {"order_id": "#W1", "address": {"zip": 2110}},
            "argument 'address.zip' must be of type string",
        ),
        ({"order_id": "#W1", "note": 3}, "argument 'note' must be of type string or null"),
    ],
)
def test_each_argument_problem_is_reported(args, problem):
    problems = validate_arguments(SCHEMA, args)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_additional_properties_false_without_properties():
    schema = {"type": "object", "properties": {}, "additionalProperties": False}
    assert validate_arguments(schema, {"x": 1}) == ["unexpected argument 'x'"]
    assert validate_arguments({"type": "object"}, {"x": 1}) == []  # free-form object


def test_qwen3_template_renders_openai_calls_as_the_model_writes_them(qwen3):
    # A turn the model wrote canonically renders back to the same text from OpenAI form.
    text = f"Checking.\n{ORDER}"
    turn = parse_tool_calls(text)
    message = {
        "role": "assistant",
        "content": turn.content,
        "tool_calls": to_openai_tool_calls(turn.tool_calls),
    }
    rendered = qwen3.render(
        [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "ok"}]
    )
    assert f"<|im_start|>assistant\n{text}<|im_end|>" in rendered
    assert json.loads(ORDER.split("\n")[1]) == {
        "name": "get_order",
        "arguments": {"order_id": "#W1"},
    }
