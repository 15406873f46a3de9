"""Trajectory record and TrajectoryBuilder on the real Qwen3 tokenizer and chat template."""

from __future__ import annotations

import json

import pytest

from turnrl.tool_envs.protocol import Generation
from turnrl.tool_envs.trajectory import (
    ContextOverflowError,
    PrefixMismatchError,
    Trajectory,
    TrajectoryBuilder,
    TrajectoryLimits,
)

SYSTEM = {"role": "system", "content": "You are a retail agent."}
USER = {"role": "user", "content": "Where is order #W1?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]
CALL_TEXT = (
    'Checking.\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>'
)
CALL_MESSAGE = {
    "role": "assistant",
    "content": "Checking.",
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_order", "arguments": '{"order_id": "#W1"}'},
        }
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": '{"status": "pending"}'}


def gen(chat, text: str, end: bool = True, finish: str = "stop", **kw) -> Generation:
    ids = chat.encode(text) + ([chat.end_of_turn_id] if end else [])
    return Generation(ids, [-0.5 - i / 100 for i in range(len(ids))], finish, **kw)  # type: ignore[arg-type]


def builder(chat, **limits) -> TrajectoryBuilder:
    return TrajectoryBuilder(chat, [SYSTEM, USER], TOOLS, TrajectoryLimits(**limits))


# -- the record ----------------------------------------------------------------------------


def test_trajectory_validates_its_fields():
    Trajectory([1], [2, 3], [1, 0], [-0.1, 0.0])
    with pytest.raises(ValueError, match="status must be one of"):
        Trajectory([1], [], [], [], status="done")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same length"):
        Trajectory([1], [2, 3], [1], [-0.1, 0.0])
    with pytest.raises(ValueError, match="0 or 1"):
        Trajectory([1], [2], [2], [0.0])
    with pytest.raises(ValueError, match=r"0\.0 where loss_mask is 0"):
        Trajectory([1], [2], [0], [-1.0])


def test_trajectory_versions_default_to_unknown_and_are_checked():
    t = Trajectory([1], [2, 3, 4], [1, 1, 0], [-0.1, -0.2, 0.0], versions=[3, None, None])
    assert t.versions == [3, -1, -1]
    assert Trajectory([1], [2, 3], [1, 0], [-0.1, 0.0]).versions == [-1, -1]
    with pytest.raises(ValueError, match="one per response id"):
        Trajectory([1], [2, 3], [1, 0], [-0.1, 0.0], versions=[1])
    with pytest.raises(ValueError, match="-1 where loss_mask is 0"):
        Trajectory([1], [2, 3], [1, 0], [-0.1, 0.0], versions=[1, 1])


def test_trajectory_round_trips_through_json():
    t = Trajectory(
        [1, 2],
        [3, 4],
        [1, 0],
        [-0.5, 0.0],
        messages=[USER],
        status="truncated",
        reward=1.0,
        reward_breakdown={"db": 1.0},
        group_id="g",
        sample_index=3,
        metadata={"end_reason": "max_turns"},
    )
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t and back.ids == [1, 2, 3, 4] and back.num_generated_tokens == 1


def test_trajectory_text_shows_each_message_its_tool_calls_status_and_reward():
    call = {"name": "get_order_details", "arguments": {"order_id": "#W1"}}
    t = Trajectory(
        [1],
        [],
        [],
        [],
        messages=[USER, {"role": "assistant", "content": None, "tool_calls": [call]}],
        status="truncated",
        reward=0.5,
    )
    lines = t.text().splitlines()
    assert lines[0].startswith("[user] ") and USER["content"] in lines[0]
    assert lines[1] == f"[assistant] {json.dumps([call])}"
    assert lines[-1] == "status=truncated reward=0.5"


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        ({"max_context_tokens": 0}, "max_context_tokens"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turn_tokens": 0}, "max_turn_tokens"),
        ({"max_tool_output_tokens": 0}, "max_tool_output"),
        ({"check_prefix": False, "strict_prefix": True}, "strict_prefix needs"),
    ],
)
def test_limits_reject_bad_values(limits, match):
    with pytest.raises(ValueError, match=match):
        TrajectoryLimits(**limits)


# -- building ------------------------------------------------------------------------------


