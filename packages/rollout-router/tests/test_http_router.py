"""HTTP router (turnrl-router) over fake engines: pass-through, stickiness, abort, status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.http_router import HttpRouter, build_parser, main
from turnrl.rollout_router.router import Router, RouterConfig


@pytest.fixture
async def serve() -> AsyncIterator:
    runners: list[web.AppRunner] = []

    async def start(engines: list[str], **kw: object) -> str:
        router = Router(engines, RouterConfig(health_interval=0, open_cooldown=0.2))
        runner = web.AppRunner(HttpRouter(router, **kw).app())  # type: ignore[arg-type]
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_completions_pass_through_and_stick_by_session_header(make_engine, serve):
    a, b = await make_engine(name="a"), await make_engine(name="b")
    url = await serve([a.url, b.url])
    async with aiohttp.ClientSession() as http:
        models = []
        for _ in range(4):
            async with http.post(
                url + "/v1/chat/completions",
                json={"messages": []},
                headers={"x-session-id": "ep-1"},
            ) as resp:
                assert resp.status == 200
                models.append((await resp.json())["model"])
        assert len(set(models)) == 1
        unsessioned = []  # least in flight, ties to the engine sent fewer requests so far
        for _ in range(8):
            async with http.post(url + "/v1/completions", json={"prompt": "hi"}) as resp:
                unsessioned.append((await resp.json())["model"])
        assert set(unsessioned) == {"a", "b"}  # spread when no session


async def test_streaming_pass_through(make_engine, serve):
    a = await make_engine()
    url = await serve([a.url])
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r,
    ):
        assert r.headers["Content-Type"].startswith("text/event-stream")
        body = (await r.read()).decode()
    assert body.rstrip().endswith("data: [DONE]") and '"text": "ok"' in body


async def test_token_generate_route_retries_a_failing_engine(make_engine, serve):
    bad, good = await make_engine(fail_status=500), await make_engine()
    url = await serve([bad.url, good.url])
    body = {"token_ids": [2, 3], "sampling_params": {"max_tokens": 2}, "stream": False}
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(url + "/inference/v1/generate", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["token_ids"] == [5, 6]


async def test_abort_by_session_drains_and_leaves_others(make_engine, serve):
    a = await make_engine(token_delay=0.01)
    url = await serve([a.url])
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 2000}, "stream": True}

    async def stream(session: str) -> str:
        headers = {"x-session-id": session}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/inference/v1/generate", json=body, headers=headers) as resp,
        ):
            return (await resp.read()).decode()

    victim = asyncio.create_task(stream("victim"))
    other = asyncio.create_task(stream("other"))
    while len(a.running) < 2:
        await asyncio.sleep(0.01)
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/abort_requests", json={"session_id": "victim"}) as resp,
    ):
        assert resp.status == 200 and (await resp.json()) == {"aborted": 1, "sends": 1}
    assert victim.done()  # drained before the abort answered
    assert '"finish_reason": "abort"' in victim.result()
    assert len(a.aborted) == 1
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/abort_requests", json={}) as resp,
    ):
        assert (await resp.json()) == {"aborted": 1, "sends": 1}
    assert '"finish_reason": "abort"' in await other


async def test_an_ignored_abort_is_resent_until_the_stream_ends(make_engine, serve):
    """The engine swallows two aborts (as vLLM does for a request not registered yet)."""
    engine = await make_engine(token_delay=0.01, ignore_aborts=2)
    url = await serve([engine.url])
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 5000}, "stream": True}
    async with aiohttp.ClientSession() as http:

        async def stream() -> str:
            headers = {"x-session-id": "s"}
            async with http.post(url + "/inference/v1/generate", json=body, headers=headers) as r:
                return (await r.read()).decode()

        task = asyncio.create_task(stream())
        while not engine.running:
            await asyncio.sleep(0.01)
        async with http.post(url + "/abort_requests", json={"session_id": "s"}) as resp:
            assert resp.status == 200 and (await resp.json()) == {"aborted": 1, "sends": 3}
        assert '"finish_reason": "abort"' in await task
    assert engine.ignore_aborts == 0


async def test_status_routes(make_engine, serve):
    a = await make_engine()
    url = await serve([a.url])
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["healthy_engines"] == [a.url]
        async with http.post(url + "/v1/completions", json={"prompt": "x"}) as resp:
            await resp.read()
        async with http.get(url + "/metrics") as resp:
            assert f'turnrl_router_engine_requests_total{{engine="{a.url}"}} 1' in await resp.text()
        async with http.get(url + "/engines") as resp:
            assert (await resp.json())[a.url]["circuit"] == "closed"


async def test_bad_requests_and_no_engines(serve):
    url = await serve([])
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
        async with http.post(url + "/v1/completions", data=json.dumps([1])) as resp:
            assert resp.status == 400
        async with http.post(url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503 and "no engines" in (await resp.json())["error"]
        async with http.post(url + "/abort_requests", json={"session_id": 3}) as resp:
            assert resp.status == 400
        async with http.get(url + "/health") as resp:
            assert resp.status == 503


def test_cli_requires_engines_and_urls(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    with pytest.raises(SystemExit, match="http"):
        main(["serve", "--engine", "localhost:8000"])
    args = build_parser().parse_args(
        ["serve", "--engine", "http://a:1", "--engine", "http://b:2", "--port", "9000"]
    )
    assert args.engine == ["http://a:1", "http://b:2"] and args.port == 9000
