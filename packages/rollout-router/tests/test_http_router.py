"""HTTP router (turnrl-router) over fake engines: pass-through, stickiness, abort, status."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.http_router import HttpRouter, build_parser, main
from turnrl.rollout_router.router import Router, RouterConfig
from turnrl.rollout_router.testing import FakeEngine


@pytest.fixture(params=["fast", "aiohttp"])
async def serve(request: pytest.FixtureRequest) -> AsyncIterator:
    """Start the router over engines: its own server (what ``turnrl-router serve`` runs)
    or its aiohttp application; every test runs against both."""
    closers: list[Callable[[], Awaitable[None]]] = []

    async def start(engines: list[str], **kw: object) -> str:
        router = Router(engines, RouterConfig(health_interval=0, open_cooldown=0.2))
        http = HttpRouter(router, **kw)  # type: ignore[arg-type]
        port = free_port()
        if request.param == "fast":
            server = await http.serve("127.0.0.1", port)

            async def close() -> None:
                server.close()
                await http.close()

            closers.append(close)
        else:
            runner = web.AppRunner(http.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            closers.append(runner.cleanup)
        return f"http://127.0.0.1:{port}"

    yield start
    for close in closers:
        await close()


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


@pytest.mark.parametrize("path", ["/inference/v1/generate", "/v1/completions"])
async def test_an_abort_a_stalled_engine_never_confirms_ends_the_stream_within_the_deadline(
    make_engine, serve, path
):
    """The engine's API server stops answering anything while a stream is open (as vLLM's
    does when its engine-core process takes the cores it needs): ``/abort_requests``
    still answers within its deadline, the caller's stream ends as aborted, the engine
    leaves rotation until a health check finds it answering, and the event is counted."""
    engine = await make_engine(token_delay=0.01)
    url = await serve([engine.url], drain_timeout=1.0)
    if path == "/v1/completions":
        body: dict[str, object] = {"prompt": "hi", "max_tokens": 100_000, "stream": True}
    else:
        body = {"token_ids": [1], "sampling_params": {"max_tokens": 100_000}, "stream": True}
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:

        async def stream() -> str:
            async with http.post(url + path, json=body, headers={"x-session-id": "s"}) as r:
                return (await r.read()).decode()

        task = asyncio.create_task(stream())
        while not engine.running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # a few tokens relayed
        engine.stalled = True
        began = loop.time()
        async with http.post(url + "/abort_requests", json={"session_id": "s"}) as resp:
            status, answer = resp.status, await resp.json()
        assert loop.time() - began < 1.0 + 0.5
        assert status == 504 and answer["escalated"] == 1, answer
        text = await asyncio.wait_for(task, 1.0)  # ended when the abort answered
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 3
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        async with http.get(url + "/engines") as r:
            state = (await r.json())[engine.url]
        assert state["circuit"] == "open" and state["abort_escalations_total"] == 1
        async with http.get(url + "/metrics") as r:
            metric = f'turnrl_router_engine_abort_escalations_total{{engine="{engine.url}"}} 1'
            assert metric in await r.text()
    engine.stalled = False


async def test_a_request_a_stalled_engine_never_answered_ends_as_aborted(make_engine, serve):
    """No byte came back yet (the engine stalled before answering): the caller of a
    non-streamed request gets vLLM's answer for an aborted one, at the abort's deadline."""
    engine = await make_engine(stalled=True)
    url = await serve([engine.url], drain_timeout=0.5)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:

        async def ask() -> tuple[int, dict[str, object]]:
            headers = {"x-session-id": "s"}
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                return r.status, await r.json()

        task = asyncio.create_task(ask())
        await asyncio.sleep(0.2)  # the router has sent it on
        async with http.post(url + "/abort_requests", json={"session_id": "s"}) as resp:
            assert resp.status == 504 and (await resp.json())["escalated"] == 1
        status, answer = await asyncio.wait_for(task, 1.0)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "abort"  # type: ignore[index]
    engine.stalled = False


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


async def test_v1_bodies_pass_untouched_and_stay_abortable(make_engine, serve):
    """/v1/* bodies are not parsed: the id is the caller's X-Request-Id or made up, and the
    engine files the request under it, so an abort by session still finds it."""
    engine = await make_engine(token_delay=0.01)
    url = await serve([engine.url])
    body = b'{"prompt": "x", "max_tokens": 2000, "stream": true}'

    async def stream(http: aiohttp.ClientSession, session: str, rid: str | None) -> str:
        headers = {"x-session-id": session, "Content-Type": "application/json"}
        if rid is not None:
            headers["X-Request-Id"] = rid
        async with http.post(url + "/v1/completions", data=body, headers=headers) as r:
            assert r.status == 200
            return (await r.read()).decode()

    async with aiohttp.ClientSession() as http:
        for session, rid in (("named", "my-id"), ("anonymous", None)):
            task = asyncio.create_task(stream(http, session, rid))
            while not engine.running:
                await asyncio.sleep(0.01)
            if rid is not None:
                assert list(engine.running) == [f"cmpl-{rid}-0"]
            async with http.post(url + "/abort_requests", json={"session_id": session}) as r:
                assert r.status == 200 and (await r.json()) == {"aborted": 1, "sends": 1}
            assert task.done() and '"finish_reason": "abort"' in task.result()
        # A body naming its request_id is parsed for it (as before).
        payload = {"prompt": "x", "request_id": "from-body"}
        async with http.post(url + "/v1/chat/completions", json=payload) as r:
            assert (await r.json())["id"] == "chatcmpl-from-body"
        async with http.post(url + "/v1/completions", data=b'{"prompt": "\\r\\n"}') as r:
            assert r.status == 200  # untouched, whatever its bytes
    assert engine.requests[-1] == {"prompt": "\r\n"}


async def test_engine_death_mid_stream_cuts_the_stream_and_is_not_retried(make_engine, serve):
    engine = await make_engine(token_delay=0.02)
    other = await make_engine()
    url = await serve([engine.url, other.url])
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 2000}, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/inference/v1/generate", json=body, headers={"x-session-id": "s"}) as r,
    ):
        assert r.status == 200
        await r.content.readuntil(b"\n\n")  # a token arrived: no retry from here on
        if not engine.running:  # the first pick was the other engine: kill that one
            engine, other = other, engine
        await engine.kill()
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert other.requests == []  # not retried once tokens were relayed


async def test_client_disconnect_ends_the_engine_request(make_engine, serve):
    engine = await make_engine(token_delay=0.01)
    url = await serve([engine.url])
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 5000}, "stream": True}
    async with aiohttp.ClientSession() as http:
        r = await http.post(url + "/inference/v1/generate", json=body)
        await r.content.readuntil(b"\n\n")
        assert engine.running
        r.close()  # drop the connection mid-stream
    for _ in range(200):
        if not engine.running:
            break
        await asyncio.sleep(0.01)
    assert not engine.running, "the engine still generates for a caller that left"


async def test_engine_closing_idle_keep_alive_connections_is_no_failure(make_engine, serve):
    engine = await make_engine(keepalive_timeout=0.1)
    url = await serve([engine.url])
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
            await asyncio.sleep(0.3)  # the engine closes the idle upstream connection
        async with http.get(url + "/engines") as r:
            state = (await r.json())[engine.url]
    assert state["errors_total"] == 0 and state["requests_total"] == 3


async def test_raw_http11_chunked_body_expect_continue_pipelining_and_close(make_engine, serve):
    engine = await make_engine()
    url = await serve([engine.url])
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"prompt": "chunked"}'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
        + b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}"
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)  # to EOF: the last asked to close
    writer.close()
    assert raw.count(b"HTTP/1.1 200 OK") == 3, raw
    assert b"healthy_engines" in raw and raw.count(b'"model": "fake"') == 2
    assert engine.requests == [{"prompt": "chunked"}, {}]


async def test_unknown_routes_and_methods_answer_json(make_engine, serve):
    engine = await make_engine()
    url = await serve([engine.url])
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/nope") as r:
            assert r.status == 404
        async with http.get(url + "/v1/completions") as r:
            assert r.status == 405
        headers = {"X-Request-Id": "a" * 600}
        async with http.post(url + "/v1/completions", data=b"", headers=headers) as r:
            assert r.status == 400 and "request_id" in (await r.json())["error"]


def test_cli_serves_until_sigterm(tmp_path):
    """``turnrl-router serve`` (uvloop where installed) relays, then exits on SIGTERM."""

    async def run() -> None:
        engine = await FakeEngine().start()
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "turnrl.rollout_router.http_router",
            "serve",
            "--engine",
            engine.url,
            "--port",
            str(port),
        )
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(300):
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.05)
                body = {"prompt": "x", "stream": True}
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200 and b"[DONE]" in await r.read()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await engine.kill()

    asyncio.run(run())