def test_tool_turn_is_token_exact_and_prefix_stable(qwen3):
    b = builder(qwen3)
    assert b.prompt_ids == qwen3.render_ids([SYSTEM, USER], TOOLS, add_generation_prompt=True)
    g1 = gen(qwen3, CALL_TEXT)
    assert b.add_generation(g1) == CALL_TEXT
    b.add_message(CALL_MESSAGE)
    assert b.add_observations([TOOL_RESULT])
    g2 = gen(qwen3, "Your order is pending.")
    b.add_generation(g2)
    b.add_message({"role": "assistant", "content": "Your order is pending."})
    t = b.finish("completed", "done")
    n1, n2 = len(g1.token_ids), len(g2.token_ids)
    assert t.response_ids[:n1] == g1.token_ids and t.response_ids[-n2:] == g2.token_ids
    assert t.loss_mask[:n1] == [1] * n1 and t.loss_mask[-n2:] == [1] * n2
    assert set(t.loss_mask[n1:-n2]) == {0}
    assert t.rollout_logprobs[:n1] == g1.logprobs and t.rollout_logprobs[-n2:] == g2.logprobs
    delta = qwen3.decode(t.response_ids[n1:-n2])
    assert delta.startswith("\n<|im_start|>user\n<tool_response>\n")
    assert delta.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    check = t.metadata["prefix_check"]
    assert check == {"checked_turns": 1, "mismatched_turns": 0, "first_mismatch_index": None}
    assert t.num_turns == 2 and t.status == "completed" and t.metadata["end_reason"] == "done"


def test_each_sampled_token_keeps_its_weight_version(qwen3):
    """A turn resumed across a weight update has two versions; tool deltas and appended
    end-of-turn tokens -1; a generation without versions is unknown (-1) throughout."""
    b = builder(qwen3)
    text = CALL_TEXT.removesuffix("</tool_call>")
    g1 = gen(qwen3, text, end=False, stop_reason="</tool_call>")
    n1 = len(g1.token_ids)
    g1.versions = [2] * 3 + [3] * (n1 - 3)
    b.add_generation(g1)
    b.add_message(CALL_MESSAGE)
    b.add_observations([TOOL_RESULT])
    g2 = gen(qwen3, "Your order is pending.")
    b.add_generation(g2)
    t = b.finish("completed", "done")
    n2 = len(g2.token_ids)
    assert t.versions[:n1] == g1.versions and t.versions[-n2:] == [-1] * n2
    assert set(t.versions[n1:-n2]) == {-1} and len(t.versions) == len(t.response_ids)
    g3 = gen(qwen3, "Hi")
    g3.versions = [1]
    with pytest.raises(ValueError, match="versions"):
        builder(qwen3).add_generation(g3)


def test_stop_string_gets_masked_end_of_turn(qwen3):
    b = builder(qwen3)
    # the engine stopped on "</tool_call>" and left it out of its ids: both are appended, mask 0
    text = CALL_TEXT.removesuffix("</tool_call>")
    g = gen(qwen3, text, end=False, stop_reason="</tool_call>")
    assert b.add_generation(g) == CALL_TEXT
    n = len(g.token_ids)
    tail = b.response_ids[n:]
    assert tail == [*qwen3.encode("</tool_call>"), qwen3.end_of_turn_id]
    assert b.loss_mask[n:] == [0] * len(tail) and b.logprobs[n:] == [0.0] * len(tail)
    b.add_message(CALL_MESSAGE)
    b.add_observations([TOOL_RESULT])
    assert b.check_prefix() is None  # the closed turn renders back exactly


def test_stop_string_included_by_engine_only_gets_end_of_turn(qwen3):
    b = builder(qwen3)
    g = gen(qwen3, CALL_TEXT, end=False, stop_reason="</tool_call>")
    b.add_generation(g)
    assert b.response_ids[len(g.token_ids) :] == [qwen3.end_of_turn_id]
    b2 = builder(qwen3)
    b2.add_generation(gen(qwen3, "Done", end=False, stop_reason=None))
    assert b2.response_ids[-1] == qwen3.end_of_turn_id and b2.loss_mask[-1] == 0
    assert b2.finish("completed", "done").metadata["appended_end_of_turn"] == 1


def test_length_finish_appends_nothing(qwen3):
    b = builder(qwen3)
    g = gen(qwen3, "A long answer", end=False, finish="length")
    b.add_generation(g)
    assert b.response_ids == g.token_ids and b.loss_mask == [1] * len(g.token_ids)


