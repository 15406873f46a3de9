"""Unit tests of the loop's pieces: config, advantages, batching, prompt order, hooks, sync."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from aiohttp import web

from turnrl.grpo_core.loop import (
    LoopConfig,
    PromptIterator,
    build_train_batch,
    load_function,
    sample_advantages,
    split_batch,
)
from turnrl.grpo_core.loop.loop import GRPOLoop, logprob_mismatch
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.weight_sync import DiskWeightSync, WeightSyncError


@dataclass
class S:
    """A minimal sample meeting the loop's Sample protocol."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    group_id: str | None = None

    def __post_init__(self) -> None:
        if not self.rollout_logprobs:
            self.rollout_logprobs = [-0.5 * m for m in self.loss_mask]


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="rollout_batch_size"):
        LoopConfig(rollout_batch_size=0)
    with pytest.raises(ValueError, match="multiple of global_batch_size"):
        LoopConfig(rollout_batch_size=3, n_samples_per_prompt=2, global_batch_size=4)
    with pytest.raises(ValueError, match="advantage_estimator"):
        LoopConfig(advantage_estimator="ppo-gae")
    with pytest.raises(ValueError, match="eval_interval"):
        LoopConfig(eval_interval=-1)
    cfg = LoopConfig(rollout_batch_size=8, n_samples_per_prompt=2, global_batch_size=4)
    assert cfg.samples_per_step == 16 and cfg.updates_per_step == 4


def test_advantages_grpo_and_raw() -> None:
    samples = [
        S([1], [2, 3], [1, 1], reward=r, group_id=g)
        for r, g in [(1.0, "a"), (0.0, "a"), (0.5, "b"), (0.5, "b")]
    ]
    adv = sample_advantages(samples, LoopConfig(rollout_batch_size=2, global_batch_size=4))
    assert adv[0] > 0 > adv[1]
    assert adv[0] == pytest.approx(-adv[1])
    assert adv[2:].abs().max() == 0  # a group with one reward value has nothing to learn
    raw = sample_advantages(
        samples, LoopConfig(rewards_normalization=False, rollout_batch_size=2, global_batch_size=4)
    )
    assert raw.tolist() == [1.0, 0.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="finite"):
        sample_advantages([S([1], [2], [1], reward=float("nan"))], LoopConfig())
    with pytest.raises(ValueError, match="no samples"):
        sample_advantages([], LoopConfig())


