"""The gateway's HTTP service driven by the real ``openai`` and ``anthropic`` SDK clients.

The service runs on 127.0.0.1 (a free port) in a thread with its own event loop; the only
fake is the engine boundary (``ScriptedEngine`` from conftest), whose generations are the
real Qwen3 tokenizer's ids. Every test checks what the export says the run trains on.

Also here: malformed HTTP against the gateway (raw bytes on a socket, bad bodies, a history
of 20,000 messages) answered with clear 4xx while another session's conversation stays one
exact chain; and every render in the worker threads (``inline_bytes=0``) with many sessions
at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import anthropic
import openai
import pytest
import requests
from aiohttp import web

from turnrl.rollout_router.protocol import EngineUnavailableError
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.gateway.service import Gateway
from turnrl.tool_envs.protocol import Generation, SamplingParams

pytestmark = pytest.mark.timeout(120)

RUN_SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=200)
SYSTEM = "You are a weather assistant."
QUESTION = "What is the weather in Paris?"
CALL_TURN = (
    "<think>\nI should look up the weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
FINAL_TURN = "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Paris, 21 C."
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS},
    }
]
WEATHER = json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})


def generation(chat: ChatTokenizer, text: str, first_logprob: float = -0.5) -> Generation:
    ids = [*chat.encode(text), chat.end_of_turn_id]
    return Generation(ids, [first_logprob - 0.01 * i for i in range(len(ids))], "stop")


class Served:
    """The gateway's aiohttp app on a free port, in a thread with its own event loop."""

    def __init__(self, gateway: Gateway, **runner_kw: Any) -> None:
        self.gateway = gateway
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(gateway.app(), **runner_kw)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=30, **kwargs)

    def open_episode(self, group_size: int = 1, **metadata: Any) -> dict[str, Any]:
        answer = self.post("/episodes", {"group_size": group_size, "metadata": metadata})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def export(self, episode: str) -> dict[str, Any]:
        answer = requests.get(f"{self.url}/episodes/{episode}/export", timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()


@pytest.fixture
def serve(qwen3: ChatTokenizer, make_engine) -> Iterator[Callable[..., tuple[Served, Any]]]:
    """``serve(turns, engine_kw={}, runner_kw={}, **gateway_kw)`` -> (Served, ScriptedEngine)."""
    started: list[Served] = []

    def start(
        turns: Any, engine_kw: dict | None = None, runner_kw: dict | None = None, **kwargs: Any
    ) -> tuple[Served, Any]:
        engine = make_engine(turns, **(engine_kw or {}))
        kwargs.setdefault("model_name", "policy")
        served = Served(Gateway(engine, qwen3, RUN_SAMPLING, **kwargs), **(runner_kw or {}))
        started.append(served)
        return served, engine

    yield start
    for served in started:
        served.close()


def sampled_runs(row: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    """The (ids, logprobs) of each contiguous loss-mask-1 span of an exported row."""
    runs: list[tuple[list[int], list[float]]] = []
    previous = 0
    for token, mask, logprob in zip(row["ids"], row["loss_mask"], row["logprobs"], strict=True):
        if mask and not previous:
            runs.append(([], []))
        if mask:
            runs[-1][0].append(token)
            runs[-1][1].append(logprob)
        previous = mask
    return runs


def assert_trained_on(session: dict[str, Any], generations: list[Generation]) -> None:
    """One chain whose sampled spans are exactly the engine's generations."""
    assert session["status"] == "finished", session["reason"]
    assert len(session["rows"]) == 1, [r["fork_reason"] for r in session["rows"]]
    runs = sampled_runs(session["rows"][0])
    assert runs == [(g.token_ids, g.logprobs) for g in generations]


# -- OpenAI chat completions -----------------------------------------------------------------


def test_openai_sync_tool_loop_is_one_chain_of_the_engine_ids(serve, qwen3):
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN, -0.7)]
    served, engine = serve(turns)
    episode = served.open_episode(task="weather")
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    while True:  # a plain agent loop, as users write it
        reply = client.chat.completions.create(
            model="anything", messages=messages, tools=OPENAI_TOOLS, temperature=0.1, max_tokens=50
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        assert reply.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            assert (call.function.name, json.loads(call.function.arguments)) == (
                "get_weather",
                {"city": "Paris"},
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER})
    assert message.content == "It is sunny in Paris, 21 C."
    assert reply.model == "policy" and reply.usage.completion_tokens == len(turns[1].token_ids)
    assert served.post(f"/sessions/{session['id']}/finish").json()["status"] == "finished"

    exported = served.export(episode["episode"])
    assert exported["metadata"] == {"task": "weather"}
    assert_trained_on(exported["sessions"][0], turns)
    row = exported["sessions"][0]["rows"][0]
    assert row["ids"][: len(engine.calls[1][0])] == engine.calls[1][0]  # the prompt extends
    for _, sampling, session_id in engine.calls:  # the run owns sampling
        assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.8, 0.95, 50)
        assert session_id == session["id"]


