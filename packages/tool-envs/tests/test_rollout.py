"""The multi-turn rollout: ScriptedEngine (scripted engine server) + real ToolEnvironment.

Every test uses the real Qwen3 tokenizer and chat template, a real ToolSet and a
ScriptedUser; only the inference engine is scripted (the package's boundary).
"""

from __future__ import annotations

import asyncio

import pytest

from turnrl.tool_envs.protocol import Generation, SamplingParams
from turnrl.tool_envs.rollout import (
    EpisodeRequest,
    RolloutConfig,
    group_requests,
    run_episode,
    run_episodes,
)
from turnrl.tool_envs.tools import ToolEnvironment, ToolSet
from turnrl.tool_envs.trajectory import TrajectoryLimits
from turnrl.tool_envs.user_sim import ScriptedUser, UserSimulatorError

ORDERS = {"#W1": "pending", "#W2": "delivered"}
SCHEMA = {
    "type": "function",
    "function": {
        "name": "get_order_status",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
    },
}


def order_status(order_id: str) -> str:
    if order_id not in ORDERS:
        raise KeyError(f"order {order_id} not found")
    return ORDERS[order_id]


def make_env(replies=("Where is my order #W1?", "Great, thanks! ###STOP###")) -> ToolEnvironment:
    tools = ToolSet()
    tools.add(SCHEMA, order_status)
    user = ScriptedUser(replies if callable(replies) else list(replies))
    return ToolEnvironment(tools, user, "You are a retail agent.")


def call(order_id: str) -> str:
    return (
        'Let me check.\n<tool_call>\n{"name": "get_order_status", "arguments": '
        f'{{"order_id": "{order_id}"}}}}\n</tool_call>'
    )


TASK = {"instruction": "You want the status of order #W1."}


def config(**limits) -> RolloutConfig:
    return RolloutConfig(
        sampling=SamplingParams(temperature=0.7, max_tokens=256), limits=TrajectoryLimits(**limits)
    )


async def test_full_episode(qwen3, make_engine):
    engine = make_engine([call("#W1"), "Your order #W1 is pending."])
    t = await run_episode(engine, make_env(), qwen3, TASK, config(), group_id="g0", sample_index=1)
    assert t.status == "completed" and t.metadata["end_reason"] == "done"
    assert (t.num_turns, t.num_tool_calls, t.num_invalid_tool_calls) == (2, 1, 0)
    assert (t.group_id, t.sample_index) == ("g0", 1)
    # the engine saw the prompt, then the prompt + its own turn + the tool-result delta
    (p1, s1, sid1), (p2, _, sid2) = engine.calls
    assert p1 == t.prompt_ids and sid1 == sid2
    assert p2 == t.prompt_ids + t.response_ids[: len(p2) - len(p1)]
    assert "<tool_response>\npending\n</tool_response>" in qwen3.decode(p2)
    assert s1.stop_token_ids == [qwen3.end_of_turn_id] and s1.temperature == 0.7
    assert s1.max_tokens == 256
    # mask 1 exactly on the engine's tokens, with the engine's logprobs
    first = [*qwen3.encode(call("#W1")), qwen3.end_of_turn_id]
    assert t.response_ids[: len(first)] == first and t.loss_mask[: len(first)] == [1] * len(first)
    assert (
        t.num_generated_tokens == len(first) + len(qwen3.encode("Your order #W1 is pending.")) + 1
    )
    assert t.rollout_logprobs[0] == pytest.approx(-0.25)
    assert t.messages[-1] == {"role": "user", "content": "Great, thanks! ###STOP###"}
    assert t.metadata["prefix_check"]["mismatched_turns"] == 0
    assert set(t.timings) == {"generate", "env", "user", "agent", "total"}
    parts = t.timings["generate"] + t.timings["env"] + t.timings["agent"]
    assert t.timings["total"] == pytest.approx(parts) and t.timings["user"] <= t.timings["env"]


