"""EngineClient against fake vLLM engines on loopback: generation, abort + drain, errors."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient, engine_request_id
from turnrl.rollout_router.protocol import (
    DrainTimeoutError,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    PartialGenerationError,
    SamplingParams,
)


async def test_generate_returns_exact_tokens_logprobs_and_finish(make_engine):
    engine = await make_engine()
    async with EngineClient(engine.url) as client:
        gen = await client.generate([3, 4], SamplingParams(max_tokens=5, temperature=0))
    assert gen.token_ids == [7, 8, 9, 10, 11]
    assert gen.logprobs == [-0.5] * 5
    assert gen.finish_reason == "length"
    assert gen.engine == engine.url
    sent = engine.requests[0]
    assert sent["token_ids"] == [3, 4]
    assert sent["sampling_params"]["logprobs"] == 0 and sent["stream"] is True


async def test_abort_mid_generation_keeps_partial_tokens_and_drains(make_engine):
    engine = await make_engine(token_delay=0.01)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(
            client.generate([1], SamplingParams(max_tokens=10_000), request_id="r1")
        )
        while client.num_in_flight == 0 or not engine.running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert await client.abort(["r1"], drain_timeout=2.0) == 1
        assert client.num_in_flight == 0  # drained before abort() returned
        gen = task.result()
    assert gen.finish_reason == "abort"
    assert 0 < len(gen.token_ids) < 10_000
    assert engine.aborted == {"generate-tokens-r1"}  # the prefixed, engine-side id


async def test_stream_closed_after_our_abort_is_an_abort_not_a_failure(make_engine):
    engine = await make_engine(token_delay=0.01, close_on_abort=True)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(
            client.generate([1], SamplingParams(max_tokens=10_000), request_id="r1")
        )
        while client.num_in_flight == 0 or not engine.running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert await client.abort(["r1"], drain_timeout=2.0) == 1
        gen = task.result()
    assert gen.finish_reason == "abort"
    assert 0 < len(gen.token_ids) < 10_000


@pytest.mark.parametrize("label", ["abort", "length", "stop"])
async def test_aborted_stream_is_an_abort_whatever_the_engine_labels_it(make_engine, label):
    engine = await make_engine(token_delay=0.01, abort_reason=label)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(
            client.generate([1], SamplingParams(max_tokens=10_000), request_id="r1")
        )
        while client.in_flight_tokens().get("r1", 0) < 5:
            await asyncio.sleep(0.01)
        assert await client.abort(["r1"], drain_timeout=2.0) == 1
        gen = await task
    assert gen.finish_reason == "abort"
    assert 5 <= len(gen.token_ids) < 10_000


async def test_length_finish_at_the_limit_stays_length_after_a_late_abort(make_engine):
    engine = await make_engine()
    async with EngineClient(engine.url) as client:
        gen = await client.generate([1], SamplingParams(max_tokens=7), request_id="r1")
        assert await client.abort(["r1"], drain_timeout=1.0) == 0
    assert gen.finish_reason == "length" and len(gen.token_ids) == 7


def test_engine_request_id_is_prefixed_once():
    assert engine_request_id("abc") == "generate-tokens-abc"
    assert engine_request_id("generate-tokens-abc") == "generate-tokens-abc"


async def test_abort_session_only_touches_that_session(make_engine):
    engine = await make_engine(token_delay=0.01)
    async with EngineClient(engine.url) as client:
        p = SamplingParams(max_tokens=50)
        a = asyncio.create_task(client.generate([1], p, "s-a"))
        b = asyncio.create_task(client.generate([1], p, "s-b"))
        while len(engine.running) < 2:
            await asyncio.sleep(0.01)
        assert await client.abort_session("s-a") == 1
        assert (await a).finish_reason == "abort"
        assert (await b).finish_reason == "length" and len(b.result().token_ids) == 50


async def test_abort_all_confirms_engine_side_drain(make_engine):
    engine = await make_engine(token_delay=0.01)
    async with EngineClient(engine.url) as client:
        tasks = [
            asyncio.create_task(client.generate([i], SamplingParams(max_tokens=1000)))
            for i in range(4)
        ]
        while len(engine.running) < 4:
            await asyncio.sleep(0.01)
        assert await client.abort_all(drain_timeout=3.0) == 4
        assert await client.engine_load() == 0
        assert {t.result().finish_reason for t in tasks} == {"abort"}


async def test_engine_killed_mid_stream_raises_partial(make_engine):
    engine = await make_engine(token_delay=0.01)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(client.generate([1], SamplingParams(max_tokens=1000)))
        while not engine.running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await engine.kill()
        with pytest.raises(PartialGenerationError, match="after") as err:
            await task
        assert err.value.partial is not None and len(err.value.partial.token_ids) > 0
        assert client.num_in_flight == 0


async def test_a_pooled_connection_the_engine_closed_is_sent_again(make_engine):
    """The engine drops idle keep-alive connections (vLLM after 5 s) while this event loop
    is blocked (a trainer starting): the pooled connections are dead when the next requests
    go out. Each request is sent once more on a fresh connection, and only once: the engine
    sees every generation and control call exactly once."""
    engine = await make_engine(keepalive_timeout=0.2)
    params = SamplingParams(max_tokens=4)
    async with EngineClient(engine.url) as client:
        await asyncio.gather(*[client.generate([1, 2], params) for _ in range(8)])
        time.sleep(0.6)  # blocks the loop: the engine's closes go unread
        gens = await asyncio.gather(*[client.generate([1, 2], params) for _ in range(8)])
        assert [g.token_ids for g in gens] == [[3, 4, 5, 6]] * 8
        assert len(engine.requests) == 16
        await client.pause("wait")
        time.sleep(0.6)
        assert await client.is_paused()
        await client.resume()
    assert [path for path, _ in engine.rl_calls].count("/pause?mode=wait") == 1


async def test_unreachable_engine_and_5xx_are_retryable_errors(make_engine):
    async with EngineClient(f"http://127.0.0.1:{free_port()}", connect_timeout=1) as client:
        with pytest.raises(EngineUnavailableError):
            await client.generate([1])
        assert not await client.health()
    engine = await make_engine(fail_status=503)
    async with EngineClient(engine.url) as client:
        with pytest.raises(EngineUnavailableError, match="HTTP 503"):
            await client.generate([1])


async def test_4xx_is_a_request_error(make_engine):
    engine = await make_engine(fail_status=400)
    async with EngineClient(engine.url) as client:
        with pytest.raises(EngineRequestError) as err:
            await client.generate([1])
    assert err.value.status == 400


async def test_cancelled_generation_is_aborted_on_the_engine(make_engine):
    engine = await make_engine(token_delay=0.01)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(
            client.generate([1], SamplingParams(max_tokens=1000), request_id="gone")
        )
        while not engine.running:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not engine.running:
                break
            await asyncio.sleep(0.01)
    assert "generate-tokens-gone" in engine.aborted or not engine.running


async def test_bad_inputs_are_rejected(make_engine, tmp_path: Path):
    with pytest.raises(ValueError, match="http"):
        EngineClient("localhost:8000")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    engine = await make_engine(token_delay=0.05)
    async with EngineClient(engine.url) as client:
        with pytest.raises(ValueError, match="empty"):
            await client.generate([])
        with pytest.raises(ValueError, match="non-negative"):
            await client.generate([1, -2])
        task = asyncio.create_task(
            client.generate([1], SamplingParams(max_tokens=3), request_id="dup")
        )
        await asyncio.sleep(0.02)
        with pytest.raises(ValueError, match="already in flight"):
            await client.generate([1], request_id="dup")
        await task
        with pytest.raises(ValueError, match="safetensors"):
            await client.reload_weights(tmp_path / "missing")
        with pytest.raises(ValueError, match="pause mode"):
            await client.pause("later")


async def test_a_reload_resets_the_prefix_cache_under_running_requests(make_engine, tmp_path: Path):
    """vLLM declines a plain prefix-cache reset while requests run: the reload preempts them
    so no prefix of the old weights survives, and a reset still declined fails the reload."""
    engine = await make_engine(token_delay=0.05)
    weights = tmp_path / "step-1"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(client.generate([1], SamplingParams(max_tokens=40)))
        while not engine.running:
            await asyncio.sleep(0.01)
        assert not await client.reset_prefix_cache()  # declined: a request holds blocks
        await client.reload_weights(weights, weight_version="1")
        engine.decline_cache_reset = True
        with pytest.raises(EngineError, match="declined to reset its prefix cache"):
            await client.reload_weights(weights, weight_version="2")
        assert await client.weight_version() == "1"  # not announced over a stale cache
        await client.abort_all()
        await task


async def test_weight_calls_follow_vllm_rl_api(make_engine, tmp_path: Path):
    """The HTTP calls only; a real NCCL/HCCL transfer needs a GPU/NPU (not on this CI)."""
    engine = await make_engine()
    weights = tmp_path / "step-3"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    async with EngineClient(engine.url) as client:
        await client.reload_weights(weights, weight_version="3")
        assert await client.weight_version() == "3"
        await client.init_weight_transfer(
            {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
        )
        await client.start_weight_update()
        info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]}
        await client.update_weights(info)
        await client.finish_weight_update("4")
        await client.pause("keep")
        assert await client.is_paused()
        await client.resume()
    assert engine.rl_calls == [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}),
        ("/reset_prefix_cache?reset_running_requests=true", None),
        ("/update_weight_version", {"new_version": "3"}),
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "10.0.0.1",
                    "master_port": 29500,
                    "rank_offset": 1,
                    "world_size": 2,
                }
            },
        ),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": info}),
        ("/finish_weight_update", {"weight_version": "4"}),
        ("/pause?mode=keep", None),
        ("/resume", None),
    ]


async def test_abort_is_resent_until_the_request_ends(make_engine):
    engine = await make_engine(token_delay=0.01, ignore_aborts=2)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(client.generate([1], SamplingParams(max_tokens=5000), "s"))
        while not engine.running:
            await asyncio.sleep(0.01)
        assert await client.abort_session("s", drain_timeout=5.0) == 1
        assert (await task).finish_reason == "abort"
    assert engine.ignore_aborts == 0  # the first two were swallowed, the third landed


async def test_drain_timeout_names_the_stuck_requests(make_engine):
    engine = await make_engine(token_delay=0.01, ignore_aborts=1000)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(
            client.generate([1], SamplingParams(max_tokens=5000), request_id="stuck")
        )
        while not engine.running:
            await asyncio.sleep(0.01)
        with pytest.raises(DrainTimeoutError, match="connections were closed") as err:
            await client.abort(["stuck"], drain_timeout=0.6)
        assert err.value.pending == ["stuck"]
        # the last resort closed the stream: the generation ends as an abort, tokens kept
        gen = await asyncio.wait_for(task, 5)
        assert gen.finish_reason == "abort" and gen.token_ids


async def test_abort_all_of_a_stalled_engine_is_bounded_by_its_deadline(make_engine):
    """The engine answers nothing (its API server starved): abort-all, its drain and the
    engine's gauges all wait on it, yet the caller has its answer at the deadline."""
    engine = await make_engine(token_delay=0.01)
    async with EngineClient(engine.url) as client:
        task = asyncio.create_task(client.generate([1], SamplingParams(max_tokens=100_000)))
        while not engine.running:
            await asyncio.sleep(0.01)
        engine.stalled = True
        began = time.monotonic()
        with pytest.raises(DrainTimeoutError):
            await client.abort_all(drain_timeout=0.6)
        assert time.monotonic() - began < 0.6 + 0.5
        assert (await asyncio.wait_for(task, 1.0)).finish_reason == "abort"
        assert client.abort_escalations == 1
        engine.stalled = False


async def test_sse_lines_reads_lines_longer_than_aiohttps_limit():
    """vLLM's final chunk after an abort can exceed aiohttp's 512 KiB line limit."""
    from aiohttp import web

    from turnrl.rollout_router.client import sse_lines

    long_line = b"data: " + b"x" * (3 * 1024 * 1024)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for part in (b"data: a\n", long_line[:1000], long_line[1000:] + b"\n", b"data: [DONE]"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/") as resp:
            lines = [line async for line in sse_lines(resp.content)]
    finally:
        await runner.cleanup()
    assert lines == [b"data: a", long_line, b"data: [DONE]"]