async def test_openai_async_stream_with_tools_matches_the_recorded_turn(serve, qwen3):
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    served, _ = serve(turns)
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    finishes = []
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="m",
            messages=messages,
            tools=OPENAI_TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, reasoning, calls, usage = "", "", {}, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                reasoning += getattr(delta, "reasoning_content", None) or ""
                for part in delta.tool_calls or []:
                    entry = calls.setdefault(part.index, {"id": part.id, "name": "", "args": ""})
                    entry["name"] += part.function.name or ""
                    entry["args"] += part.function.arguments or ""
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        tool_calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["args"]},
            }
            for c in calls.values()
        ]
        messages.append({"role": "assistant", "content": content or None, "tool_calls": tool_calls})
        for call in tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": WEATHER})
    assert finishes == ["tool_calls", "stop"]
    assert reasoning == "The tool says sunny." and content == "It is sunny in Paris, 21 C."
    assert usage is not None and usage.completion_tokens == len(turns[1].token_ids)
    served.post(f"/sessions/{session['id']}/finish")
    assert_trained_on(served.export(episode["episode"])["sessions"][0], turns)


def test_openai_bearer_key_route_and_logprobs(serve, qwen3):
    turns = [generation(qwen3, "Hello there.")]
    served, engine = serve(turns)
    session = served.open_episode()["sessions"][0]
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=session["key"], max_retries=0)
    assert [m.id for m in client.models.list()] == ["policy"]
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True, max_tokens=10_000
    )
    assert reply.choices[0].message.content == "Hello there."
    assert [t.logprob for t in reply.choices[0].logprobs.content] == turns[0].logprobs
    assert engine.calls[0][2] == session["id"]
    assert engine.calls[0][1].max_tokens == RUN_SAMPLING.max_tokens  # a cap only lowers it
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


# -- OpenAI Responses API ------------------------------------------------------------------


def test_openai_responses_tool_loop_plain_and_streamed(serve, qwen3):
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    served, _ = serve(turns)
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.responses.create(model="m", instructions=SYSTEM, input=items, tools=tools)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": calls[0].call_id, "output": WEATHER}]
    stream = client.responses.create(
        model="m", instructions=SYSTEM, input=items, tools=tools, stream=True
    )
    events = list(stream)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "It is sunny in Paris, 21 C."
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "It is sunny in Paris, 21 C."
    served.post(f"/sessions/{session['id']}/finish")
    assert_trained_on(served.export(episode["episode"])["sessions"][0], turns)


def test_openai_responses_previous_response_id_extends_the_chain(serve, qwen3):
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    served, _ = serve(turns)
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    first = client.responses.create(model="m", input=QUESTION, tools=tools)
    call = next(item for item in first.output if item.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER}
    second = client.responses.create(
        model="m", previous_response_id=first.id, input=[output], tools=tools
    )
    assert second.output_text == "It is sunny in Paris, 21 C."
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="m", previous_response_id="resp_nope", input="hi")
    served.post(f"/sessions/{session['id']}/finish")
    assert_trained_on(served.export(episode["episode"])["sessions"][0], turns)