async def test_user_time_is_timed_apart_from_the_environment(qwen3, make_engine):
    slow_user = ScriptedUser(["Where is my order #W1?", "Thanks! ###STOP###"])
    respond = slow_user.respond

    async def slow(message: str) -> str:
        await asyncio.sleep(0.2)
        return await respond(message)

    slow_user.respond = slow  # type: ignore[method-assign]
    env = ToolEnvironment(ToolSet(), slow_user, "You are a retail agent.")
    t = await run_episode(make_engine(["Hello."]), env, qwen3, TASK, config())
    assert t.status == "completed"
    assert 0.2 <= t.timings["user"] <= t.timings["env"] < 0.2 + 0.5


async def test_turn_budget_lowers_max_tokens(qwen3, make_engine):
    engine = make_engine(["Which order?", "ok"])
    env = make_env(("hi", "#W1", "###STOP###"))
    await run_episode(engine, env, qwen3, TASK, config(max_turn_tokens=40))
    assert [c[1].max_tokens for c in engine.calls] == [40, 40]
    engine = make_engine(["Which order?", "ok"])
    t = await run_episode(
        engine, make_env(("hi", "###STOP###")), qwen3, TASK, config(max_context_tokens=200)
    )
    prompt = len(t.prompt_ids)
    assert engine.calls[0][1].max_tokens == min(256, 200 - prompt)


async def test_invalid_calls_are_shown_and_capped(qwen3, make_engine):
    bad = '<tool_call>{"name": "get_order_status", "arguments": {"order_id": }</tool_call>'
    engine = make_engine([bad, call("#W9"), '<tool_call>{"name": "lookup"}</tool_call>', bad])
    cfg = config()
    cfg.max_consecutive_invalid_turns = 2
    t = await run_episode(engine, make_env(), qwen3, TASK, cfg)
    # malformed JSON, then a tool exception (valid call: resets the count), then unknown tool
    assert t.metadata["end_reason"] == "max_invalid_tool_calls" and t.status == "completed"
    assert t.num_turns == 4 and t.num_invalid_tool_calls == 3 and t.num_tool_calls == 4
    seen = qwen3.decode(engine.calls[1][0])
    assert "Error: Tool call is not valid JSON" in seen
    assert "Error: KeyError: 'order #W9 not found'" in qwen3.decode(engine.calls[2][0])
    assert "unknown tool 'lookup'" in qwen3.decode(engine.calls[3][0])


async def test_max_turns_truncates(qwen3, make_engine):
    engine = make_engine(lambda i: f"Question {i}?")
    env = make_env(lambda msg, turn: f"answer {turn}")
    t = await run_episode(engine, env, qwen3, TASK, config(max_turns=3))
    assert (t.status, t.metadata["end_reason"], t.num_turns) == ("truncated", "max_turns", 3)
    assert len(engine.calls) == 3


async def test_context_exhaustion_truncates(qwen3, make_engine):
    engine = make_engine(lambda i: "Tell me more. " * 5)
    env = make_env(lambda msg, turn: "Something long to say. " * 10)
    t = await run_episode(engine, env, qwen3, TASK, config(max_context_tokens=400))
    assert t.status == "truncated" and t.metadata["end_reason"] == "context"
    assert len(t.prompt_ids) + len(t.response_ids) <= 400


async def test_length_finish_is_truncated(qwen3, make_engine):
    engine = make_engine(["word " * 100])
    t = await run_episode(engine, make_env(), qwen3, TASK, config(max_turn_tokens=16))
    assert (t.status, t.metadata["end_reason"]) == ("truncated", "turn_length")
    assert len(t.response_ids) == 16 and t.loss_mask == [1] * 16


async def test_engine_abort(qwen3, make_engine):
    engine = make_engine([Generation(qwen3.encode("Let me"), [-0.1, -0.2], "abort")])
    t = await run_episode(engine, make_env(), qwen3, TASK, config())
    assert (t.status, t.metadata["end_reason"]) == ("aborted", "abort")
    assert t.response_ids == qwen3.encode("Let me") and t.rollout_logprobs == [-0.1, -0.2]


async def test_user_failure_fails_the_episode_not_the_run(qwen3, make_engine):
    def broken(message: str, turn: int) -> str:
        if turn == 1:
            raise UserSimulatorError("user model unreachable after 3 tries")
        return "Where is #W1?"

    t = await run_episode(make_engine(["Which order?"]), make_env(broken), qwen3, TASK, config())
    assert t.status == "failed" and t.metadata["end_reason"] == "exception"
    assert "UserSimulatorError: user model unreachable" in t.metadata["error"]
    assert t.num_turns == 1 and sum(t.loss_mask) > 0  # what was generated is kept


