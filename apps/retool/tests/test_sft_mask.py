"""grpo-core's SFT loss mask on the generated ReTool chats (what the app's SFT stage trains)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from turnrl.grpo_core.training.sft import build_sft_example, loss_mask_text
from turnrl.grpo_core.training.tiny_model import build_tiny_tokenizer
from turnrl.tool_envs.retool.env import CODE_INTERPRETER, DEFAULT_INSTRUCTION
from turnrl.tool_envs.retool.synth import make_problems, sft_chat


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


def test_sft_loss_only_on_assistant_tokens_never_on_interpreter_output(tokenizer) -> None:
    p = make_problems(1, seed=7)[0]
    chat = sft_chat(p, DEFAULT_INSTRUCTION)
    example = build_sft_example(tokenizer, chat, [CODE_INTERPRETER])
    text = tokenizer.apply_chat_template(chat, tools=[CODE_INTERPRETER], tokenize=False)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    assert len(offsets) == len(example.input_ids)

    def mask_over(start: int, end: int) -> set[int]:
        return {m for m, (s, _) in zip(example.loss_mask, offsets, strict=True) if start <= s < end}

    tool_start = text.index("<tool_response>")
    tool_end = text.index("</tool_response>") + len("</tool_response>")
    assert mask_over(tool_start, tool_end) == {0}  # the interpreter's output: never trained on
    user_start = text.index(p.problem)
    assert mask_over(user_start, user_start + len(p.problem)) == {0}
    call_start = text.index("I will compute it with code.")
    call_end = text.index("</tool_call>", call_start) + len("</tool_call>")
    assert mask_over(call_start, call_end) == {1}  # reasoning and the tool call
    final = text.index("The result is")
    assert mask_over(final, text.index("<|im_end|>", final) + len("<|im_end|>")) == {1}
    trained = loss_mask_text(tokenizer, example)
    assert f"print({p.expression})" in trained
    assert trained.count(str(p.answer)) == 1  # in \boxed{}, not from the tool message
    assert "<tool_response>" not in trained and p.problem not in trained