def test_generation_and_call_order_errors(qwen3):
    b = builder(qwen3)
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        b.add_generation(Generation([1, 2], [-0.1], "stop"))
    with pytest.raises(ValueError, match="without a generated turn"):
        b.add_message(CALL_MESSAGE)
    b.add_generation(gen(qwen3, CALL_TEXT))
    with pytest.raises(ValueError, match="record the previous turn"):
        b.add_generation(gen(qwen3, "again"))
    with pytest.raises(ValueError, match="before observations"):
        b.add_observations([TOOL_RESULT])
    b.add_message(CALL_MESSAGE)
    with pytest.raises(ValueError, match="at least one message"):
        b.add_observations([])


def test_budgets_and_context_overflow(qwen3):
    b = builder(qwen3, max_context_tokens=1000, max_turn_tokens=64)
    assert b.turn_budget() == 64
    small = builder(qwen3, max_context_tokens=len(b.prompt_ids) + 10)
    assert small.turn_budget() == 10
    with pytest.raises(ContextOverflowError, match="prompt has"):
        builder(qwen3, max_context_tokens=len(b.prompt_ids))
    # observations that do not fit are refused and nothing is appended
    tight = builder(qwen3, max_context_tokens=len(b.prompt_ids) + 60, max_tool_output_tokens=None)
    tight.add_generation(gen(qwen3, CALL_TEXT))
    tight.add_message(CALL_MESSAGE)
    before = list(tight.response_ids)
    assert not tight.add_observations([{**TOOL_RESULT, "content": "x " * 100}])
    assert tight.response_ids == before and tight.messages[-1] == CALL_MESSAGE


@pytest.mark.parametrize("unit", ["word ", "订单状态", "🙂"])
def test_tool_output_is_truncated_by_tokens_with_a_marker(qwen3, unit):
    b = builder(qwen3, max_tool_output_tokens=50)
    b.add_generation(gen(qwen3, CALL_TEXT))
    b.add_message(CALL_MESSAGE)
    long = unit * 400
    total = len(qwen3.encode(long))
    assert b.add_observations([{**TOOL_RESULT, "content": long}, {**TOOL_RESULT, "content": "ok"}])
    cut = b.messages[-2]["content"]
    kept, marker = cut.split("\n[... ")
    assert marker == f"{total - 50} tokens truncated]"
    assert long.startswith(kept) and "\ufffd" not in kept
    assert 45 <= len(qwen3.encode(kept)) <= 50
    assert b.messages[-1]["content"] == "ok"  # short outputs untouched
    assert qwen3.decode(b.response_ids).count(f"{total - 50} tokens truncated]") == 1
    assert b.check_prefix() is None
    assert b.finish("completed", "done").metadata["truncated_tool_outputs"] == 1


def test_user_messages_are_never_truncated(qwen3):
    b = builder(qwen3, max_tool_output_tokens=5)
    b.add_generation(gen(qwen3, "Which order?"))
    b.add_message({"role": "assistant", "content": "Which order?"})
    b.add_observations([{"role": "user", "content": "the one I placed last Tuesday morning"}])
    assert b.messages[-1]["content"] == "the one I placed last Tuesday morning"


# -- prefix stability and <think> ------------------------------------------------------------


def think_episode(qwen3, strict=False, **kwargs):
    b = TrajectoryBuilder(
        qwen3, [SYSTEM, USER], None, TrajectoryLimits(strict_prefix=strict), kwargs
    )
    text = "<think>\nThe user wants order status.\n</think>\n\nWhich order number?"
    prompt_len = len(b.prompt_ids)
    b.add_generation(gen(qwen3, text))
    b.add_message({"role": "assistant", "content": text})
    return b, prompt_len


def test_earlier_think_block_is_kept_and_the_mismatch_recorded(qwen3):
    b, prompt_len = think_episode(qwen3)
    assert b.add_observations([{"role": "user", "content": "#W1"}])
    check = b._prefix
    assert check["mismatched_turns"] == 1 and check["cause"] == "reasoning_stripped"
    index = check["first_mismatch_index"]
    assert index == prompt_len  # the model's <think> token, first token of its turn
    assert b.ids[index] == qwen3.token_id("<think>")
    # turnrl keeps what the model saw: the reasoning is still in the accumulated ids
    assert "The user wants order status." in qwen3.decode(b.response_ids)
    t = b.finish("completed", "done")
    assert t.metadata["prefix_check"]["first_mismatch_turn"] == 1


def test_strict_mode_raises_on_mismatch(qwen3):
    b, _ = think_episode(qwen3, strict=True)
    with pytest.raises(PrefixMismatchError, match="reasoning_stripped"):
        b.add_observations([{"role": "user", "content": "#W1"}])