async def test_reset_failure_and_prompt_too_long(qwen3, make_engine):
    t = await run_episode(make_engine([]), make_env(), qwen3, {"prompt": "x"}, config())
    assert t.status == "failed" and "instruction" in t.metadata["error"] and t.prompt_ids == []
    t = await run_episode(make_engine([]), make_env(), qwen3, TASK, config(max_context_tokens=20))
    assert (t.status, t.metadata["end_reason"]) == ("truncated", "prompt_too_long")


async def test_engine_error_and_strict_prefix_fail(qwen3, make_engine):
    t = await run_episode(
        make_engine([Generation([1, 2], [-0.1], "stop")]), make_env(), qwen3, TASK, config()
    )
    assert t.status == "failed" and "2 token ids but 1 logprobs" in t.metadata["error"]
    thinking = "<think>\nask\n</think>\n\nWhich order?"
    t = await run_episode(
        make_engine([thinking, "ok"]),
        make_env(("hi", "#W1", "###STOP###")),
        qwen3,
        TASK,
        config(strict_prefix=True),
    )
    assert t.status == "failed" and "PrefixMismatchError" in t.metadata["error"]


async def test_run_episodes_caps_inflight_and_keeps_order(qwen3, make_engine):
    engine = make_engine(lambda i: "Your order is pending.", delay_s=0.01)
    requests = group_requests([TASK, {"instruction": "other"}], samples_per_task=5)
    made = []

    def factory():
        made.append(1)
        if len(made) == 3:
            raise RuntimeError("no database")
        return make_env(("hi", "###STOP###"))

    results = await run_episodes(engine, factory, qwen3, requests, RolloutConfig(max_inflight=3))
    assert engine.max_inflight_seen == 3
    assert [(t.group_id, t.sample_index) for t in results] == [
        (r.group_id, r.sample_index) for r in requests
    ]
    assert [t.status for t in results].count("failed") == 1
    assert "env_factory: RuntimeError: no database" in results[2].metadata["error"]
    assert all(t.status == "completed" for i, t in enumerate(results) if i != 2)


def test_group_requests_and_config_validation():
    reqs = group_requests(["a", "b"], 2, group_ids=["x", "y"])
    assert [(r.task, r.group_id, r.sample_index) for r in reqs] == [
        ("a", "x", 0),
        ("a", "x", 1),
        ("b", "y", 0),
        ("b", "y", 1),
    ]
    assert isinstance(reqs[0], EpisodeRequest)
    with pytest.raises(ValueError, match="samples_per_task"):
        group_requests(["a"], 0)
    with pytest.raises(ValueError, match="1 group ids for 2 tasks"):
        group_requests(["a", "b"], 1, group_ids=["x"])
    with pytest.raises(ValueError, match="max_inflight"):
        RolloutConfig(max_inflight=0)
    with pytest.raises(ValueError, match="max_consecutive_invalid_turns"):
        RolloutConfig(max_consecutive_invalid_turns=0)


def test_config_from_vime_environment_variables(monkeypatch):
    monkeypatch.setenv("TAU_MAX_TURNS", "7")
    monkeypatch.setenv("TAU_MAX_INFLIGHT", "16")
    cfg = RolloutConfig.from_env(max_consecutive_invalid_turns=2)
    assert (cfg.limits.max_turns, cfg.max_inflight, cfg.max_consecutive_invalid_turns) == (7, 16, 2)
    monkeypatch.setenv("TAU_MAX_TURNS", "ten")
    with pytest.raises(ValueError, match="TAU_MAX_TURNS must be an integer, got 'ten'"):
        RolloutConfig.from_env()
    monkeypatch.setenv("TAU_MAX_TURNS", "0")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        RolloutConfig.from_env()
    monkeypatch.delenv("TAU_MAX_TURNS")
    monkeypatch.delenv("TAU_MAX_INFLIGHT")
    assert RolloutConfig.from_env().max_inflight == RolloutConfig().max_inflight