# -- Anthropic Messages --------------------------------------------------------------------


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMETERS}]


def test_anthropic_sync_tool_loop_plain_then_streamed(serve, qwen3):
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    served, _ = serve(turns)
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(
        model="m", max_tokens=100, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS
    )
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    use = first.content[-1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    result = {"type": "tool_result", "tool_use_id": use.id, "content": WEATHER}
    messages.append({"role": "user", "content": [result]})
    with client.messages.stream(
        model="m", max_tokens=100, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "It is sunny in Paris, 21 C." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(turns[1].token_ids)
    served.post(f"/sessions/{session['id']}/finish")
    assert_trained_on(served.export(episode["episode"])["sessions"][0], turns)


async def test_anthropic_async_stream_tool_use_and_x_api_key(serve, qwen3):
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    served, engine = serve(turns)
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = anthropic.AsyncAnthropic(base_url=served.url, api_key=session["key"], max_retries=0)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    async with client.messages.stream(
        model="m", max_tokens=100, messages=messages, tools=ANTHROPIC_TOOLS
    ) as stream:
        first = await stream.get_final_message()
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use" and use.input == {"city": "Paris"}
    assert first.content[0].type == "thinking"
    assert first.content[0].thinking == "I should look up the weather."
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    result = {
        "type": "tool_result",
        "tool_use_id": use.id,
        "content": [{"type": "text", "text": WEATHER}],
    }
    messages.append({"role": "user", "content": [result]})
    second = await client.messages.create(
        model="m", max_tokens=100, messages=messages, tools=ANTHROPIC_TOOLS
    )
    assert second.content[-1].text == "It is sunny in Paris, 21 C."
    assert {call[2] for call in engine.calls} == {session["id"]}
    served.post(f"/sessions/{session['id']}/finish")
    assert_trained_on(served.export(episode["episode"])["sessions"][0], turns)


# -- idempotency and lost calls ------------------------------------------------------------


def test_retried_request_replays_the_answer_and_a_plain_repeat_is_a_new_turn(serve, qwen3):
    served, engine = serve(lambda i: generation(qwen3, f"Answer number {i}."))
    episode = served.open_episode()
    sid = episode["sessions"][0]["id"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    path = f"/sessions/{sid}/v1/chat/completions"
    first = served.post(path, body, headers={"x-stainless-retry-count": "0"}).json()
    retried = served.post(path, body, headers={"x-stainless-retry-count": "1"}).json()
    assert retried == first and len(engine.calls) == 1
    again = served.post(path, body).json()  # not a retry: the agent asked again (resample)
    assert again["choices"][0]["message"]["content"] == "Answer number 1."
    assert len(engine.calls) == 2


def test_sdk_retry_after_a_timeout_gets_the_first_generation(serve, qwen3):
    served, engine = serve([generation(qwen3, "Slow answer.")], engine_kw={"delay_s": 1.0})
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", timeout=0.4, max_retries=2)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "Slow answer."
    assert len(engine.calls) == 1  # the retries waited for the one generation
    served.post(f"/sessions/{session['id']}/finish")
    exported = served.export(episode["episode"])["sessions"][0]
    assert exported["status"] == "finished" and exported["calls"][0]["delivered"]


@pytest.mark.parametrize("handler_cancellation", [False, True])
def test_client_disconnect_mid_generation_fails_the_session(serve, qwen3, handler_cancellation):
    served, engine = serve(
        [generation(qwen3, "Too late.")],
        engine_kw={"delay_s": 0.8},
        runner_kw={"handler_cancellation": handler_cancellation},
    )
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", timeout=0.3, max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    served.post(f"/sessions/{session['id']}/finish")
    exported = served.export(episode["episode"])["sessions"][0]  # waits for the generation
    assert exported["status"] == "failed" and "never delivered" in exported["reason"]
    assert len(engine.calls) == 1


def test_engine_failure_fails_the_session_with_the_reason(serve):
    def fail(_: int) -> Generation:
        raise EngineUnavailableError("all engines down")

    served, _ = serve(fail)
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=3)
    with pytest.raises(openai.InternalServerError, match="all engines down"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.ConflictError, match="failed"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    exported = served.export(episode["episode"])["sessions"][0]
    assert exported["status"] == "failed" and "all engines down" in exported["reason"]
    assert exported["rows"] == []


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"n": 2}, "n"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 5}, "top_logprobs"),
        ({"stop": ["\n"]}, "stop"),
    ],
)
def test_openai_unsupported_sampling_fields_are_400_naming_the_field(serve, qwen3, extra, field):
    served, engine = serve([])
    session = served.open_episode()["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=OPENAI_TOOLS, **extra
        )
    assert caught.value.body["param"] == field and field in caught.value.body["message"]
    assert engine.calls == []


