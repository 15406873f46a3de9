"""Malformed HTTP against the gateway: clear 4xx answers, the server up, other sessions whole.

Raw bytes on a socket (bad request lines and headers, broken chunked encoding, lying
lengths) and bad bodies (truncated JSON, wrong content types, bodies over the size limit, a
history of 20,000 messages) hit the aiohttp gateway while a real agent conversation of
another session goes on; that conversation must end as one chain of the engine's ids. The
only fake is the engine boundary (``ScriptedEngine``, real Qwen3 ids).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import requests
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
from turnrl.tool_envs.protocol import SamplingParams

pytestmark = pytest.mark.timeout(120)

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