def test_build_train_batch_aligns_tokens_and_drops_empty() -> None:
    samples = [
        S([5, 6, 7], [8, 9, 10], [1, 0, 1]),
        S([5, 6], [], []),  # failed before the model spoke: not trained on
        S([4], [3, 2], [1, 1]),
    ]
    batch = build_train_batch(samples, torch.tensor([1.0, 2.0, -1.0]), pad_id=0)
    assert batch is not None
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [4, 3, 2, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    assert batch.advantages is not None and batch.advantages.tolist() == [1.0, -1.0]
    assert batch.rollout_logprobs is not None
    assert batch.rollout_logprobs[0].tolist() == [0, 0, 0, -0.5, 0, -0.5]
    assert build_train_batch([S([1], [], [])], torch.tensor([1.0]), 0) is None
    with pytest.raises(ValueError, match="advantages"):
        build_train_batch(samples, torch.tensor([1.0]), 0)


def test_logprob_mismatch_averages_over_policy_tokens_only() -> None:
    samples = [S([5, 6], [8, 9], [1, 1], [-0.5, -1.0]), S([4], [3, 2], [1, 0], [-2.0, -9.0])]
    batch = build_train_batch(samples, torch.tensor([1.0, -1.0]), pad_id=0)
    assert batch is not None
    assert logprob_mismatch(batch) == {}  # no trainer log-probs yet
    trainer = torch.zeros_like(batch.input_ids, dtype=torch.float32)
    trainer[0, 2:4] = torch.tensor([-0.5, -1.5])  # agrees on one token, 0.5 off on the other
    trainer[1, 1] = -1.0  # 1.0 off; the masked token (-9.0) and the padding do not count
    batch.old_logprobs = trainer
    metrics = logprob_mismatch(batch)
    assert metrics["train/mismatch_abs_diff"] == pytest.approx(0.5)
    assert metrics["train/mismatch_kl_k1"] == pytest.approx((0.0 + 0.5 - 1.0) / 3)
    assert "train/ref_abs_diff" not in metrics  # no reference policy
    batch.ref_logprobs = trainer - 0.25 * batch.loss_mask + 7.0 * (1 - batch.loss_mask)
    # How far the trainer has moved from the reference, over the same policy tokens.
    assert logprob_mismatch(batch)["train/ref_abs_diff"] == pytest.approx(0.25)


def test_split_batch_covers_every_row_once() -> None:
    samples = [S([1, 2], [3] * (i + 1), [1] * (i + 1)) for i in range(5)]
    batch = build_train_batch(samples, torch.arange(5, dtype=torch.float32), 0)
    assert batch is not None
    parts = split_batch(batch, 2)
    assert [p.num_sequences for p in parts] == [2, 3]
    assert torch.cat([p.advantages for p in parts if p.advantages is not None]).tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert len(split_batch(batch, 9)) == 5
    with pytest.raises(ValueError):
        split_batch(batch, 0)


class TwoRankTrainer:
    """Stands in for a trainer group of 2 data-parallel ranks (Ray actors, FSDP2 collectives:
    not here): it records what the loop hands ``train_step`` and trains nothing."""

    dp_size = 2

    def __init__(self) -> None:
        self.steps: list[list[TrainBatch]] = []

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.zeros(batch.input_ids.shape)

    def train_step(self, micro: list[TrainBatch]) -> dict[str, float]:
        self.steps.append(micro)
        return {"loss": 0.0}


def test_packing_that_leaves_a_rank_an_empty_micro_batch_runs_a_zero_mask_filler() -> None:
    """The issue's case: 15 samples of 4,000 tokens under a budget of 6,144 on 2 ranks need 15
    micro-batches, 16 with 8 per rank; the empty one is a filler row with no loss token (it
    used to be selected with an empty float tensor: IndexError)."""
    samples = [
        S([7] * 1000, [i + 1] * 3000, [1] * 3000, reward=float(i % 2), group_id=str(i // 3))
        for i in range(15)
    ]
    config = LoopConfig(
        rollout_batch_size=5,
        n_samples_per_prompt=3,
        global_batch_size=15,
        max_tokens_per_micro_batch=6144,
    )
    trainer = TwoRankTrainer()
    loop = GRPOLoop(config, trainer, [[1]], fake_generate, fake_reward, weight_sync=None, pad_id=0)
    metrics = loop._train(samples)
    assert metrics["train/skipped"] == 0.0 and metrics["train/micro_batches_per_rank"] == 8
    (micro,) = trainer.steps
    assert len(micro) == 16  # the trainer group deals ranks contiguous runs of 8
    fillers = [mb for mb in micro if mb.num_loss_tokens == 0]
    assert len(fillers) == 1 and fillers[0].num_sequences == 1
    assert int(fillers[0].attention_mask.sum()) <= 6144
    real = sorted(int(mb.input_ids[0, -1]) for mb in micro if mb.num_loss_tokens)
    assert real == list(range(1, 16))  # every sample once, each alone
    # The counts the engine normalises by are the batch's: the filler adds none.
    assert sum(mb.num_loss_tokens for mb in micro) == 15 * 3000
    assert sum(int((mb.loss_mask.sum(-1) > 0).sum()) for mb in micro) == 15


async def fake_generate(prompts: list, n: int) -> list:
    raise AssertionError("not called")


async def fake_reward(samples: list) -> list:
    raise AssertionError("not called")


def test_prompt_iterator_epochs_and_shuffle() -> None:
    plain = PromptIterator(["a", "b", "c"], shuffle=False, seed=0)
    assert plain.next(4) == ["a", "b", "c", "a"] and plain.epoch == 1
    shuffled = PromptIterator(list(range(20)), shuffle=True, seed=3)
    first = shuffled.next(20)
    assert sorted(first) == list(range(20)) and first != list(range(20))
    assert PromptIterator(list(range(20)), shuffle=True, seed=3).next(20) == first
    with pytest.raises(ValueError):
        PromptIterator([], shuffle=False, seed=0)


def test_load_function() -> None:
    assert load_function("os.path.join") is __import__("os").path.join
    assert load_function("os.path:join") is __import__("os").path.join
    with pytest.raises(ValueError, match="dotted path"):
        load_function("join")
    with pytest.raises(ModuleNotFoundError):
        load_function("no_such_module_xyz.f")
    with pytest.raises(ValueError, match="not a function"):
        load_function("os.sep")


class _Exporter:
    """Writes a safetensors file where export_hf would (the trainer side of the sync)."""

    def __init__(self) -> None:
        self.folders: list[Path] = []

    def export_hf(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        self.folders.append(folder)
        return folder


class _WeightRoutes:
    """vLLM's weight-reload routes on loopback (test stand-in for an engine: real HTTP)."""

    def __init__(self) -> None:
        self.reloads: list[str] = []
        self.version: str | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> _WeightRoutes:
        app = web.Application()
        app.router.add_post("/collective_rpc", self._rpc)
        app.router.add_post("/reset_prefix_cache", self._ok)
        app.router.add_post("/update_weight_version", self._version)
        app.router.add_get("/weight_info", self._info)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.reloads.append(body["kwargs"]["weights_path"])
        return web.json_response({"ok": True})

    async def _ok(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _version(self, request: web.Request) -> web.Response:
        self.version = (await request.json())["new_version"]
        return web.json_response({"ok": True})

    async def _info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})


async def test_disk_weight_sync_against_loopback_engines(tmp_path: Path) -> None:
    """Two loopback stand-ins for vLLM's reload routes; the sync talks real HTTP to them."""
    engines = [await _WeightRoutes().start(), await _WeightRoutes().start()]
    try:
        sync = DiskWeightSync([e.url for e in engines], tmp_path, keep_last=1)
        trainer = _Exporter()
        metrics = await sync.sync(trainer, 1)
        assert metrics["total_s"] >= metrics["export_s"] >= 0
        await sync.sync(trainer, 2)
        for engine in engines:
            assert engine.version == "2"
            assert engine.reloads == [str(tmp_path / "v1"), str(tmp_path / "v2")]
        assert not (tmp_path / "v1").exists() and (tmp_path / "v2").is_dir()
        with pytest.raises(ValueError, match="increase"):
            await sync.sync(trainer, 2)
        # An engine that cannot be reached leaves the run; the others still get the version.
        lost: list[str] = []

        async def on_lost(url: str) -> None:
            lost.append(url)

        dead = "http://127.0.0.1:1"
        partial = DiskWeightSync([dead, engines[0].url], tmp_path / "b", on_engine_lost=on_lost)
        assert (await partial.sync(trainer, 3))["engines"] == 1.0
        assert lost == partial.lost == [dead] and partial.engine_urls == [engines[0].url]
        assert engines[0].version == "3" and engines[1].version == "2"
        assert (await partial.sync(trainer, 4))["engines"] == 1.0  # not asked again
        assert lost == [dead] and engines[0].version == "4"
        # Started again (the same engine here), it rejoins at the next sync, once it serves
        # that version; a rejoining engine that still cannot be reached is lost again.
        back: list[str] = []

        async def on_back(url: str) -> None:
            back.append(url)

        partial.on_engine_back = on_back
        partial.rejoin(engines[1].url)
        partial.rejoin(dead)
        assert (await partial.sync(trainer, 5))["engines"] == 2.0
        assert back == [engines[1].url] and engines[1].version == "5"
        assert partial.engine_urls == [engines[0].url, engines[1].url]
        assert lost == [dead, dead] and partial.joining == []
        alone = DiskWeightSync([dead], tmp_path / "c")
        with pytest.raises(WeightSyncError, match=r"no engine took weight version 1: all 1 "):
            await alone.sync(trainer, 1)
    finally:
        for engine in engines:
            await engine.stop()
    with pytest.raises(ValueError, match="at least one"):
        DiskWeightSync([], tmp_path)


class _StaleVersion(_WeightRoutes):
    """An engine that reloads but keeps reporting its old weight version."""

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


async def test_disk_weight_sync_refuses_an_unconfirmed_version(tmp_path: Path) -> None:
    engine = await _StaleVersion().start()
    try:
        with pytest.raises(WeightSyncError, match="serves weight version None"):
            await DiskWeightSync([engine.url], tmp_path).sync(_Exporter(), 1)
        assert engine.reloads == [str(tmp_path / "v1")]
    finally:
        await engine.stop()


class _SlowReload(_WeightRoutes):
    """An engine whose reload takes ``seconds`` (a hung one: far longer than any timeout)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.released = asyncio.Event()  # set by stop: no reload outlives the test

    async def _rpc(self, request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.released.wait(), self.seconds)
        return await super()._rpc(request)

    async def stop(self) -> None:
        self.released.set()
        await super().stop()


async def test_disk_weight_sync_reloads_engines_at_once_and_drops_a_hung_one(
    tmp_path: Path,
) -> None:
    """The engines reload together (a sync costs the slowest, not the sum), and one that does
    not answer its reload within ``reload_timeout`` leaves the run like a dead one."""
    slow = [await _SlowReload(2.0).start(), await _SlowReload(2.0).start()]
    hung = await _SlowReload(3600.0).start()
    lost: list[str] = []

    async def on_lost(url: str) -> None:
        lost.append(url)

    try:
        sync = DiskWeightSync([e.url for e in slow], tmp_path / "a")
        started = time.monotonic()
        await sync.sync(_Exporter(), 1)
        assert time.monotonic() - started < 3.5  # one after the other: 4 s
        assert [e.version for e in slow] == ["1", "1"]
        urls = [hung.url, slow[0].url]
        sync = DiskWeightSync(urls, tmp_path / "b", reload_timeout=3.0, on_engine_lost=on_lost)
        started = time.monotonic()
        assert (await sync.sync(_Exporter(), 2))["engines"] == 1.0
        assert time.monotonic() - started < 30  # not the default 600 s
        assert lost == [hung.url] and sync.engine_urls == [slow[0].url]
        assert slow[0].version == "2" and hung.version is None
    finally:
        for engine in [*slow, hung]:
            await engine.stop()
    with pytest.raises(ValueError, match="reload_timeout must be > 0"):
        DiskWeightSync(["http://127.0.0.1:1"], tmp_path, reload_timeout=0)


class _DeadEngine:
    """An engine whose port nothing serves until :meth:`restart` (as ``Fleet.restart``, from
    the heal's worker thread: blocks until it serves) starts a :class:`_WeightRoutes` on
    it; each restart raises the first of ``fail`` instead, when set."""

    def __init__(self) -> None:
        from turnrl.npu_runtime.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served: list[_WeightRoutes] = []
        self.fail: list[str] = []
        self._loop = asyncio.get_running_loop()

    def restart(self, engine: str) -> None:
        assert engine == self.url
        if self.fail:
            raise RuntimeError(self.fail[0])
        started = asyncio.run_coroutine_threadsafe(_WeightRoutes().start(self.port), self._loop)
        self.served.append(started.result(timeout=10))

    async def stop(self) -> None:
        for engine in self.served:
            await engine.stop()


async def test_a_sync_that_reaches_no_engine_waits_for_them_to_start_again(
    tmp_path: Path,
) -> None:
    """The only engine is gone at a sync (the CPU default has one): the driver's heal
    starts it again in place (here: a stand-in on the same port, started from the
    restart's worker thread) while the sync waits, and it gets that sync's version without
    leaving the router; past its restarts, or when the restart fails, the sync fails."""
    import io

    from rich.console import Console

    from turnrl.grpo_core.recipe.driver import MAX_ENGINE_RESTARTS, heal_engines
    from turnrl.rollout_router.router import Router

    dead = _DeadEngine()
    url, port, served, fail, restart = dead.url, dead.port, dead.served, dead.fail, dead.restart
    out = io.StringIO()
    sync = DiskWeightSync([url], tmp_path)
    async with Router([url]) as router:
        heal_engines(Console(file=out, width=200), sync, router, restart, tmp_path)
        try:
            assert (await sync.sync(_Exporter(), 1))["engines"] == 1.0
            assert served[0].version == "1" and sync.engine_urls == [url] and sync.lost == []
            assert list(router.metrics()) == [url]  # it never left the router
            said = out.getvalue()
            assert f"no engine took the weights: starting {url} again" in said
            assert "(restart 1); the run waits for it" in said
            for version in range(2, MAX_ENGINE_RESTARTS + 1):  # killed again after each sync
                await served.pop().stop()
                assert (await sync.sync(_Exporter(), version))["engines"] == 1.0
            await served.pop().stop()
            last = MAX_ENGINE_RESTARTS + 1  # its restarts are spent
            with pytest.raises(WeightSyncError, match=rf"weight version {last}: all 1 .*{port}"):
                await sync.sync(_Exporter(), last)
        finally:
            await dead.stop()
    # A restart that fails: the sync fails, naming the engine; the reason is printed.
    fail.append("port taken")
    sync = DiskWeightSync([url], tmp_path / "b")
    async with Router([url]) as router:
        heal_engines(Console(file=out, width=200), sync, router, restart, tmp_path)
        with pytest.raises(
            WeightSyncError, match=f"no engine took weight version 1: all 1 unreachable \\({url}\\)"
        ):
            await sync.sync(_Exporter(), 1)
    assert f"engine {url} did not start again: port taken" in out.getvalue()


async def test_a_rollout_that_failed_with_every_engine_down_runs_again_once_one_is_back(
    tmp_path: Path,
) -> None:
    """The only engine dies mid-rollout: its episodes' re-runs are spent and the rollout
    raises ``EpisodeFailedError``. The RL stage's wrapper of the generate hook finds the
    engine dead (its health check), starts it again in place (a stand-in on its port)
    while the run waits, gives it the weights it served (the SFT policy as version 0
    before any sync, the last synced version after) and runs the rollout again; when the
    engine cannot be started again, the rollout's own error is raised."""
    import io

    from rich.console import Console

    from turnrl.grpo_core.loop.rollout_manager import EpisodeFailedError
    from turnrl.grpo_core.recipe.driver import _rerun_after, heal_engines
    from turnrl.rollout_router.router import Router

    dead = _DeadEngine()
    url, served, fail, restart = dead.url, dead.served, dead.fail, dead.restart
    calls: list[int] = []

    async def generate(prompts: list[str], n: int) -> list[str]:
        calls.append(n)
        if len(calls) % 2:  # every other call: the engine was down
            raise EpisodeFailedError("episode 0 of group g failed on its engine 3 times")
        return [p * n for p in prompts]

    out, policy = io.StringIO(), tmp_path / "sft"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"")  # the engine stand-in reads nothing
    sync = DiskWeightSync([url], tmp_path / "weights")
    async with Router([url]) as router:
        console = Console(file=out, width=200)
        rollout = _rerun_after(
            heal_engines(console, sync, router, restart, policy), generate, console
        )
        try:
            assert await rollout(["a"], 2) == ["aa"] and calls == [2, 2]
            assert served[0].reloads == [str(policy)] and served[0].version == "0"
            said = out.getvalue()
            assert f"the rollout failed with this engine down: starting {url} again" in said
            assert "running it again" in said
            await sync.sync(_Exporter(), 1)
            await served.pop().stop()  # dies after the sync of version 1
            assert await rollout(["b"], 1) == ["b"]
            assert served[0].reloads == [str(tmp_path / "weights" / "v1")]
            assert served[0].version == "1" and sync.engine_urls == [url]
            await served.pop().stop()
            fail.append("no free port")
            with pytest.raises(EpisodeFailedError, match="failed on its engine 3 times"):
                await rollout(["c"], 1)
            assert f"engine {url} did not start again: no free port" in out.getvalue()
        finally:
            await dead.stop()


async def test_an_evaluation_whose_only_engine_died_reruns_its_episodes_once_it_is_back(
    tmp_path: Path,
) -> None:
    """The only engine dies during an evaluation: with the run's engine recovery set (as
    ``recipe.stages`` sets it while the engines serve), ``rerun_engine_failures`` first
    starts the engine again in place with the weights it served (the policy as version 0
    before RL), then re-runs the episodes its death failed; when it cannot be started
    again, or the recovery itself fails, no re-run is tried and the episodes stay failed
    (counted, not scored); while another engine serves, nothing is restarted."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from turnrl.grpo_core.recipe.driver import heal_engines
    from turnrl.grpo_core.recipe.evaluation import engine_recovery, rerun_engine_failures
    from turnrl.grpo_core.recipe.stages import _for_evaluations
    from turnrl.rollout_router.client import EngineClient
    from turnrl.rollout_router.router import Router

    def episode(status: str, error: str = "") -> SimpleNamespace:
        return SimpleNamespace(status=status, metadata={"error": error})

    async def rerun(i: int) -> SimpleNamespace:  # served only while the engine answers
        async with EngineClient(dead.url) as client:
            up = await client.health(2.0)
        return episode("completed") if up else episode("failed", "EngineUnavailableError: x")

    async def served_elsewhere(i: int) -> SimpleNamespace:
        return episode("completed")

    dead, out, policy = _DeadEngine(), io.StringIO(), tmp_path / "sft"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"")  # the engine stand-in reads nothing
    first = [episode("failed", "EngineUnavailableError: refused"), episode("completed")]
    sync = DiskWeightSync([dead.url], tmp_path / "weights")
    async with Router([dead.url]) as router:
        console, restarts = Console(file=out, width=200), {dead.url: 1}  # one in RL, say
        recover = heal_engines(console, sync, router, dead.restart, policy, restarts)
        token = engine_recovery.set(_for_evaluations(recover))
        try:
            done, reruns = await rerun_engine_failures(first, rerun, backoff=0.0)
            assert [e.status for e in done] == ["completed", "completed"] and reruns == 1
            assert dead.served[0].reloads == [str(policy)] and dead.served[0].version == "0"
            said = f"the evaluation failed with this engine down: starting {dead.url} again"
            assert f"{said} (restart 2)" in out.getvalue() and restarts == {dead.url: 2}
            await dead.served.pop().stop()
            dead.fail.append("no free port")
            done, reruns = await rerun_engine_failures(first, rerun, backoff=0.0)
            assert done[0].status == "failed" and reruns == 0
            assert f"engine {dead.url} did not start again: no free port" in out.getvalue()

            async def broken() -> bool:
                raise RuntimeError("engine reports weight version 3, not 2")

            engine_recovery.set(broken)  # a recovery that fails: the episodes stay failed
            done, reruns = await rerun_engine_failures(first, rerun, backoff=0.0)
            assert done[0].status == "failed" and reruns == 0
        finally:
            engine_recovery.reset(token)
            await dead.stop()
    # Another engine serves: nothing is restarted while the re-runs go to it.
    alive, dead = await _WeightRoutes().start(), _DeadEngine()
    sync = DiskWeightSync([alive.url, dead.url], tmp_path / "weights2")
    async with Router([alive.url, dead.url]) as router:
        recover = heal_engines(console, sync, router, dead.restart, policy, {})
        token = engine_recovery.set(_for_evaluations(recover))
        try:
            done, reruns = await rerun_engine_failures(first, served_elsewhere, backoff=0.0)
            assert reruns == 1 and done[0].status == "completed" and not dead.served
        finally:
            engine_recovery.reset(token)
            await alive.stop()


def test_algorithm_names_what_the_advantages_are() -> None:
    assert LoopConfig().algorithm == "grpo"
    assert LoopConfig(advantage_estimator="rloo").algorithm == "rloo"
    assert LoopConfig(rewards_normalization=False).algorithm == "raw reward (no baseline)"
    assert LoopConfig(grpo_std_normalization=False).algorithm == "grpo without std normalisation"