def test_anthropic_forced_tool_is_an_anthropic_style_400(serve):
    served, _ = serve([])
    session = served.open_episode()["sessions"][0]
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice") as caught:
        client.messages.create(
            model="m",
            max_tokens=10,
            messages=[{"role": "user", "content": "hi"}],
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any"},
        )
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_bad_requests_are_clear_errors_and_lose_nothing(serve, qwen3):
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    served, engine = serve(turns, max_context_tokens=400)
    episode = served.open_episode()
    session = episode["sessions"][0]
    sid = session["id"]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    call_id = reply.choices[0].message.tool_calls[0].id

    path = f"/sessions/{sid}/v1/chat/completions"
    malformed = requests.post(served.url + path, data=b"{not json", timeout=10)
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
    assert served.post("/sessions/nope/v1/chat/completions", {}).status_code == 404
    assert requests.get(f"{served.url}/episodes/nope", timeout=10).status_code == 404
    unknown_call = [*messages, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="call_nope"):
        client.chat.completions.create(model="m", messages=unknown_call, tools=OPENAI_TOOLS)
    huge = [*messages, {"role": "tool", "tool_call_id": call_id, "content": "sunny " * 500}]
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=huge, tools=OPENAI_TOOLS)
    assert caught.value.status_code == 413
    assert len(engine.calls) == 1

    messages.append({"role": "tool", "tool_call_id": call_id, "content": WEATHER})
    final = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
    assert final.choices[0].message.content == "It is sunny in Paris, 21 C."
    assert engine.calls[1][1].max_tokens == 400 - len(engine.calls[1][0])  # the context's room
    assert served.post(f"/sessions/{sid}/finish").json()["status"] == "finished"
    with pytest.raises(openai.ConflictError, match="finished"):
        client.chat.completions.create(model="m", messages=messages)
    assert_trained_on(served.export(episode["episode"])["sessions"][0], turns)


# -- episodes and rewards ------------------------------------------------------------------


