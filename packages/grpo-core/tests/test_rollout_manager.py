"""RolloutManager against fake engines: real HTTP servers on loopback (rollout_router.testing).

The episodes here are one streamed generation through a real :class:`Router` each; the
fake engines produce deterministic tokens with a per-token delay, can be killed like a
crashed process, and report what is running on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from turnrl.grpo_core.loop.rollout_manager import (
    EpisodeFailedError,
    Rollout,
    RolloutManager,
    RolloutManagerConfig,
    RolloutTimeoutError,
    engine_failed,
    keep_rewards,
)
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import SamplingParams
from turnrl.rollout_router.router import Router, RouterConfig
from turnrl.rollout_router.testing import FakeEngine, fake_engine_processes

pytestmark = pytest.mark.timeout(60)


@dataclass
class Traj:
    """A minimal trajectory: the fields the manager and the loop look at."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    status: str = "completed"
    reward: float = 0.0
    group_id: str | None = None
    engine: str = ""
    session_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def make_episode(
    router: Router, tokens: Callable[[int], int], *, report_errors: bool = False
) -> Callable[[int, int, str, str], Awaitable[Traj]]:
    """One generation per episode; ``tokens(prompt)`` is the response length.

    With ``report_errors`` engine errors come back as a ``failed`` sample, the way
    ``turnrl.tool_envs.rollout`` reports them, instead of raising.
    """

    async def episode(prompt: int, index: int, group_id: str, session_id: str) -> Traj:
        ids = [prompt + 1, index + 1]
        try:
            gen = await router.generate(ids, SamplingParams(max_tokens=tokens(prompt)), session_id)
        except Exception as exc:
            if not report_errors:
                raise
            return Traj(
                ids,
                [],
                [],
                [],
                status="failed",
                group_id=group_id,
                metadata={"error": f"{type(exc).__name__}: {exc}"},
            )
        status = "aborted" if gen.finish_reason == "abort" else "completed"
        return Traj(
            ids,
            gen.token_ids,
            [1] * len(gen.token_ids),
            gen.logprobs,
            status=status,
            group_id=group_id,
            engine=gen.engine,
            session_id=session_id,
        )

    return episode


def varying_when(rule: Callable[[int], bool]) -> Callable[[list[Traj]], Awaitable[list[float]]]:
    """Reward: sample index parity for prompts where ``rule(prompt)``, else constant 1."""

    async def reward(samples: list[Traj]) -> list[float]:
        prompt = samples[0].prompt_ids[0] - 1
        if rule(prompt):
            return [float(s.prompt_ids[1] % 2) for s in samples]
        return [1.0] * len(samples)

    return reward


def counter_source(start: int) -> Callable[[int], list[int]]:
    state = {"next": start}

    def source(count: int) -> list[int]:
        out = list(range(state["next"], state["next"] + count))
        state["next"] += count
        return out

    return source


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    started = [await FakeEngine(token_delay=0.005, name=f"e{i}").start() for i in range(2)]
    yield started
    for engine in started:
        await engine.kill()


@pytest.fixture
async def router(engines: list[FakeEngine]) -> AsyncIterator[Router]:
    config = RouterConfig(max_concurrency_per_engine=16, health_interval=0.1, open_cooldown=5.0)
    async with Router([e.url for e in engines], config) as r:
        yield r


async def test_groups_in_prompt_order_with_rewards_set(router: Router):
    manager = RolloutManager(
        make_episode(router, lambda p: 5), varying_when(lambda p: True), router
    )
    samples = await manager.generate([10, 20, 30], 4)
    assert [s.prompt_ids[0] - 1 for s in samples] == [10] * 4 + [20] * 4 + [30] * 4
    assert [s.reward for s in samples[:4]] == [1.0, 0.0, 1.0, 0.0]
    assert len({s.group_id for s in samples}) == 3 and all(
        len(s.response_ids) == 5 for s in samples
    )
    assert await keep_rewards(samples) == [s.reward for s in samples]
    m = manager.metrics
    assert m["rollout/groups_kept"] == 3 and m["rollout/groups_submitted"] == 3
    assert m["rollout/episode_retries"] == 0 and m["rollout/aborted_episodes"] == 0
    assert m["rollout/groups_uniform"] == 0  # every group's rewards vary
    assert isinstance(samples, Rollout) and samples.metrics == m  # what the loop logs
    second = await manager.generate([10], 2)  # group ids stay unique across steps
    assert not {s.group_id for s in second} & {s.group_id for s in samples}
    manager.reward = varying_when(lambda p: False)  # no filter: uniform groups counted, kept
    await manager.generate([10, 20], 2)
    assert manager.metrics["rollout/groups_uniform"] == manager.metrics["rollout/groups_kept"] == 2


