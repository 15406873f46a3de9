"""In-process Router over fake engines on loopback: choice, stickiness, caps, circuits."""

from __future__ import annotations

import asyncio
import time

import pytest

from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.protocol import (
    DrainTimeoutError,
    EngineRequestError,
    NoEngineAvailableError,
    PartialGenerationError,
    SamplingParams,
)
from turnrl.rollout_router.router import Router, RouterConfig

FAST = SamplingParams(max_tokens=3)


def config(**kw: object) -> RouterConfig:
    base: dict[str, object] = {"health_interval": 0, "open_cooldown": 0.2}
    return RouterConfig(**{**base, **kw})  # type: ignore[arg-type]


async def test_new_sessions_go_to_least_in_flight(make_engine):
    a, b = await make_engine(token_delay=0.01), await make_engine(token_delay=0.01)
    async with Router([a.url, b.url], config()) as router:
        gens = await asyncio.gather(
            *(router.generate([1], SamplingParams(max_tokens=20), f"s{i}") for i in range(6))
        )
    counts = {a.url: 0, b.url: 0}
    for g in gens:
        counts[g.engine] += 1
    assert counts == {a.url: 3, b.url: 3}


async def test_sticky_session_returns_to_its_engine(make_engine):
    a, b = await make_engine(), await make_engine()
    async with Router([a.url, b.url], config()) as router:
        first = await router.generate([1], FAST, "episode")
        later = [await router.generate([1, t], FAST, "episode") for t in range(5)]
        assert {g.engine for g in later} == {first.engine}
        assert router.session_engine("episode") == first.engine


async def test_session_table_is_bounded_lru_with_expiry(make_engine):
    a = await make_engine()
    async with Router([a.url], config(sticky_max_sessions=2, sticky_ttl=0.2)) as router:
        for sid in ("s1", "s2", "s3"):
            await router.generate([1], FAST, sid)
        assert router.session_engine("s1") is None  # evicted: least recently used
        assert router.session_engine("s3") == a.url
        await asyncio.sleep(0.25)
        assert router.session_engine("s3") is None  # expired


async def test_per_engine_concurrency_cap_is_never_exceeded(make_engine):
    a = await make_engine(token_delay=0.005)
    peak = 0

    async with Router([a.url], config(max_concurrency_per_engine=3)) as router:

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(a.running))
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        gens = await asyncio.gather(
            *(router.generate([i], SamplingParams(max_tokens=10)) for i in range(10))
        )
        watcher.cancel()
    assert len(gens) == 10 and peak == 3


async def test_full_sticky_engine_spills_to_a_free_one(make_engine):
    a, b = await make_engine(token_delay=0.01), await make_engine(token_delay=0.01)
    async with Router([a.url, b.url], config(max_concurrency_per_engine=1)) as router:
        gens = await asyncio.gather(*(router.generate([1], FAST, "same") for _ in range(2)))
    assert {g.engine for g in gens} == {a.url, b.url}


async def test_failure_before_any_token_is_retried_on_another_engine(make_engine):
    bad, good = await make_engine(fail_status=500), await make_engine()
    async with Router([bad.url, good.url], config(failure_threshold=2)) as router:
        gens = [await router.generate([i], FAST) for i in range(4)]
        assert {g.engine for g in gens} == {good.url}
        state = router.engine(bad.url)
        assert state.circuit == "open" and state.errors_total == 2
        assert "HTTP 500" in state.last_error


async def test_errors_total_keeps_the_errors_of_removed_engines(make_engine):
    """``errors_total`` counts an engine's failures after it left the router (and was added
    back): a run's per-step error count must not lose those of an engine it dropped."""
    bad, good = await make_engine(fail_status=500), await make_engine()
    async with Router([bad.url, good.url], config(failure_threshold=2)) as router:
        for i in range(4):
            await router.generate([i], FAST)
        assert router.errors_total() == router.engine(bad.url).errors_total == 2
        await router.remove_engine(bad.url)
        assert bad.url not in router.metrics() and router.errors_total() == 2
        router.add_engine(bad.url)  # back: a fresh state, the old count kept
        assert router.engine(bad.url).errors_total == 0 and router.errors_total() == 2
        await router.remove_engine(bad.url)  # nothing in flight: forgotten at once
        router.add_engine(bad.url)
        await router.remove_engine(bad.url)
        assert router.errors_total() == 2


async def test_failure_after_tokens_is_not_retried(make_engine):
    a = await make_engine(token_delay=0.01)
    b = await make_engine(token_delay=0.01)
    async with Router([a.url, b.url], config()) as router:
        task = asyncio.create_task(router.generate([1], SamplingParams(max_tokens=1000), "x"))
        while not (a.running or b.running):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        victim = a if a.running else b
        other = b if victim is a else a
        await victim.kill()
        with pytest.raises(PartialGenerationError):
            await task
        assert other.requests == []  # never replayed elsewhere


