"""The gateway with every render in its worker threads (``inline_bytes=0``).

Many sessions at once through the real ``openai`` async client: each session's export is
one chain of exactly the engine's ids, and two identical requests sent together in one
session are prepared in order on the same chain end (the second a ``parallel`` chain).
The engine is the only stand-in (the package's boundary): real Qwen3 ids, a per-session
script, a short fixed latency.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_gateway_service import (
    CALL_TURN,
    FINAL_TURN,
    OPENAI_TOOLS,
    QUESTION,
    WEATHER,
    Served,
    assert_trained_on,
    generation,
)

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.gateway.service import Gateway
from turnrl.tool_envs.protocol import Generation, SamplingParams

pytestmark = pytest.mark.timeout(120)


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
def served(qwen3: ChatTokenizer, turns: list[Generation]) -> Iterator[Served]:
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


async def test_concurrent_sessions_rendered_in_threads_stay_exact(served, turns):
    episode = served.open_episode(group_size=24)
    finals = await asyncio.gather(*(tool_loop(s["base_url"]) for s in episode["sessions"]))
    assert finals == ["It is sunny in Paris, 21 C."] * 24
    for session in episode["sessions"]:
        assert served.post(f"/sessions/{session['id']}/finish").json()["status"] == "finished"
    exported = served.export(episode["episode"])["sessions"]
    assert len(exported) == 24
    for session in exported:
        assert_trained_on(session, turns)
        assert len(session["calls"]) == 2


async def test_identical_requests_together_fork_a_parallel_chain(served, turns):
    episode = served.open_episode()
    session = episode["sessions"][0]
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    await asyncio.gather(
        *(client.chat.completions.create(model="m", messages=messages) for _ in range(2))
    )
    assert served.post(f"/sessions/{session['id']}/finish").json()["status"] == "finished"
    rows = served.export(episode["episode"])["sessions"][0]["rows"]
    assert [(r["fork_reason"], r["calls"]) for r in rows] == [(None, 1), ("parallel", 1)]
    assert rows[0]["prompt_ids"] == rows[1]["prompt_ids"]  # both prepared on one chain end
    sampled = sorted(
        tuple(t for t, m in zip(r["ids"], r["loss_mask"], strict=True) if m) for r in rows
    )
    assert sampled == sorted(tuple(g.token_ids) for g in turns)