async def test_concurrency_bound_counts_in_flight_on_the_engines(engines, router: Router):
    peaks = {e.url: 0 for e in engines}
    total_peak = 0

    async def watch() -> None:
        nonlocal total_peak
        while True:
            for e in engines:
                peaks[e.url] = max(peaks[e.url], len(e.running))
            total_peak = max(total_peak, sum(len(e.running) for e in engines))
            await asyncio.sleep(0.001)

    config = RolloutManagerConfig(max_concurrency_per_engine=3)
    manager = RolloutManager(
        make_episode(router, lambda p: 20), varying_when(lambda p: True), router, config
    )
    watcher = asyncio.create_task(watch())
    try:
        samples = await manager.generate(list(range(8)), 3)
    finally:
        watcher.cancel()
    assert len(samples) == 24
    # The router itself would allow 16 per engine: the manager's bound is what holds.
    assert 4 <= total_peak <= 6, peaks  # the bound holds (and is nearly reached)
    assert all(1 <= p <= 3 for p in peaks.values()), peaks
    total = RolloutManager(
        make_episode(router, lambda p: 20),
        varying_when(lambda p: True),
        router,
        RolloutManagerConfig(max_concurrency=1),
    )
    peaks = {e.url: 0 for e in engines}
    total_peak = 0
    watcher = asyncio.create_task(watch())
    try:
        await total.generate([1, 2], 2)
    finally:
        watcher.cancel()
    assert total_peak == 1


async def test_dynamic_filter_oversamples_to_exactly_the_target(router: Router):
    source = counter_source(100)
    config = RolloutManagerConfig(dynamic_filter=True, over_sampling_batch_size=4)
    # Only prompts divisible by 3 give varying rewards: most groups are filtered out.
    manager = RolloutManager(
        make_episode(router, lambda p: 3),
        varying_when(lambda p: p % 3 == 0),
        router,
        config,
        prompt_source=source,
    )
    samples = await manager.generate([0, 1, 2], 2)
    groups: dict[str, list[Traj]] = {}
    for s in samples:
        groups.setdefault(str(s.group_id), []).append(s)
    assert len(groups) == 3 and all(len(g) == 2 for g in groups.values())
    for g in groups.values():
        assert len({s.reward for s in g}) > 1  # non-zero reward std
        assert (g[0].prompt_ids[0] - 1) % 3 == 0
    m = manager.metrics
    assert m["rollout/groups_kept"] == 3
    assert m["rollout/groups_filtered"] >= 3  # 1, 2 and the non-multiples of 3 drawn
    assert m["rollout/groups_uniform"] == m["rollout/groups_filtered"]
    assert m["rollout/sampling_rounds"] >= 2
    assert (
        m["rollout/groups_generated"]
        == m["rollout/groups_kept"] + m["rollout/groups_filtered"] + m["rollout/groups_surplus"]
    )


async def test_filter_gives_up_with_a_clear_error_when_rewards_never_vary(router: Router):
    config = RolloutManagerConfig(dynamic_filter=True, max_sampling_rounds=3)
    manager = RolloutManager(
        make_episode(router, lambda p: 2),
        varying_when(lambda p: False),
        router,
        config,
        prompt_source=counter_source(0),
    )
    with pytest.raises(RuntimeError, match="kept 0 of 2 groups after 3 sampling rounds"):
        await manager.generate([0, 1], 2)


async def test_an_exhausted_filter_can_train_on_what_it_found(router: Router):
    """DAPO as the retool app runs it: the filter compares a per-sample value other than the
    reward, and after its rounds a step trains on the groups that vary (or, with none, on
    the first groups drawn) instead of failing."""
    config = RolloutManagerConfig(
        dynamic_filter=True, max_sampling_rounds=2, train_when_exhausted=True
    )
    # The reward varies in every group; the filter value (prompt 7 only) almost never does.
    manager = RolloutManager(
        make_episode(router, lambda p: 2),
        varying_when(lambda p: True),
        router,
        config,
        prompt_source=counter_source(6),
        filter_value=lambda s: float(s.prompt_ids[0] - 1 == 7 and s.prompt_ids[1] == 1),
    )
    samples = await manager.generate([0, 1, 2], 2)  # rounds: 0-2, then 6-8
    assert [s.prompt_ids[0] - 1 for s in samples] == [7, 7]
    m = manager.metrics
    assert m["rollout/filter_exhausted"] == 1.0 and m["rollout/groups_kept"] == 1
    assert m["rollout/sampling_rounds"] == 2 and m["rollout/groups_filtered"] == 5
    manager.filter_value = lambda s: 0.0  # nothing varies: the first groups, not an error
    samples = await manager.generate([0, 1], 2)
    assert len(samples) == 4 and manager.metrics["rollout/groups_kept"] == 0
    assert [s.prompt_ids[0] - 1 for s in samples] == [0, 0, 1, 1]
    manager.filter_value = lambda s: float(s.reward)  # enough vary: not exhausted
    await manager.generate([0, 1], 2)
    assert manager.metrics["rollout/filter_exhausted"] == 0.0


