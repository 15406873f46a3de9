"""The asynchronous GRPO loop on CPU, without vLLM: overlap, staleness, long tails, learning.

The trainer is the real torch engine on the tiny Qwen3 model. Rollouts come from a toy
generate hook that sleeps a controllable time per group (``asyncio.sleep``, standing in for
an engine's latency) and samples among eight candidate tokens (ids 100-107), either
uniformly with their exact log-probs (timing tests) or from a second copy of the tiny model
updated only through an export + reload weight sync (the learning test). Every even token
earns reward.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop import AsyncGRPOLoop, LoopConfig
from turnrl.grpo_core.testing.golden import ToySample
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig

RESPONSE_LEN = 4
CANDIDATES = torch.arange(100, 108)
PROMPTS = [[1 + i, 40 + i, 90 + i] for i in range(8)]


@dataclass
class Episode:
    """One group's generation as the toy engine saw it."""

    prompt: list[int]
    engine_version: int
    start: float
    end: float = math.inf
    cancelled: bool = False


class DelayedEngine:
    """Generate hook with a per-prompt delay; uniform sampling with exact log-probs.

    ``version`` is the weight version the engine serves, set by :class:`VersionSync`.
    """

    def __init__(self, delay: dict[int, float] | float, seed: int = 0) -> None:
        self.delay, self.version = delay, 0
        self.gates: dict[int, asyncio.Event] = {}
        """Prompts (by first token) whose generation also waits for an event."""
        self.rng = random.Random(seed)
        self.episodes: list[Episode] = []

    def delay_of(self, prompt: list[int]) -> float:
        if isinstance(self.delay, dict):
            return self.delay.get(prompt[0], 0.02)
        return self.delay

    async def generate(self, prompts: list[list[int]], n: int) -> list[ToySample]:
        out = []
        for prompt in prompts:
            await self._wait(prompt)
            for _ in range(n):
                ids = [100 + self.rng.randrange(8) for _ in range(RESPONSE_LEN)]
                logps = [math.log(1 / 8)] * RESPONSE_LEN
                sample = ToySample(prompt, ids, [1] * RESPONSE_LEN, logps, group_id=str(prompt))
                sample.metadata["engine_version"] = self.version
                out.append(sample)
        return out

    async def _wait(self, prompt: list[int]) -> None:
        episode = Episode(prompt, self.version, time.perf_counter())
        self.episodes.append(episode)
        try:
            await asyncio.sleep(self.delay_of(prompt))
            if prompt[0] in self.gates:
                await self.gates[prompt[0]].wait()
        except asyncio.CancelledError:
            episode.cancelled = True
            raise
        episode.end = time.perf_counter()


async def even_reward(samples: list[ToySample]) -> list[float]:
    return [sum(t % 2 == 0 for t in s.response_ids) / RESPONSE_LEN for s in samples]


class VersionSync:
    """Weight sync into the toy engine: it serves the new version after a short delay."""

    def __init__(self, engine: Any, seconds: float = 0.01) -> None:
        self.engine, self.seconds = engine, seconds

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        await asyncio.sleep(self.seconds)
        self.engine.version = version
        return {"total_s": self.seconds}