async def test_open_circuit_half_opens_and_recovers(make_engine):
    a = await make_engine(fail_status=500)
    b = await make_engine()
    async with Router([a.url, b.url], config(failure_threshold=1, open_cooldown=0.2)) as router:
        await router.generate([1], FAST)
        assert router.engine(a.url).circuit == "open"
        a.fail_status = None  # the engine comes back
        await asyncio.sleep(0.25)
        await router.check_health()  # the probe
        assert router.engine(a.url).circuit == "closed"


async def test_failed_probe_doubles_the_cooldown(make_engine):
    a = await make_engine(healthy=False)
    async with Router([a.url], config(failure_threshold=1, open_cooldown=0.1)) as router:
        await router.check_health()
        assert router.engine(a.url).circuit == "open"
        await asyncio.sleep(0.12)
        await router.check_health()
        state = router.engine(a.url)
        assert state.circuit == "open" and state.cooldown == pytest.approx(0.2)


async def test_all_circuits_open_still_probes_instead_of_failing_forever(make_engine):
    a = await make_engine(fail_status=500)
    async with Router([a.url], config(failure_threshold=1, open_cooldown=30)) as router:
        with pytest.raises(NoEngineAvailableError):
            await router.generate([1], FAST)
        assert router.engine(a.url).circuit == "open"
        a.fail_status = None
        # Cooldown is 30 s, but with every engine shut the router probes at once.
        gen = await router.generate([1], FAST)
        assert gen.engine == a.url and router.engine(a.url).circuit == "closed"


async def test_dead_engine_leaves_rotation_within_two_seconds(make_engine):
    a, b = await make_engine(), await make_engine()
    async with Router([a.url, b.url], config(health_interval=0.25)) as router:
        await a.kill()
        start = time.monotonic()
        while router.engine(a.url).circuit == "closed":
            assert time.monotonic() - start < 2.0
            await asyncio.sleep(0.02)


async def test_a_health_check_that_raises_counts_as_a_failure_and_the_loop_goes_on(make_engine):
    """An error the client's ``health`` does not catch (here RuntimeError, as aiohttp's
    "Session is closed") fails that engine's check, not the health loop."""
    a, b = await make_engine(), await make_engine()
    async with Router([a.url, b.url], config(health_interval=0.05)) as router:
        broken = router.engine(a.url).client

        async def health(timeout: float = 2.0) -> bool:
            raise RuntimeError("Session is closed")

        broken.health = health  # type: ignore[method-assign]
        start = time.monotonic()
        while router.engine(a.url).circuit == "closed":
            assert time.monotonic() - start < 2.0
            await asyncio.sleep(0.02)
        assert "RuntimeError('Session is closed')" in (router.engine(a.url).last_error or "")
        errors = router.errors_total()
        await asyncio.sleep(0.5)  # the loop goes on: a's half-open probes fail, b stays well
        assert router.errors_total() > errors and router.engine(b.url).circuit == "closed"


async def test_the_health_loop_outlives_an_error_of_the_check_itself(
    make_engine, monkeypatch: pytest.MonkeyPatch
):
    """An error outside any one engine's check (a bug in ``check_health``) is logged and
    the next check runs as planned."""
    a = await make_engine()
    async with Router([a.url], config(health_interval=0.02)) as router:
        calls = 0
        real = router.check_health

        async def check_health() -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise KeyError("an engine removed mid-check")
            await real()

        monkeypatch.setattr(router, "check_health", check_health)
        start = time.monotonic()
        while calls < 3:
            assert time.monotonic() - start < 2.0, "the health loop stopped after the error"
            await asyncio.sleep(0.02)
        assert router._health_task is not None and not router._health_task.done()


async def test_killing_an_engine_under_load_fails_no_request(make_engine):
    a, b = await make_engine(), await make_engine()
    async with Router([a.url, b.url], config(health_interval=0.25)) as router:

        async def load(n: int) -> list[str]:
            return [(await router.generate([i], FAST)).engine for i in range(n)]

        workers = [asyncio.create_task(load(50)) for _ in range(8)]
        await asyncio.sleep(0.05)
        await a.kill()
        results = await asyncio.gather(*workers)
    assert sum(len(r) for r in results) == 400  # none failed, none lost


async def test_engines_added_and_removed_at_run_time(make_engine):
    a, b = await make_engine(token_delay=0.01), await make_engine()
    async with Router([a.url], config()) as router:
        slow = asyncio.create_task(router.generate([1], SamplingParams(max_tokens=20)))
        await asyncio.sleep(0.02)
        router.add_engine(b.url)
        await router.remove_engine(a.url)
        assert (await router.generate([2], FAST)).engine == b.url
        assert (await slow).finish_reason == "length"  # in-flight work finished
        with pytest.raises(ValueError, match="already"):
            router.add_engine(b.url)
        with pytest.raises(KeyError):
            await router.remove_engine(a.url)
        await router.remove_engine(b.url)
        with pytest.raises(NoEngineAvailableError, match=r"no engines|tried 0"):
            await router.generate([1], FAST)