def test_episode_group_rewards_and_status(serve, qwen3):
    served, _ = serve(lambda i: generation(qwen3, f"Reply {i}."))
    episode = served.open_episode(group_size=3, task_id=7)
    sessions = episode["sessions"]
    assert len({s["id"] for s in sessions}) == len({s["key"] for s in sessions}) == 3
    calls = []
    for session in sessions:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=session["key"], max_retries=0)
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}]
        )
        calls.append(reply.id)
    first, second, third = (s["id"] for s in sessions)
    assert served.post(f"/sessions/{first}/reward", {"reward": 1.0}).status_code == 200
    assert served.post(f"/sessions/{second}/reward", {"reward": 0.5, "call": calls[1]}).ok
    assert served.post(f"/sessions/{second}/reward", {"reward": 1, "call": "x"}).status_code == 404
    assert served.post(f"/sessions/{second}/reward", {"reward": "high"}).status_code == 400
    assert served.post(f"/sessions/{first}/finish").ok
    assert served.post(f"/sessions/{third}/finish", {"reward": 0.0}).ok
    status = requests.get(f"{served.url}/episodes/{episode['episode']}", timeout=10).json()
    assert [s["status"] for s in status["sessions"]] == ["finished", "active", "finished"]
    assert not status["done"] and status["metadata"] == {"task_id": 7}
    exported = served.export(episode["episode"])["sessions"]
    assert [s["reward"] for s in exported] == [1.0, None, 0.0]
    assert exported[1]["call_rewards"] == {calls[1]: 0.5}
    assert [len(s["rows"]) for s in exported] == [1, 1, 1]
    bad = served.post("/episodes", {"group_size": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_size"
    closed = requests.delete(f"{served.url}/episodes/{episode['episode']}", timeout=10)
    assert closed.ok and served.post(f"/sessions/{first}/finish").status_code == 404


async def test_sub_agent_and_parallel_calls_get_their_own_chains(serve, qwen3):
    served, engine = serve(lambda i: generation(qwen3, f"Reply {i}."), engine_kw={"delay_s": 0.2})
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    main = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    sub = [{"role": "user", "content": "Summarise: the sky is blue."}]
    replies = await asyncio.gather(
        client.chat.completions.create(model="m", messages=main),
        client.chat.completions.create(model="m", messages=sub),
        client.chat.completions.create(model="m", messages=main),  # best-of-2 by the agent
    )
    assert engine.max_inflight_seen == 3
    served.post(f"/sessions/{session['id']}/finish")
    exported = served.export(episode["episode"])["sessions"][0]
    assert exported["status"] == "finished"
    reasons = sorted(str(row["fork_reason"]) for row in exported["rows"])
    assert reasons == ["None", "new_conversation", "parallel"]
    sampled = sorted(run[0] for row in exported["rows"] for run in sampled_runs(row))
    contents = {r.choices[0].message.content for r in replies}
    assert contents == {"Reply 0.", "Reply 1.", "Reply 2."}
    assert sampled == sorted(generation(qwen3, text).token_ids for text in contents)


def test_a_turn_cut_by_max_tokens_is_length_and_the_chain_goes_on(serve, qwen3):
    served, engine = serve(["Once upon a time there was a model.", "The end."])
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Tell a story."}]
    cut = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    messages += [cut.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "Go on."}]
    final = client.chat.completions.create(model="m", messages=messages)
    assert final.choices[0].finish_reason == "stop"
    served.post(f"/sessions/{session['id']}/finish")
    exported = served.export(episode["episode"])["sessions"][0]
    assert len(exported["rows"]) == 1
    runs = [ids for ids, _ in sampled_runs(exported["rows"][0])]
    assert runs == [
        qwen3.encode("Once upon a time there was a model.")[:3],
        [*qwen3.encode("The end."), qwen3.end_of_turn_id],
    ]
    assert engine.calls[0][1].stop_token_ids == qwen3.stop_token_ids


def test_the_export_carries_each_sampled_tokens_weight_version(serve, qwen3):
    """A turn resumed across a weight update (two versions in one generation) is exported
    with the generation's version on every sampled token, None elsewhere."""
    final = generation(qwen3, FINAL_TURN)
    half = len(final.token_ids) // 2
    final.versions = [3] * half + [4] * (len(final.token_ids) - half)
    served, _ = serve([final])
    episode = served.open_episode(task="weather")
    session = episode["sessions"][0]
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=50)
    assert served.post(f"/sessions/{session['id']}/finish").json()["status"] == "finished"
    row = served.export(episode["episode"])["sessions"][0]["rows"][0]
    pairs = list(zip(row["versions"], row["loss_mask"], strict=True))
    assert [v for v, m in pairs if m] == final.versions
    assert all(v is None for v, m in pairs if not m)


# -- malformed requests ------------------------------------------------------------

LIMIT = 2 * 1024 * 1024  # the test gateway's max_body_bytes
JSON = "application/json"


@pytest.fixture
def served(qwen3: ChatTokenizer, make_engine: Any) -> Iterator[Served]:
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    engine = make_engine(lambda i: turns[i % 2])
    sampling = SamplingParams(temperature=0.8, max_tokens=200)
    gateway = Gateway(engine, qwen3, sampling, max_context_tokens=4096, max_body_bytes=LIMIT)
    server = Served(gateway)
    yield server
    server.close()