def _leftover_manager(
    router: Router, config: RolloutManagerConfig
) -> tuple[RolloutManager, list[int]]:
    """Even prompts finish in 10 tokens, odd ones would stream 5000 (25 s): leftovers. The
    list holds the prompt of every group that was scored."""
    scored: list[int] = []
    score = varying_when(lambda p: True)

    async def reward(samples: list[Traj]) -> list[float]:
        scored.append(samples[0].prompt_ids[0] - 1)
        return await score(samples)

    manager = RolloutManager(
        make_episode(router, lambda p: 10 if p % 2 == 0 else 5000),
        reward,
        router,
        config,
        prompt_source=counter_source(100),
    )
    return manager, scored


async def test_leftovers_are_aborted_and_drained(engines, router: Router):
    config = RolloutManagerConfig(over_sampling_batch_size=8, drain_timeout=5.0)
    manager, scored = _leftover_manager(router, config)
    start = time.monotonic()
    samples = await manager.generate([0, 1, 2, 3], 2)
    assert time.monotonic() - start < 10.0
    assert all(engine.running == {} for engine in engines)  # the engines confirm the drain
    assert all(s.status == "completed" and len(s.response_ids) == 10 for s in samples)
    assert [s.prompt_ids[0] - 1 for s in samples[::2]] == [0, 2, 100, 102]
    m = manager.metrics
    assert m["rollout/aborted_episodes"] == 8  # 4 slow groups x 2 samples, mid-stream
    assert m["rollout/groups_leftover"] == 4 and m["rollout/undrained_aborts"] == 0
    aborted = {rid for e in engines for rid in e.aborted}
    assert len(aborted) == 8
    assert sorted(scored) == [0, 2, 100, 102]  # aborted leftovers are never scored


async def test_an_abort_the_engines_ignore_is_counted_and_bounded(engines, router: Router):
    """Engines that swallow every abort: after its drain timeout the step returns what
    completed, counts each leftover request as undrained, scores none of them, and the
    client's last resort (closing the streams) leaves nothing running on the engines."""
    for engine in engines:
        engine.ignore_aborts = 1000
    config = RolloutManagerConfig(over_sampling_batch_size=8, drain_timeout=1.0)
    manager, scored = _leftover_manager(router, config)
    start = time.monotonic()
    samples = await manager.generate([0, 1, 2, 3], 2)
    assert time.monotonic() - start < 10.0
    assert all(s.status == "completed" and len(s.response_ids) == 10 for s in samples)
    m = manager.metrics
    assert m["rollout/groups_leftover"] == 4 and m["rollout/undrained_aborts"] == 8
    assert sorted(scored) == [0, 2, 100, 102]  # the undrained leftovers are never scored
    deadline = time.monotonic() + 5
    while any(engine.running for engine in engines) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert all(engine.running == {} for engine in engines)  # the closed streams ended them


@pytest.mark.parametrize("report_errors", [False, True], ids=["raises", "failed-status"])
async def test_engine_killed_mid_rollout_step_completes_on_the_other(
    engines: list[FakeEngine], router: Router, report_errors: bool
):
    survivor, victim = engines
    config = RolloutManagerConfig(max_retries=3, retry_backoff=0.05)
    manager = RolloutManager(
        make_episode(router, lambda p: 200, report_errors=report_errors),
        varying_when(lambda p: True),
        router,
        config,
    )
    step = asyncio.create_task(manager.generate(list(range(4)), 2))
    while sum(router.engine(victim.url).client.in_flight_tokens().values()) < 20:
        assert not step.done()
        await asyncio.sleep(0.005)
    on_victim = len(router.engine(victim.url).client.in_flight())
    await victim.kill()
    samples = await asyncio.wait_for(step, 30)
    assert len(samples) == 8
    assert all(s.status == "completed" and len(s.response_ids) == 200 for s in samples)
    assert all(s.engine == survivor.url for s in samples)  # none finished before the kill
    retried = [s for s in samples if not s.session_id.endswith("-a0")]
    assert len(retried) == on_victim > 0
    assert manager.metrics["rollout/episode_retries"] >= on_victim