async def test_abort_session_through_router(make_engine):
    a = await make_engine(token_delay=0.01)
    async with Router([a.url], config()) as router:
        task = asyncio.create_task(router.generate([1], SamplingParams(max_tokens=1000), "ep"))
        while not a.running:
            await asyncio.sleep(0.01)
        assert await router.abort("ep") == 1
        assert (await task).finish_reason == "abort"


async def test_an_abort_a_stalled_engine_never_confirms_is_bounded_and_escalated(make_engine):
    """The engine stops answering (its API server starved): the router's abort raises at
    its deadline, the generation ends as an abort with its tokens, the engine's circuit
    opens (a health check or probe brings it back) and the event is counted."""
    a = await make_engine(token_delay=0.01)
    async with Router([a.url], config()) as router:
        task = asyncio.create_task(router.generate([1], SamplingParams(max_tokens=100_000), "ep"))
        while not a.running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        a.stalled = True
        began = time.monotonic()
        with pytest.raises(DrainTimeoutError):
            await router.abort("ep", drain_timeout=0.6)
        assert time.monotonic() - began < 0.6 + 0.5
        gen = await asyncio.wait_for(task, 1.0)
        assert gen.finish_reason == "abort" and gen.token_ids
        state = router.engine(a.url)
        assert state.circuit == "open" and state.client.abort_escalations == 1
        assert router.metrics()[a.url]["abort_escalations_total"] == 1
        a.stalled = False
        await asyncio.sleep(0.25)  # the cooldown: the health check closes it again
        await router.check_health()
        assert state.circuit == "closed"


async def test_an_unconfirmed_abort_keeps_the_engine_in_rotation_with_the_breaker_off(
    make_engine,
):
    """``--router-disable-circuit-breaker`` (``failure_threshold`` None): the unconfirmed
    abort is counted, and the engine is not taken out of rotation."""
    a = await make_engine(token_delay=0.01)
    async with Router([a.url], config(failure_threshold=None)) as router:
        task = asyncio.create_task(router.generate([1], SamplingParams(max_tokens=100_000), "ep"))
        while not a.running:
            await asyncio.sleep(0.01)
        a.stalled = True
        with pytest.raises(DrainTimeoutError):
            await router.abort("ep", drain_timeout=0.3)
        await asyncio.wait_for(task, 1.0)
        state = router.engine(a.url)
        assert state.circuit == "closed" and state.abort_escalations_total == 1
        assert "abort not confirmed" in state.last_error


async def test_metrics_count_requests_errors_and_tokens(make_engine):
    a, bad = await make_engine(), await make_engine(fail_status=500)
    async with Router([a.url, bad.url], config()) as router:
        for i in range(3):
            await router.generate([i], FAST)
        m = router.metrics()
        text = router.prometheus()
    assert m[a.url]["requests_total"] == 3 and m[a.url]["tokens_total"] == 9
    assert m[bad.url]["errors_total"] >= 1 and m[a.url]["latency_p50_s"] > 0
    assert f'turnrl_router_engine_tokens_total{{engine="{a.url}"}} 9' in text


async def test_busy_seconds_count_overlapping_requests_once_and_not_idle_gaps(make_engine):
    a = await make_engine(token_delay=0.05)
    async with Router([a.url], config()) as router:
        assert router.busy_seconds() == {a.url: 0.0}
        slow = SamplingParams(max_tokens=10)  # about 0.5 s per request
        await asyncio.gather(*(router.generate([i], slow) for i in range(3)))  # counted once
        await asyncio.sleep(0.3)  # idle: not counted
        busy = router.busy_seconds()
        m = router.metrics()
    assert 0.4 < busy[a.url] < 0.9, busy  # ~0.5 s of overlapping requests, not 1.5 s + 0.3 s
    assert m[a.url]["busy_s"] == pytest.approx(busy[a.url])


async def test_unreachable_only_engine_gives_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    async with Router([url], config(max_attempts=2)) as router:
        with pytest.raises(NoEngineAvailableError, match=r"before any token|tried"):
            await router.generate([1], FAST)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="max_concurrency_per_engine"):
        RouterConfig(max_concurrency_per_engine=0)
    with pytest.raises(ValueError, match="sticky_ttl"):
        RouterConfig(sticky_ttl=0)
    with pytest.raises(ValueError, match="health_interval"):
        RouterConfig(health_interval=-1)


async def test_probe_answered_with_4xx_closes_the_circuit(make_engine):
    a = await make_engine(fail_status=500)
    async with Router([a.url], config(failure_threshold=1, open_cooldown=0.1)) as router:
        with pytest.raises(NoEngineAvailableError):
            await router.generate([1], FAST)
        a.fail_status = 400  # the engine is back; this request is simply bad
        await asyncio.sleep(0.12)
        with pytest.raises(EngineRequestError):
            await router.generate([1], FAST)
        state = router.engine(a.url)
        assert state.circuit == "closed" and not state.probing
        a.fail_status = None
        assert (await router.generate([1], FAST)).engine == a.url