def raw(url: str, data: bytes, *, half_close: bool = False) -> bytes:
    """Send bytes on a fresh connection; everything the server answers until it closes."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=20) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def status_of(answer: bytes) -> int:
    assert answer.startswith((b"HTTP/1.0 ", b"HTTP/1.1 ")), answer[:200]
    return int(answer.split(b" ", 2)[1])


def post(path: str, body: bytes, kind: str = JSON, more: str = "") -> bytes:
    """A one-request connection: ``more`` adds header lines, each ending with CRLF."""
    head = f"POST {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nContent-Type: {kind}\r\n"
    return f"{head}{more}Content-Length: {len(body)}\r\n\r\n".encode() + body


def chunked(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
    return f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + body


def agent_conversation(base_url: str) -> str:
    """A plain openai-SDK tool loop; returns the final answer."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        reply = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return str(message.content)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER})


def test_malformed_http_gets_4xx_and_harms_no_session(served: Served, qwen3: ChatTokenizer):
    episode = served.open_episode(group_size=2)
    victim, bystander = episode["sessions"]
    path = f"/sessions/{victim['id']}/v1/chat/completions"
    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    framing = {  # broken HTTP: the parser answers 400 and closes
        "header without colon": b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nnot a header\r\n\r\n",
        "header over 8 KiB": b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
        "NUL in a header": b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-A: a\x00b\r\n\r\n",
        "TLS hello": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n",
        "bad Content-Length": post(path, good, more="Content-Length: x\r\n"),
        "two Content-Lengths": post(path, good, more="Content-Length: 3\r\n"),
        "Content-Length and chunked": post(path, good, more="Transfer-Encoding: chunked\r\n"),
        "chunk size not hex": chunked(path, b"zz\r\n{}\r\n0\r\n\r\n"),
        "chunk longer than its size": chunked(path, b'2\r\n{"model": 1}\r\n0\r\n\r\n'),
    }
    for name, request in framing.items():
        assert status_of(raw(served.url, request)) == 400, name

    bodies = {  # well-framed HTTP, bad bodies: the gateway's JSON errors
        "truncated JSON": (post(path, good[:-7]), 400, "malformed JSON"),
        "not UTF-8": (post(path, b'{"model": "\xff\xfe"}'), 400, "malformed JSON"),
        "a JSON array": (post(path, b"[1, 2]"), 400, "must be a JSON object"),
        "form body": (
            post(path, b"model=m&messages=hi", "application/x-www-form-urlencoded"),
            400,
            "application/x-www-form-urlencoded",
        ),
        "no messages": (post(path, b'{"model": "m"}'), 400, "messages"),
        "messages not a list": (post(path, b'{"model": "m", "messages": 7}'), 400, "messages"),
        "unknown role": (
            post(path, b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}'),
            400,
            "robot",
        ),
        "body over the limit": (post(path, b" " * (2 * LIMIT) + good), 413, str(LIMIT)),
        "unknown session": (post("/sessions/nope/v1/chat/completions", good), 404, "session"),
    }
    for name, (request, status, words) in bodies.items():
        answer = raw(served.url, request)
        assert status_of(answer) == status, (name, answer[:300])
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert words in error["message"], (name, error)

    # a body cut short (Content-Length says more, the client half-closes): no answer owed
    raw(served.url, post(path, good)[:-10], half_close=True)

    # the victim, whose every request above was refused, still holds a clean session
    assert agent_conversation(victim["base_url"]) == "It is sunny in Paris, 21 C."
    assert agent_conversation(bystander["base_url"]) == "It is sunny in Paris, 21 C."
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    for session in episode["sessions"]:
        assert served.post(f"/sessions/{session['id']}/finish").json()["status"] == "finished"
    for session in served.export(episode["episode"])["sessions"]:
        assert_trained_on(session, turns)