@contextlib.asynccontextmanager
async def _hang_router(procs: list[Any], read_timeout: float) -> AsyncIterator[Router]:
    """A router over healthy fake engine processes, quick to see one hang (``read_timeout``)."""

    def client(url: str) -> EngineClient:
        return EngineClient(url, connect_timeout=1.0, read_timeout=read_timeout)

    for _, url in procs:
        async with client(url) as c:
            while not await c.health(timeout=1.0):
                await asyncio.sleep(0.1)
    config = RouterConfig(health_interval=0.2, health_timeout=0.5, failure_threshold=1)
    async with Router([url for _, url in procs], config, client_factory=client) as router:
        yield router


@pytest.mark.parametrize("report_errors", [False, True], ids=["raises", "failed-status"])
async def test_a_hung_engine_times_out_and_its_episodes_rerun_on_the_other(report_errors: bool):
    """A real engine process stopped mid-rollout (SIGSTOP: its port accepts, it answers
    nothing): the streams on it fail after the client's read timeout, their episodes re-run
    on the other engine, and the step completes with every sample from the survivor."""
    read_timeout = 1.0
    with fake_engine_processes(2, token_delay=0.005) as procs:
        (_, survivor), (victim, victim_url) = procs
        async with _hang_router(procs, read_timeout) as router:
            manager = RolloutManager(
                make_episode(router, lambda p: 200, report_errors=report_errors),
                varying_when(lambda p: True),
                router,
                RolloutManagerConfig(max_retries=3, retry_backoff=0.05),
            )
            step = asyncio.create_task(manager.generate(list(range(4)), 2))
            while sum(router.engine(victim_url).client.in_flight_tokens().values()) < 20:
                assert not step.done()
                await asyncio.sleep(0.005)
            on_victim = len(router.engine(victim_url).client.in_flight())
            os.kill(victim.pid, signal.SIGSTOP)
            began = time.monotonic()
            samples = await asyncio.wait_for(step, 30)
            waited = time.monotonic() - began
    assert len(samples) == 8
    assert all(s.status == "completed" and len(s.response_ids) == 200 for s in samples)
    assert all(s.engine == survivor for s in samples)
    retried = [s for s in samples if not s.session_id.endswith("-a0")]
    assert len(retried) == on_victim > 0
    assert manager.metrics["rollout/episode_retries"] >= on_victim
    assert waited < read_timeout + 10  # the hang cost one read timeout, then the re-runs


async def test_all_engines_dead_is_a_clear_error_not_a_hang(engines, router: Router):
    config = RolloutManagerConfig(max_retries=2, retry_backoff=0.05)
    manager = RolloutManager(
        make_episode(router, lambda p: 50), varying_when(lambda p: True), router, config
    )
    step = asyncio.create_task(manager.generate([0, 1], 2))
    await asyncio.sleep(0.05)
    for engine in engines:
        await engine.kill()
    start = time.monotonic()
    with pytest.raises(EpisodeFailedError, match="failed on its engine 3 times"):
        await asyncio.wait_for(step, 20)
    assert time.monotonic() - start < 10.0


async def test_step_timeout_aborts_and_raises(engines, router: Router):
    config = RolloutManagerConfig(step_timeout=0.5)
    manager = RolloutManager(
        make_episode(router, lambda p: 5000), varying_when(lambda p: True), router, config
    )
    with pytest.raises(RolloutTimeoutError, match=r"kept 0 of 1 groups in 0\.5s"):
        await manager.generate([0], 2)
    assert all(engine.running == {} for engine in engines)
    assert manager.metrics["rollout/aborted_episodes"] == 2


