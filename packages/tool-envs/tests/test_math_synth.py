"""Generated problems and their ReTool-style SFT chats."""

from __future__ import annotations

import re

import pytest

from turnrl.tool_envs.retool.env import DEFAULT_INSTRUCTION
from turnrl.tool_envs.retool.synth import make_problems, sft_chat, train_and_heldout


def test_problems_are_deterministic_and_distinct() -> None:
    a, b = make_problems(50, seed=3), make_problems(50, seed=3)
    assert a == b
    assert a != make_problems(50, seed=4)
    assert len({p.expression for p in a}) == 50
    with pytest.raises(ValueError, match="num"):
        make_problems(-1, seed=0)


def test_heldout_never_shares_an_expression_with_training() -> None:
    train, heldout = train_and_heldout(300, 40, seed=0)
    assert len(train) == 300 and len(heldout) == 40
    assert not {p.expression for p in train} & {p.expression for p in heldout}


def test_code_uses_exactly_the_problems_numbers() -> None:
    for p in make_problems(100, seed=1):
        in_text = re.findall(r"\d+", p.problem)
        in_code = re.findall(r"\d+", p.expression)
        assert sorted(set(in_code)) == sorted(set(in_text)), p
        assert p.answer > 99  # too large to guess from the operands' sizes alone


def test_sft_chat_shape() -> None:
    p = make_problems(1, seed=5)[0]
    chat = sft_chat(p, DEFAULT_INSTRUCTION)
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"]
    call = chat[1]["tool_calls"][0]
    assert call["function"] == {
        "name": "code_interpreter",
        "arguments": {"code": f"print({p.expression})"},
    }
    assert chat[2]["tool_call_id"] == call["id"] and chat[2]["content"] == str(p.answer)
    assert chat[3]["content"].endswith(f"\\boxed{{{p.answer}}}.")


@pytest.mark.slow
def test_tool_message_is_what_the_sandbox_prints() -> None:
    """The generated interpreter output equals a real run of the chat's code (embedded sandbox)."""
    from turnrl.tool_envs.sandbox import SandboxClient, SandboxClientConfig
    from turnrl.tool_envs.sandbox.embedded import TEST_SERVER_ARGS, EmbeddedSandbox

    problems = make_problems(3, seed=11)
    with EmbeddedSandbox(*TEST_SERVER_ARGS) as sandbox:
        client = SandboxClient(SandboxClientConfig(url=sandbox.url))
        for p in problems:
            chat = sft_chat(p, DEFAULT_INSTRUCTION)
            code = chat[1]["tool_calls"][0]["function"]["arguments"]["code"]
            result = client.run_code(code)
            assert result.status == "success", result.message
            assert result.stdout.strip() == chat[2]["content"]
