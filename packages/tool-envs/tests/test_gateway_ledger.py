"""The gateway's token ledger on the real Qwen3 tokenizer, checked against transformers.

The engine is this package's boundary: its sampled ids are made here by encoding a turn's
text and appending ``<|im_end|>`` (as ``conftest.ScriptedEngine`` does), or chosen to be a
non-canonical tokenisation the way a sampler can produce one.
"""

from __future__ import annotations

import json
import logging
import re

import pytest

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.gateway.ledger import ContextOverflowError, SessionLedger

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a retail agent."}
USER = {"role": "user", "content": "Where are my orders #W1 and #W2?"}
CALLS_TEXT = (
    "Checking both.\n"
    '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W2"}}\n</tool_call>'
)
THINK = "<think>\nBoth orders need a lookup.\n</think>\n\n"


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """transformers' tokenizer on the same folder: the reference renderer."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))


def ref_text(reference, messages, tools=TOOLS):
    return reference.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )


def ref_ids(reference, messages, tools=TOOLS):
    return reference.encode(ref_text(reference, messages, tools), add_special_tokens=False)


class Turns:
    """Stands in for the engine: sampled ids from text (+ ``<|im_end|>``), logprobs, record."""

    def __init__(self, chat: ChatTokenizer, ledger: SessionLedger) -> None:
        self.chat, self.ledger, self.sampled = chat, ledger, []

    def __call__(self, prepared, text=None, ids=None, finish="stop", version=7, **kw):
        if ids is None:
            ids = [*self.chat.encode(text), self.chat.end_of_turn_id]
        logprobs = [-0.1 - 0.01 * i for i in range(len(ids))]
        self.sampled.append((list(ids), logprobs, version))
        return self.ledger.record(prepared, ids, logprobs, version, finish, **kw)


def echo(message):
    """What an OpenAI SDK client sends back: no reasoning, extra null keys."""
    return {k: v for k, v in message.items() if k != "reasoning_content"} | {"refusal": None}


def tool_results(message, *contents):
    return [
        {"role": "tool", "tool_call_id": call["id"], "content": content}
        for call, content in zip(message["tool_calls"], contents, strict=True)
    ]


def test_golden_conversation_with_parallel_tool_calls_matches_the_reference(qwen3, reference):
    ledger = SessionLedger(qwen3)
    assert ledger.renderer == "qwen3"
    turn = Turns(qwen3, ledger)
    history = [SYSTEM, USER]
    p1 = ledger.prepare(history, TOOLS)
    assert (p1.chain, p1.fork_reason) == (0, None)
    assert p1.prompt_ids == ref_ids(reference, history)
    m1 = turn(p1, CALLS_TEXT, version=3)
    args = [json.dumps({"order_id": "#W1"}), json.dumps({"order_id": "#W2"})]
    assert m1 == {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            {
                "id": f"call_0_0_{i}",
                "type": "function",
                "function": {"name": "get_order", "arguments": a},
            }
            for i, a in enumerate(args)
        ],
    }
    history += [echo(m1), *tool_results(m1, '{"status": "pending"}', "delivered")]
    p2 = ledger.prepare(history, TOOLS)
    assert (p2.chain, p2.fork_reason) == (0, None)
    assert p2.prompt_ids[: len(p1.prompt_ids) + len(turn.sampled[0][0])] == (
        p1.prompt_ids + turn.sampled[0][0]
    )
    assert p2.prompt_ids == ref_ids(reference, history)  # append-only: no reasoning anywhere
    m2 = turn(p2, "#W1 is pending; #W2 was delivered.", version=4)
    assert m2 == {"role": "assistant", "content": "#W1 is pending; #W2 was delivered."}
    history += [m2, {"role": "user", "content": "Thanks 🙂"}]
    p3 = ledger.prepare(history, TOOLS)
    assert (p3.chain, p3.fork_reason) == (0, None)
    assert p3.prompt_ids == ref_ids(reference, history)
    turn(p3, "You're welcome.", version=5)

    [row] = ledger.rows()
    ids3 = turn.sampled[2][0]
    assert row["ids"] == p3.prompt_ids + ids3  # what the engine was given + sampled
    assert row["prompt_ids"] == p1.prompt_ids and row["calls"] == 3 and row["fork_reason"] is None
    trained = [i for i, m in zip(row["ids"], row["loss_mask"], strict=True) if m]
    assert trained == [i for ids, _, _ in turn.sampled for i in ids]
    assert [lp for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m] == [
        lp for _, lps, _ in turn.sampled for lp in lps
    ]
    assert [v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m] == [
        v for ids, _, v in turn.sampled for _ in ids
    ]
    assert all(v is None for v, m in zip(row["versions"], row["loss_mask"], strict=True) if not m)
    assert all(lp == 0.0 for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if not m)


def test_think_blocks_keep_the_sampled_ids_where_qwen3_strips_them(qwen3, reference):
    ledger = SessionLedger(qwen3)
    turn = Turns(qwen3, ledger)
    history = [SYSTEM, USER]
    m1 = turn(ledger.prepare(history, TOOLS), THINK + CALLS_TEXT)
    assert m1["reasoning_content"] == "Both orders need a lookup."
    assert m1["content"] == "Checking both." and len(m1["tool_calls"]) == 2
    results = tool_results(m1, "pending", "delivered")
    with_reasoning = ledger.prepare([*history, m1, *results], TOOLS)
    merged = {**echo(m1), "content": THINK + m1["content"]}  # reasoning folded into content
    for echoed in (echo(m1), merged):
        prepared = ledger.prepare([*history, echoed, *results], TOOLS)
        assert (prepared.chain, prepared.fork_reason) == (0, None)
        assert prepared.prompt_ids == with_reasoning.prompt_ids
    # Echoed with its reasoning, the template renders the turn as sampled (after the query).
    assert with_reasoning.prompt_ids == ref_ids(reference, [*history, m1, *results])
    # Echoed without it, the reference drops the block; the ledger keeps the model's ids.
    plain = ref_text(reference, [*history, echo(m1), *results])
    assert qwen3.decode(with_reasoning.prompt_ids) == plain.replace(
        "<|im_start|>assistant\nChecking", "<|im_start|>assistant\n" + THINK + "Checking"
    )
    m2 = turn(with_reasoning, "<think>\nSum up.\n</think>\n\nOne pending, one delivered.")
    history += [m1, *results, m2, {"role": "user", "content": "Thanks"}]
    p3 = ledger.prepare(history, TOOLS)
    assert (p3.chain, p3.fork_reason) == (0, None)
    sampled = with_reasoning.prompt_ids + turn.sampled[1][0]
    assert p3.prompt_ids[: len(sampled)] == sampled
    reference_text = ref_text(reference, history)  # a user spoke: Qwen3 strips both blocks
    assert "Sum up" not in reference_text
    ours = qwen3.decode(p3.prompt_ids)
    assert re.sub(r"<think>\n.*?\n</think>\n\n", "", ours, flags=re.DOTALL) == reference_text
    assert p3.prompt_ids != ref_ids(reference, history)


def test_a_non_canonical_tokenisation_stays_exact(qwen3, reference):
    a, b = "It is pen", "ding."
    assert qwen3.encode(a) + qwen3.encode(b) != qwen3.encode(a + b)  # BPE drift in context
    ledger = SessionLedger(qwen3)
    turn = Turns(qwen3, ledger)
    history = [USER]
    sampled = [*qwen3.encode(a), *qwen3.encode(b), qwen3.end_of_turn_id]
    m1 = turn(ledger.prepare(history), ids=sampled)
    assert m1 == {"role": "assistant", "content": "It is pending."}
    history += [echo(m1), {"role": "user", "content": "Which one?"}]
    p2 = ledger.prepare(history)
    assert p2.fork_reason is None
    start = len(ref_ids(reference, [USER], None))
    assert p2.prompt_ids[start : start + len(sampled)] == sampled
    assert qwen3.decode(p2.prompt_ids) == ref_text(reference, history, None)
    assert p2.prompt_ids != ref_ids(reference, history, None)  # re-tokenising would change it


def test_stop_string_and_length_turns_are_closed_with_mask_zero(qwen3, reference):
    ledger = SessionLedger(qwen3)
    turn = Turns(qwen3, ledger)
    history = [SYSTEM, USER]
    cut = CALLS_TEXT[: -len("</tool_call>")]  # the engine stopped on the stop string
    m1 = turn(ledger.prepare(history, TOOLS), ids=qwen3.encode(cut), stop_reason="</tool_call>")
    assert [c["id"] for c in m1["tool_calls"]] == ["call_0_0_0", "call_0_0_1"]
    closing = [*qwen3.encode("</tool_call>"), qwen3.end_of_turn_id]
    row = ledger.rows()[0]
    assert row["ids"][-len(closing) :] == closing and row["loss_mask"][-len(closing) :] == [0, 0]
    history += [echo(m1), *tool_results(m1, "pending", "delivered")]
    p2 = ledger.prepare(history, TOOLS)
    assert p2.fork_reason is None and p2.prompt_ids == ref_ids(reference, history)
    m2 = turn(p2, ids=qwen3.encode("Order #W1 is"), finish="length")  # no <|im_end|>
    history += [m2, {"role": "user", "content": "Go on."}]
    p3 = ledger.prepare(history, TOOLS)
    assert p3.fork_reason is None and qwen3.decode(p3.prompt_ids) == ref_text(reference, history)
    turn(p3, "Pending.")
    row = ledger.rows()[0]
    end = len(p2.prompt_ids) + len(turn.sampled[1][0])
    assert row["ids"][end] == qwen3.end_of_turn_id and row["loss_mask"][end] == 0


def test_histories_that_do_not_extend_fork_with_a_reason(qwen3, reference, caplog):
    ledger = SessionLedger(qwen3)
    turn = Turns(qwen3, ledger)
    m1 = turn(ledger.prepare([SYSTEM, USER], TOOLS), CALLS_TEXT)
    results = tool_results(m1, "pending", "delivered")
    edited = [SYSTEM, {**USER, "content": "Where is #W1?"}, echo(m1), *results]
    rewritten = [SYSTEM, USER, {**echo(m1), "content": "Let me check."}, *results]
    cases = [
        (edited, TOOLS, "edited"),
        (rewritten, TOOLS, "unknown_assistant"),
        ([SYSTEM, USER, echo(m1), *results], None, "tools_changed"),
        ([SYSTEM, USER], TOOLS, "no_extension"),  # a retry of the first request
        ([SYSTEM, USER, echo(m1)], TOOLS, "no_extension"),  # ends with the assistant
        ([{"role": "system", "content": "Summarise."}, USER], None, "new_conversation"),
    ]
    forks = []
    with caplog.at_level(logging.INFO, logger="turnrl.tool_envs.gateway.ledger"):
        for n, (messages, tools, reason) in enumerate(cases, start=1):
            prepared = ledger.prepare(messages, tools)
            forks.append(prepared)
            assert (prepared.chain, prepared.fork_reason) == (n, reason), messages
            if messages[-1]["role"] != "assistant":  # rendered from scratch, as the reference
                assert prepared.prompt_ids == ref_ids(reference, messages, tools)
    assert [r.getMessage().split("(")[-1] for r in caplog.records][:2] == [
        "edited)",
        "unknown_assistant)",
    ]
    # A fork is a chain of its own: its next request extends it.
    m = turn(forks[0], "Pending.")
    p_next = ledger.prepare([*edited, m, {"role": "user", "content": "ok"}], TOOLS)
    assert (p_next.chain, p_next.fork_reason) == (1, None)
    assert [r["chain"] for r in ledger.rows()] == [0, 1]  # chains never answered are not rows
    # Re-serialised arguments and null keys are the same turn: chain 0 is extended.
    compact = [
        {
            **c,
            "function": {
                **c["function"],
                "arguments": json.dumps(json.loads(a), separators=(",", ":")),
            },
        }
        for c in m1["tool_calls"]
        for a in [c["function"]["arguments"]]
    ]
    same = [SYSTEM, USER, {**echo(m1), "tool_calls": compact, "name": None}, *results]
    assert ledger.prepare(same, TOOLS).fork_reason is None
    assert ledger.prepare(same, TOOLS).chain == 0


def test_a_call_written_inside_the_reasoning_is_not_a_call(qwen3):
    ledger = SessionLedger(qwen3)
    text = "<think>\nMaybe " + CALLS_TEXT + "\n</think>\n\nNo lookup needed."
    message = Turns(qwen3, ledger)(ledger.prepare([USER], TOOLS), text)
    assert message == {
        "role": "assistant",
        "content": "No lookup needed.",
        "reasoning_content": "Maybe " + CALLS_TEXT,
    }


def test_parallel_calls_on_one_chain_end_fork_with_the_prefix_masked(qwen3):
    ledger = SessionLedger(qwen3)
    turn = Turns(qwen3, ledger)
    # best-of-N on the first prompt: two identical requests before either answer
    first = [SYSTEM, USER]
    pa, pb = ledger.prepare(first, TOOLS), ledger.prepare(first, TOOLS)
    assert (pa.chain, pb.chain, pb.fork_reason) == (0, 0, None)
    ma = turn(pa, CALLS_TEXT)
    mb = turn(pb, "Which order first?")
    # sub-calls on the same chain end: two different follow-ups before either answer
    results = tool_results(ma, "pending", "delivered")
    pc = ledger.prepare([*first, ma, *results], TOOLS)
    pd = ledger.prepare([*first, ma, *results[:1], {"role": "user", "content": "Only #W1."}], TOOLS)
    assert (pc.chain, pd.chain) == (0, 0)
    mc, md = turn(pc, "Done."), turn(pd, "#W1 is pending.")
    rows = {r["chain"]: r for r in ledger.rows()}
    assert sorted(rows) == [0, 1, 2]
    assert rows[1]["fork_reason"] == rows[2]["fork_reason"] == "parallel"
    for row, prepared, k in ((rows[1], pb, 1), (rows[2], pd, 3)):
        ids = turn.sampled[k][0]
        assert row["ids"] == prepared.prompt_ids + ids
        assert row["loss_mask"] == [0] * len(prepared.prompt_ids) + [1] * len(ids)
        assert row["prompt_ids"] == prepared.prompt_ids and row["calls"] == 1
    assert rows[0]["ids"] == pc.prompt_ids + turn.sampled[2][0] and rows[0]["calls"] == 2
    trained = sorted(
        i for r in rows.values() for i, m in zip(r["ids"], r["loss_mask"], strict=True) if m
    )
    assert trained == sorted(i for ids, _, _ in turn.sampled for i in ids)  # each once
    # each branch goes on on its own chain
    more = {"role": "user", "content": "Thanks"}
    assert ledger.prepare([*first, mb, more], TOOLS).chain == 1
    assert ledger.prepare([*first, ma, *results, mc, more], TOOLS).chain == 0
    assert ledger.prepare([*first, ma, *results[:1], pd.messages[-1], md, more], TOOLS).chain == 2


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"role": "bot", "content": "hi"}], r"messages\[0\]: unknown role 'bot'"),
        (
            [USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}],
            r"messages\[1\]: tool message with tool_call_id 'call_9' answers no earlier",
        ),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{bad"}}],
                },
            ],
            r"tool_calls\[0\]: function.arguments must be a JSON object",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}],
            "needs function.name",
        ),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts"),
    ],
)
def test_malformed_histories_raise_a_clear_error(qwen3, messages, match):
    with pytest.raises(ValueError, match=match):
        SessionLedger(qwen3).prepare(messages)


def test_text_parts_context_overflow_and_bad_records(qwen3):
    ledger = SessionLedger(qwen3)
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
    }
    assert (
        ledger.prepare([parts]).prompt_ids
        == ledger.prepare([{"role": "user", "content": "Hi there"}]).prompt_ids
    )
    small = SessionLedger(qwen3, max_context_tokens=8)
    with pytest.raises(ContextOverflowError, match="max_context_tokens=8") as info:
        small.prepare([USER])
    assert isinstance(info.value, ValueError) and small.rows() == []
    prepared = ledger.prepare([USER])
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        ledger.record(prepared, [1, 2], [0.0], None, "stop")


PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generic_renderer_proves_the_prefix_or_forks(qwen3):
    plain = ChatTokenizer(qwen3.tokenizer, PLAIN)
    ledger = SessionLedger(plain)
    assert ledger.renderer == "generic"
    turn = Turns(plain, ledger)
    m1 = turn(ledger.prepare([USER]), "Checking.")
    history = [USER, m1, {"role": "user", "content": "Thanks"}]
    p2 = ledger.prepare(history)
    assert (p2.chain, p2.fork_reason) == (0, None)
    assert p2.prompt_ids == plain.render_ids(history, add_generation_prompt=True)
    # Qwen3's template adds an empty think block to a final assistant turn: not append-only.
    strict = SessionLedger(qwen3, renderer="generic")
    m1 = Turns(qwen3, strict)(strict.prepare([USER]), "Checking.")
    p2 = strict.prepare([USER, m1, {"role": "user", "content": "Thanks"}])
    assert (p2.chain, p2.fork_reason) == (1, "template_not_prefix")