def test_engine_failed_reads_status_and_error():
    assert engine_failed(Traj([1], [], [], [], status="aborted"))
    assert not engine_failed(Traj([1], [], [], [], status="completed"))
    assert not engine_failed(Traj([1], [], [], [], status="truncated"))
    failed = Traj([1], [], [], [], status="failed", metadata={"error": "PartialGenerationError: x"})
    assert engine_failed(failed)
    env_bug = Traj([1], [], [], [], status="failed", metadata={"error": "KeyError: 'user'"})
    assert not engine_failed(env_bug)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"over_sampling_batch_size": 0}, "over_sampling_batch_size must be >= 1"),
        ({"max_concurrency": 0}, "max_concurrency must be >= 1"),
        ({"max_concurrency_per_engine": 0}, "max_concurrency_per_engine must be >= 1"),
        ({"max_sampling_rounds": 0}, "max_sampling_rounds must be >= 1"),
        ({"max_retries": -1}, "max_retries must be >= 0"),
        ({"retry_backoff": -1.0}, "retry_backoff must be >= 0"),
        ({"drain_timeout": 0.0}, "drain_timeout must be > 0"),
        ({"step_timeout": 0.0}, "step_timeout must be > 0"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        RolloutManagerConfig(**kwargs)


async def test_bad_calls_are_rejected(router: Router):
    episode, reward = make_episode(router, lambda p: 2), varying_when(lambda p: True)
    manager = RolloutManager(episode, reward, router)
    with pytest.raises(ValueError, match="at least one prompt"):
        await manager.generate([], 2)
    with pytest.raises(ValueError, match=r"n \(samples per prompt\) must be >= 1"):
        await manager.generate([1], 0)
    filtered = RolloutManager(episode, reward, router, RolloutManagerConfig(dynamic_filter=True))
    with pytest.raises(ValueError, match="needs n >= 2"):
        await filtered.generate([1], 1)
    oversample = RolloutManager(
        episode, reward, router, RolloutManagerConfig(over_sampling_batch_size=4)
    )
    with pytest.raises(RuntimeError, match="no prompt_source"):
        await oversample.generate([1], 2)

    async def short_reward(samples: list[Traj]) -> list[float]:
        return [1.0]

    with pytest.raises(RuntimeError, match="gave 1 rewards for a group of 2"):
        await RolloutManager(episode, short_reward, router).generate([1], 2)

    async def wrong_group(prompt: int, index: int, group_id: str, session_id: str) -> Traj:
        return Traj([1], [2], [1], [-0.1], group_id="someone-else")

    with pytest.raises(ValueError, match="returned group_id 'someone-else'"):
        await RolloutManager(wrong_group, reward, router).generate([1], 2)


@pytest.mark.slow
async def test_the_loop_trains_through_an_engine_hung_mid_step(tmp_path) -> None:
    """Loop level: ``GRPOLoop`` (the real torch trainer, tiny Qwen3) rolling out through the
    manager while one of two engine processes is stopped mid-step (SIGSTOP; the fake engine
    of ``rollout_router.testing``: deterministic tokens, no model). The episodes held on it
    time out and re-run on the other; both steps complete whole and train; nothing is lost
    but the hung engine's partial tokens."""
    from turnrl.grpo_core.loop import GRPOLoop, LoopConfig
    from turnrl.grpo_core.training.tiny_model import build_tiny_model
    from turnrl.grpo_core.training.torch_engine import (
        OptimizerConfig,
        TorchEngine,
        TorchEngineConfig,
    )

    read_timeout = 1.0
    folder = build_tiny_model(tmp_path / "tiny")
    trainer = TorchEngine(
        TorchEngineConfig(model_path=str(folder), seed=0, optimizer=OptimizerConfig(lr=1e-3))
    )
    held: list[int] = []
    with fake_engine_processes(2, token_delay=0.005) as procs:
        _, (victim, victim_url) = procs
        async with _hang_router(procs, read_timeout) as router:
            manager = RolloutManager(
                make_episode(router, lambda p: 64),
                varying_when(lambda p: True),
                router,
                RolloutManagerConfig(max_retries=3, retry_backoff=0.05),
            )

            async def generate(prompts: list[int], n: int) -> Any:
                step = asyncio.create_task(manager.generate(prompts, n))
                if not held:  # the first step: stop the victim once tokens flow from it
                    on_victim = router.engine(victim_url).client
                    while sum(on_victim.in_flight_tokens().values()) < 20:
                        assert not step.done()
                        await asyncio.sleep(0.005)
                    held.append(len(on_victim.in_flight()))
                    os.kill(victim.pid, signal.SIGSTOP)
                return await step

            loop_config = LoopConfig(
                num_rollout=2,
                rollout_batch_size=2,
                n_samples_per_prompt=4,
                global_batch_size=8,
                seed=0,
            )
            loop = GRPOLoop(
                loop_config,
                trainer,
                list(range(8)),
                generate,
                keep_rewards,
                weight_sync=None,
                pad_id=0,
            )
            began = time.monotonic()
            history = await asyncio.wait_for(loop.run(), 60)
            waited = time.monotonic() - began
    assert len(history) == 2 and held[0] > 0
    assert history[0]["rollout/episode_retries"] >= held[0]
    for step in history:
        assert step["rollout/groups_kept"] == 2 and step["train/skipped"] == 0.0, step
        assert step["rollout/response_len_mean"] == 64  # every sample whole, none cut short
    assert waited < read_timeout + 30