def test_think_during_tool_calls_is_stable(qwen3):
    # after the last user message Qwen3 keeps reasoning, so tool-calling turns stay stable
    b = TrajectoryBuilder(qwen3, [SYSTEM, USER], TOOLS, TrajectoryLimits(strict_prefix=True))
    text = "<think>\nLook it up.\n</think>\n\n" + CALL_TEXT
    b.add_generation(gen(qwen3, text))
    b.add_message({**CALL_MESSAGE, "content": "<think>\nLook it up.\n</think>\n\nChecking."})
    assert b.add_observations([TOOL_RESULT])
    assert b._prefix["mismatched_turns"] == 0


def test_empty_think_of_generation_prompt_is_stripped_with_thinking_disabled(qwen3):
    b = TrajectoryBuilder(qwen3, [SYSTEM, USER], None, None, {"enable_thinking": False})
    assert qwen3.decode(b.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    b.add_generation(gen(qwen3, "Which order?"))
    b.add_message({"role": "assistant", "content": "Which order?"})
    b.add_observations([{"role": "user", "content": "#W1"}])
    assert b._prefix["cause"] == "reasoning_stripped"
    assert b._prefix["first_mismatch_index"] == len(b.prompt_ids) - len(
        qwen3.encode("<think>\n\n</think>\n\n")
    )


def test_non_canonical_tool_call_json_is_a_template_mismatch(qwen3):
    b = builder(qwen3)
    compact = (
        'Checking.\n<tool_call>\n{"name":"get_order","arguments":{"order_id":"#W1"}}\n</tool_call>'
    )
    b.add_generation(gen(qwen3, compact))
    b.add_message(CALL_MESSAGE)
    b.add_observations([TOOL_RESULT])
    assert b._prefix["cause"] == "template"


def test_non_canonical_tokenization_is_detected(qwen3):
    b = builder(qwen3)
    # the same text "Hello there." from single-character tokens, as a sampler may produce
    ids = [i for ch in "Hello there." for i in qwen3.encode(ch)] + [qwen3.end_of_turn_id]
    assert ids[:-1] != qwen3.encode("Hello there.")
    b.add_generation(Generation(ids, [-1.0] * len(ids), "stop"))
    b.add_message({"role": "assistant", "content": "Hello there."})
    b.add_observations([{"role": "user", "content": "hi"}])
    assert b._prefix["cause"] == "tokenization"
    assert b._prefix["first_mismatch_index"] == len(b.prompt_ids)  # "H" vs "Hello"


def test_incremental_check_equals_a_full_render_and_still_finds_late_mismatches(qwen3):
    b = builder(qwen3, strict_prefix=False)
    for i in range(3):  # three stable tool turns: later checks encode only the new text
        text = CALL_TEXT.replace("#W1", f"#W{i}")
        b.add_generation(gen(qwen3, text))
        message = parse_to_message(text)
        b.add_message(message)
        b.add_observations([{"role": "tool", "tool_call_id": "c", "content": f"result {i}\n\n"}])
        assert b._stable[1] > 0 and b._prefix["mismatched_turns"] == 0
        assert b._fresh_render()[1] == qwen3.render_ids(b.messages, TOOLS, True)
    # turn 4: a non-canonical token split deep in the conversation is still found exactly
    split = [i for ch in "Done." for i in qwen3.encode(ch)] + [qwen3.end_of_turn_id]
    start = len(b.ids)
    b.add_generation(Generation(split, [-1.0] * len(split), "stop"))
    b.add_message({"role": "assistant", "content": "Done."})
    b.add_observations([{"role": "user", "content": "ok"}])
    assert b._prefix["first_mismatch_index"] == start and b._prefix["cause"] == "tokenization"


def parse_to_message(text: str) -> dict:
    from turnrl.tool_envs.tool_calls import parse_tool_calls, to_openai_tool_calls

    parsed = parse_tool_calls(text)
    return {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": to_openai_tool_calls(parsed.tool_calls),
    }


def test_turn_ending_on_eos_is_closed_without_appending(qwen3):
    from turnrl.tool_envs.chat import ChatTokenizer

    chat = ChatTokenizer(
        qwen3.tokenizer, qwen3.chat_template, special_tokens={"eos_token": "<|endoftext|>"}
    )
    b = TrajectoryBuilder(chat, [SYSTEM, USER])
    ids = [*chat.encode("Bye."), chat.token_id("<|endoftext|>")]
    assert b.add_generation(Generation(ids, [-0.1] * len(ids), "stop")) == "Bye."
    assert b.response_ids == ids and b.loss_mask == [1] * len(ids)