class RecordingLoop(AsyncGRPOLoop):
    """Records which step trained which samples, and when each step's learn phase
    (training, weight sync, metrics) ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[tuple[int, list[Any]]] = []
        self.learn_spans: dict[int, tuple[float, float]] = {}
        self.step_ends: list[float] = []

    async def learn(self, samples: list[Any], rollout_s: float) -> dict[str, float]:
        step, start = self.step, time.perf_counter()
        self.trained.append((step, samples))
        metrics = await super().learn(samples, rollout_s)
        self.step_ends.append(time.perf_counter())
        self.learn_spans[step] = (start, self.step_ends[-1])
        return metrics


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(seed=0))


def make_trainer(folder: Path, tis_cap: float | None = 2.0, lr: float = 1e-3) -> TorchEngine:
    return TorchEngine(
        TorchEngineConfig(
            model_path=str(folder),
            optimizer=OptimizerConfig(lr=lr, weight_decay=0.0),
            loss=ActorLossConfig(
                eps_clip=0.2,
                eps_clip_high=0.28,
                use_tis=tis_cap is not None,
                tis_clip=tis_cap or 2.0,
            ),
            micro_batch_size=8,
            seed=0,
        )
    )


def make_config(n_off: int, steps: int = 4, **kw: Any) -> LoopConfig:
    args: dict[str, Any] = dict(
        num_rollout=steps,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        max_off_policy_steps=n_off,
        seed=0,
    )
    args.update(kw)
    return LoopConfig(**args)


def make_loop(folder: Path, engine: DelayedEngine, n_off: int, **kw: Any) -> RecordingLoop:
    return RecordingLoop(
        make_config(n_off, **kw),
        make_trainer(folder),
        PROMPTS,
        engine.generate,
        even_reward,
        weight_sync=VersionSync(engine),
        pad_id=0,
    )


def overlaps(episode: Episode, span: tuple[float, float]) -> bool:
    return episode.start < span[1] and episode.end > span[0]


async def test_rollouts_of_next_step_overlap_training(tiny_folder: Path) -> None:
    engine = DelayedEngine(0.5)
    loop = make_loop(tiny_folder, engine, n_off=1, steps=3)
    await loop.run()
    assert loop.step == 3 and len(loop.history) == 3
    # Groups trained at step k + 1 were generating while step k trained.
    trained_step = {s.group_id: step for step, samples in loop.trained for s in samples}
    overlapping = [
        (step, e.prompt)
        for step, span in loop.learn_spans.items()
        for e in engine.episodes
        if overlaps(e, span) and trained_step.get(str(e.prompt)) == step + 1
    ]
    assert len(overlapping) >= 2, f"no rollout overlapped training: {loop.learn_spans}"
    trained_at = {id(s): step for step, samples in loop.trained for s in samples}
    later = [
        step
        for step, samples in loop.trained
        for s in samples
        if s.weight_version < step  # generated before the step's previous sync
    ]
    assert later, "async mode never trained a group generated one version back"
    assert all(trained_at[id(s)] - s.weight_version <= 1 for _, ss in loop.trained for s in ss)


async def test_zero_off_policy_steps_never_overlaps(tiny_folder: Path) -> None:
    engine = DelayedEngine(0.05)
    loop = make_loop(tiny_folder, engine, n_off=0, steps=3)
    await loop.run()
    for span in loop.learn_spans.values():
        assert not any(overlaps(e, span) for e in engine.episodes)
    assert all(m["rollout/off_policy_steps_max"] == 0.0 for m in loop.history)


@pytest.mark.parametrize("n_off", [1, 2])
async def test_staleness_never_exceeds_bound(tiny_folder: Path, n_off: int) -> None:
    rng = random.Random(n_off)
    engine = DelayedEngine({p[0]: rng.choice([0.01, 0.05, 0.3]) for p in PROMPTS})
    loop = make_loop(tiny_folder, engine, n_off=n_off, steps=5)
    await loop.run()
    lags = []
    for step, samples in loop.trained:
        assert len(samples) == 4
        for s in samples:
            # Tagged with the oldest weights it may have seen, and never staler than N.
            assert s.metadata["engine_version"] >= s.weight_version
            assert 0 <= step - s.weight_version <= n_off
            lags.append(step - s.weight_version)
    assert max(lags) >= 1, "the test never trained an off-policy sample"
    for (step, samples), metrics in zip(loop.trained, loop.history, strict=True):
        expect = sum(step - s.weight_version for s in samples) / len(samples)
        assert metrics["rollout/off_policy_steps_mean"] == pytest.approx(expect)
        assert metrics["rollout/off_policy_steps_max"] <= n_off


async def test_long_tail_group_does_not_stall_steps(tiny_folder: Path) -> None:
    slow_prompt = PROMPTS[1]
    engine = DelayedEngine({slow_prompt[0]: 60.0})
    aborted: list[list[Any]] = []

    async def abort(prompts: list[Any]) -> None:
        aborted.append(prompts)

    loop = RecordingLoop(
        make_config(1, steps=3),
        make_trainer(tiny_folder),
        PROMPTS,
        engine.generate,
        even_reward,
        weight_sync=VersionSync(engine),
        pad_id=0,
        abort=abort,
    )
    await loop.run()
    (slow,) = [e for e in engine.episodes if e.prompt == slow_prompt]
    # Every step finished long before the slow episode could have: the fast groups filled
    # them, and once the slow one (weights v0) could not be trained at step 2 it was
    # cancelled and the abort hook told.
    assert all(end < slow.start + 60.0 for end in loop.step_ends)
    assert slow.cancelled and aborted == [[slow_prompt]]
    assert sum(m["rollout/stale_dropped"] for m in loop.history) == 1.0
    assert all(str(slow_prompt) != s.group_id for _, ss in loop.trained for s in ss)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending


class GateSync(VersionSync):
    """Releases the engine's gated prompts during the sync of ``version`` and lets them
    finish before the engine serves it."""

    def __init__(self, engine: DelayedEngine, version: int) -> None:
        super().__init__(engine)
        self.release = version

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        if version == self.release:
            for gate in self.engine.gates.values():
                gate.set()
            gated = [e for e in self.engine.episodes if e.prompt[0] in self.engine.gates]
            for _ in range(500):
                if all(e.end < math.inf for e in gated):
                    break
                await asyncio.sleep(0.01)
        return await super().sync(trainer, version)


async def test_finished_groups_older_than_bound_are_dropped(tiny_folder: Path) -> None:
    # A and B (weights v0) wait for a gate; C, D fill step 0 and E, F (v1) step 1. The gate
    # opens during step 1's weight sync: A and B finish when only steps >= 2 remain, one
    # step too stale for N = 1, so they are dropped unseen by the trainer.
    engine = DelayedEngine(0.01)
    engine.gates = {PROMPTS[0][0]: asyncio.Event(), PROMPTS[1][0]: asyncio.Event()}
    loop = RecordingLoop(
        make_config(1, steps=3),
        make_trainer(tiny_folder),
        PROMPTS,
        engine.generate,
        even_reward,
        weight_sync=GateSync(engine, version=2),
        pad_id=0,
    )
    await loop.run()
    gated = [e for e in engine.episodes if e.prompt[0] in engine.gates]
    assert len(gated) == 2 and all(e.end < math.inf and not e.cancelled for e in gated)
    assert [m["rollout/stale_dropped"] for m in loop.history] == [0.0, 0.0, 2.0]
    trained_groups = {s.group_id for _, ss in loop.trained for s in ss}
    assert len(trained_groups) == 6
    assert not trained_groups & {str(PROMPTS[0]), str(PROMPTS[1])}


class TorchSampler:
    """Samples from its own copy of the tiny model; new weights only via ``reload``."""

    def __init__(self, folder: Path, delay: float) -> None:
        from transformers import AutoModelForCausalLM

        self._load = AutoModelForCausalLM.from_pretrained
        self.model = self._load(folder).eval()
        self.version, self.delay = 0, delay
        self.gen = torch.Generator().manual_seed(0)

    def reload(self, folder: Path, version: int) -> None:
        self.model = self._load(folder).eval()
        self.version = version

    def _probs(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        return torch.softmax(logits[CANDIDATES], -1)

    async def generate(self, prompts: list[list[int]], n: int) -> list[ToySample]:
        await asyncio.sleep(self.delay)
        out = []
        for prompt in prompts:
            for _ in range(n):
                ids, logps = list(prompt), []
                for _ in range(RESPONSE_LEN):
                    probs = self._probs(ids)
                    pick = int(torch.multinomial(probs, 1, generator=self.gen))
                    ids.append(int(CANDIDATES[pick]))
                    logps.append(math.log(float(probs[pick])))
                sample = ToySample(
                    prompt, ids[len(prompt) :], [1] * RESPONSE_LEN, logps, str(prompt)
                )
                sample.metadata["engine_version"] = self.version
                out.append(sample)
        return out

    def even_mass(self, prompts: list[list[int]]) -> float:
        return sum(float(self._probs(p)[0::2].sum()) for p in prompts) / len(prompts)


class ExportSync:
    """Disk weight sync into the sampler (the export path vLLM engines reload)."""

    def __init__(self, sampler: TorchSampler, root: Path) -> None:
        self.sampler, self.root = sampler, root

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        self.sampler.reload(trainer.export_hf(self.root / f"v{version}"), version)
        return {"total_s": 0.0}


def guard_single_thread(trainer: TorchEngine, names: tuple[str, ...]) -> list[str]:
    """Wrap trainer methods to record any call made while another one is running."""
    busy, clashes = threading.Lock(), []

    def wrap(name: str) -> None:
        inner = getattr(trainer, name)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if not busy.acquire(blocking=False):
                clashes.append(name)
                return inner(*args, **kwargs)
            try:
                return inner(*args, **kwargs)
            finally:
                busy.release()

        setattr(trainer, name, guarded)

    for name in names:
        wrap(name)
    return clashes


@pytest.mark.slow
async def test_async_loop_learns_toy_task(tiny_folder: Path, tmp_path: Path) -> None:
    prompts = PROMPTS[:4]
    sampler = TorchSampler(tiny_folder, delay=0.05)
    trainer = make_trainer(tiny_folder, lr=1e-2)
    clashes = guard_single_thread(trainer, ("compute_logprobs", "train_step", "export_hf"))
    loop = RecordingLoop(
        make_config(1, steps=5, rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8),
        trainer,
        prompts,
        sampler.generate,
        even_reward,
        weight_sync=ExportSync(sampler, tmp_path / "sync"),
        pad_id=0,
    )
    before = sampler.even_mass(prompts)
    history = await loop.run()
    after = sampler.even_mass(prompts)
    print(f"async even-token mass {before:.3f} -> {after:.3f}")
    assert max(m["rollout/off_policy_steps_max"] for m in history) == 1.0
    assert all(m["train/skipped"] == 0.0 for m in history)
    assert clashes == [], "the trainer was used from two threads at once"
    assert after > before + 0.15, f"even-token mass {before:.3f} -> {after:.3f}"


def test_negative_off_policy_steps_rejected() -> None:
    with pytest.raises(ValueError, match="max_off_policy_steps must be >= 0, got -1"):
        make_config(-1)


async def test_bad_hooks_and_step_counts_rejected(tiny_folder: Path) -> None:
    engine = DelayedEngine(0.01)
    args = (make_config(1), make_trainer(tiny_folder), PROMPTS, engine.generate, even_reward)
    with pytest.raises(TypeError, match="abort must be an async callable"):
        AsyncGRPOLoop(*args, weight_sync=None, pad_id=0, abort="not a function")  # type: ignore[arg-type]
    loop = AsyncGRPOLoop(*args, weight_sync=None, pad_id=0)
    with pytest.raises(ValueError, match="num_steps must be >= 0"):
        await loop.run(-1)


def test_missing_tis_cap_warns(tiny_folder: Path) -> None:
    engine = DelayedEngine(0.01)
    with pytest.warns(UserWarning, match="use_tis is off"):
        AsyncGRPOLoop(
            make_config(1),
            make_trainer(tiny_folder, tis_cap=None),
            PROMPTS,
            engine.generate,
            even_reward,
            weight_sync=None,
            pad_id=0,
        )


async def test_generate_error_stops_the_run_and_cancels_rollouts(tiny_folder: Path) -> None:
    engine = DelayedEngine({PROMPTS[0][0]: 5.0, PROMPTS[1][0]: 0.01})
    inner = engine.generate

    async def generate(prompts: list[list[int]], n: int) -> list[ToySample]:
        if prompts[0] == PROMPTS[1]:
            raise RuntimeError("engine died")
        return await inner(prompts, n)

    loop = AsyncGRPOLoop(
        make_config(1),
        make_trainer(tiny_folder),
        PROMPTS,
        generate,
        even_reward,
        weight_sync=None,
        pad_id=0,
    )
    with pytest.raises(RuntimeError, match="engine died"):
        await loop.run()
    assert loop.step == 0
    assert all(e.cancelled or e.end < math.inf for e in engine.episodes)
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not pending, pending


class SlottedSample:
    """A sample class with ``__slots__`` and no room for ``weight_version``."""

    __slots__ = (
        "group_id",
        "loss_mask",
        "prompt_ids",
        "response_ids",
        "reward",
        "rollout_logprobs",
    )

    def __init__(self, prompt: list[int]) -> None:
        self.prompt_ids, self.response_ids, self.loss_mask = prompt, [100], [1]
        self.rollout_logprobs, self.group_id, self.reward = [-2.0], "g", 0.0


async def test_samples_that_cannot_record_a_version_are_rejected(tiny_folder: Path) -> None:
    async def generate(prompts: list[list[int]], n: int) -> list[Any]:
        return [SlottedSample(prompts[0]) for _ in range(n)]

    loop = AsyncGRPOLoop(
        make_config(1),
        make_trainer(tiny_folder),
        PROMPTS,
        generate,
        even_reward,
        weight_sync=None,
        pad_id=0,
    )
    with pytest.raises(TypeError, match="cannot record weight_version on a SlottedSample"):
        await loop.run(1)


async def test_a_managers_metrics_of_each_group_are_joined_into_its_step(tiny_folder: Path) -> None:
    """The asynchronous loop generates one group per call: the metrics a rollout manager
    returns with each call (``Rollout.metrics``) reach the step that trains the group,
    counts added, seconds and flags the largest of the step's groups."""
    from turnrl.grpo_core.loop.rollout_manager import Rollout

    engine = DelayedEngine(0.01)
    calls: dict[str, dict[str, float]] = {}  # by group id (the prompt)

    async def generate(prompts: list[list[int]], n: int) -> Rollout:
        index = len(calls)
        metrics = {
            "rollout/groups_kept": 1.0,
            "rollout/episode_retries": float(index % 2),
            "rollout/manager_s": 0.1 * (index % 3),
            "rollout/filter_exhausted": float(index == 1),
        }
        calls[str(prompts[0])] = metrics
        return Rollout(await engine.generate(prompts, n), metrics)

    loop = RecordingLoop(
        make_config(1, steps=3),
        make_trainer(tiny_folder),
        PROMPTS,
        generate,
        even_reward,
        weight_sync=VersionSync(engine),
        pad_id=0,
    )
    await loop.run()
    assert len(calls) >= 6  # 8 prompts: no group id repeats
    for (_, samples), metrics in zip(loop.trained, loop.history, strict=True):
        mine = [calls[g] for g in {s.group_id for s in samples}]
        assert len(mine) == 2 and metrics["rollout/groups_kept"] == 2.0
        assert metrics["rollout/episode_retries"] == sum(m["rollout/episode_retries"] for m in mine)
        assert metrics["rollout/manager_s"] == max(m["rollout/manager_s"] for m in mine)
        assert metrics["rollout/filter_exhausted"] == max(
            m["rollout/filter_exhausted"] for m in mine
        )