def test_a_huge_history_does_not_stall_other_sessions(served: Served, qwen3: ChatTokenizer):
    """20,000 messages take seconds to render: off the event loop, others go on meanwhile
    (on the loop, the other session's whole conversation would wait behind the render)."""
    episode = served.open_episode(group_size=2)
    heavy, light = episode["sessions"]
    messages = [{"role": "user", "content": f"message number {i}"} for i in range(20_000)]
    body = json.dumps({"model": "m", "messages": messages})
    assert len(body) < LIMIT
    huge: dict[str, Any] = {}

    def send_huge() -> None:
        url = f"{heavy['base_url']}/chat/completions"
        answer = requests.post(url, data=body, timeout=60)
        huge.update(status=answer.status_code, error=answer.json()["error"], end=time.monotonic())

    sender = threading.Thread(target=send_huge)
    sender.start()
    time.sleep(0.3)  # the huge request is read and its render started
    assert agent_conversation(light["base_url"]) == "It is sunny in Paris, 21 C."
    light_done = time.monotonic()
    sender.join(60)
    assert huge["status"] == 413 and "max_context_tokens=4096" in huge["error"]["message"]
    assert light_done < huge["end"], "the other session waited for the huge render"
    assert served.post(f"/sessions/{light['id']}/finish").json()["status"] == "finished"
    turns = [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]
    exported = {s["id"]: s for s in served.export(episode["episode"])["sessions"]}
    assert_trained_on(exported[light["id"]], turns)
    assert exported[heavy["id"]]["rows"] == []


# -- every render in the worker threads --------------------------------------------


class PerSessionEngine:
    """Turn k of every session is ``turns[k]`` (the last one repeats), after ``delay_s``."""

    def __init__(self, turns: list[Generation], delay_s: float = 0.02) -> None:
        self.turns, self.delay_s = turns, delay_s
        self.calls: dict[str | None, int] = defaultdict(int)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        index = self.calls[session_id]
        self.calls[session_id] += 1
        await asyncio.sleep(self.delay_s)
        return self.turns[min(index, len(self.turns) - 1)]


@pytest.fixture
def turns(qwen3: ChatTokenizer) -> list[Generation]:
    return [generation(qwen3, CALL_TURN), generation(qwen3, FINAL_TURN)]


@pytest.fixture
def threaded(qwen3: ChatTokenizer, turns: list[Generation]) -> Iterator[Served]:
    engine = PerSessionEngine(turns)
    sampling = SamplingParams(temperature=0.8, max_tokens=200)
    server = Served(Gateway(engine, qwen3, sampling, render_threads=3, inline_bytes=0))
    yield server
    server.close()


async def tool_loop(base_url: str) -> str:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=OPENAI_TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return str(message.content)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER})


async def test_concurrent_sessions_rendered_in_threads_stay_exact(threaded, turns):
    episode = threaded.open_episode(group_size=24)
    finals = await asyncio.gather(*(tool_loop(s["base_url"]) for s in episode["sessions"]))
    assert finals == ["It is sunny in Paris, 21 C."] * 24
    for session in episode["sessions"]:
        assert threaded.post(f"/sessions/{session['id']}/finish").json()["status"] == "finished"
    exported = threaded.export(episode["episode"])["sessions"]
    assert len(exported) == 24
    for session in exported:
        assert_trained_on(session, turns)
        assert len(session["calls"]) == 2


async def test_identical_requests_together_fork_a_parallel_chain(threaded, turns):
    episode = threaded.open_episode()
    session = episode["sessions"][0]
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    await asyncio.gather(
        *(client.chat.completions.create(model="m", messages=messages) for _ in range(2))
    )
    assert threaded.post(f"/sessions/{session['id']}/finish").json()["status"] == "finished"
    rows = threaded.export(episode["episode"])["sessions"][0]["rows"]
    assert [(r["fork_reason"], r["calls"]) for r in rows] == [(None, 1), ("parallel", 1)]
    assert rows[0]["prompt_ids"] == rows[1]["prompt_ids"]  # both prepared on one chain end
    sampled = sorted(
        tuple(t for t, m in zip(r["ids"], r["loss_mask"], strict=True) if m) for r in rows
    )
    assert sampled == sorted(tuple(g.token_ids) for g in turns)
