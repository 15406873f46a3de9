"""Asynchronous (off-policy) GRPO: rollouts of later steps overlap training of this one.

As slime's ``train_async.py`` and verl's fully-async policy, generation never waits for
the trainer. Every prompt's group (``n_samples_per_prompt`` samples) is one asyncio task
running the loop's ``collect([prompt])``; the trainer works in a worker thread
(``asyncio.to_thread``) so the event loop keeps serving rollouts and finished groups
launch new ones meanwhile. With ``N = max_off_policy_steps``, ``R = rollout_batch_size``::

    weight version v = number of weight syncs the engines have finished (= loop.step)
    a group launched while the engines serve v carries v (every sample: weight_version)
    it may be trained at steps s <= v + N; off-policy steps of a sample = s - v
    groups kept pending (running or finished, not yet trained) <= (v + N + 1 - s_next) * R
    step s = the first R groups to finish (oldest weights first when more are finished);
    unfinished ones keep running into later steps
    once s_next > v + N a running group is cancelled (and the ``abort`` hook told), a
    finished one dropped; neither is regenerated (metric rollout/stale_dropped, in groups)

So ``N = 0`` is on-policy with no overlap, and ``N = 1`` generates the next step's groups
while this step trains. A group is tagged with the version served when it *starts*, the
oldest weights it can have seen, so a sync landing mid-episode never hides staleness.
With ``weight_updates`` (the engines' router) each sync settles the generations in flight
as ``config.update_weights_mode`` says (drain, abort-resume, keep) and every token carries
the version it was sampled with, so ``rollout/staleness_max`` / ``_mean`` are per token.

Off-policy correction: the trainer recomputes ``old_logprobs`` with its current weights
(the proximal policy the PPO ratio is clipped against) while each sample's
``rollout_logprobs`` (the behaviour policy of version v) reach the loss through
``TrainBatch.rollout_logprobs``; with ``ActorLossConfig.use_tis`` (``--use-tis``), every
token's loss is weighted by ``clip(exp(old_logp - rollout_logp), tis_clip_low, tis_clip)``
(truncated importance sampling, ``algos/policy_loss.py``). A trainer whose loss has no TIS
triggers a warning when ``N > 0``.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.loop.loop import GenerateFn, GRPOLoop, MetricsFn, RewardFn
from turnrl.grpo_core.loop.rollout_manager import Rollout

AbortFn = Callable[[list[Any]], Awaitable[None]]
"""``(prompts)`` of groups the loop cancelled: stop their engine requests (e.g. the
router's ``abort``); the loop has already cancelled the generate task itself."""


@dataclass
class RolloutGroup:
    """One prompt's group on its way from launch to training."""

    prompt: Any
    """The prompt (task) given to the generate hook."""
    weight_version: int
    """Weight version the engines served when the group was launched."""
    launched_at: float
    """``time.perf_counter()`` at launch."""
    finished_at: float = 0.0
    """``time.perf_counter()`` when its samples were scored (0 while running)."""
    samples: list[Any] = field(default_factory=list)
    """Its scored samples, each with ``weight_version`` set (empty while running)."""


class AsyncGRPOLoop(GRPOLoop):
    """GRPO steps with rollouts at most ``config.max_off_policy_steps`` steps off-policy.

    Takes :class:`GRPOLoop`'s arguments plus ``abort``. Use :meth:`run`: one call keeps
    rollouts flowing across all its steps (:meth:`run_step` is ``run(1)``, which cannot
    overlap anything). The trainer is only ever used by one thread at a time: training
    runs in a worker thread, weight sync, checkpoints and hooks on the event loop, in turn.

    Args:
        abort: Optional hook told the prompts of groups cancelled as too stale (or left
            running when :meth:`run` ends), see :data:`AbortFn`.
    """

    def __init__(
        self,
        config: LoopConfig,
        trainer: Any,
        prompts: Sequence[Any],
        generate: GenerateFn,
        reward: RewardFn,
        *,
        abort: AbortFn | None = None,
        on_metrics: MetricsFn | None = None,
        **kwargs: Any,
    ) -> None:
        if abort is not None and not callable(abort):
            raise TypeError(f"abort must be an async callable or None, got {abort!r}")
        if kwargs.get("engine_sleep") is not None:
            raise ValueError(
                "colocated engines sleep while the trainer trains, and the asynchronous loop "
                "generates during training: drop --async or --colocate"
            )
        super().__init__(config, trainer, prompts, generate, reward, **kwargs)
        self.abort = abort
        self.user_on_metrics = on_metrics
        """The caller's metrics hook; ``on_metrics`` is this loop's own, which completes
        the async metrics and then calls it."""
        self.on_metrics = self._emit
        self.weight_version = self.step
        """Weight version the engines serve (updated when a step's sync has finished)."""
        self._running: dict[asyncio.Task[Any], RolloutGroup] = {}
        self._ready: list[RolloutGroup] = []
        self._cancelled: set[asyncio.Task[Any]] = set()
        self._next_step = self.step
        self._last_step = self.step
        self._error: BaseException | None = None
        self._wakeup: asyncio.Event | None = None
        self._dropped = 0
        self._pretrained: dict[str, float] | None = None
        self._train_s = 0.0
        self._step_end = 0.0
        _warn_without_tis(trainer, config)

    # -- the run -------------------------------------------------------------------------

    async def run_step(self) -> dict[str, float]:
        """One step on its own (no overlap); prefer :meth:`run` with several steps."""
        return (await self.run(1))[-1]

    async def run(self, num_steps: int | None = None) -> list[dict[str, float]]:
        """Run ``num_steps`` steps (default: ``config.num_rollout`` minus those done)."""
        todo = self.config.num_rollout - self.step if num_steps is None else num_steps
        if todo < 0:
            raise ValueError(f"num_steps must be >= 0, got {todo}")
        self.weight_version = self.step  # every step (and resume) ends with a sync
        self._next_step, self._last_step = self.step, self.step + todo
        self._wakeup, self._error = asyncio.Event(), None
        self._step_end = time.perf_counter()
        try:
            for _ in range(todo):
                samples, rollout_s = await self._take_batch()
                await self.learn(samples, rollout_s)
                self.weight_version = self.step
                await self._drop_stale()
                self._launch()
        finally:
            await self._cancel(list(self._running), stale=False)
            if self._cancelled:
                await asyncio.gather(*self._cancelled, return_exceptions=True)
                self._cancelled.clear()
        return self.history

    async def _take_batch(self) -> tuple[list[Any], float]:
        """Wait for the first ``rollout_batch_size`` finished groups of this step; their
        samples in one :class:`Rollout` (the generate hook's metrics of each, joined)."""
        assert self._wakeup is not None
        want = self.config.rollout_batch_size
        await self._drop_stale()
        self._launch()
        waited = time.perf_counter()
        while len(self._ready) < want:
            if self._error is not None:
                raise self._error
            assert self._running, "no rollout running while the step still needs groups"
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._error is not None:
            raise self._error
        self._ready.sort(key=lambda g: g.weight_version)  # stable: oldest weights first
        groups, self._ready = self._ready[:want], self._ready[want:]
        step = self.step
        self._next_step = step + 1
        self._launch()  # the capacity freed by this step's groups goes to step + 1 and on
        lags = [step - s.weight_version for g in groups for s in g.samples]
        assert max(lags) <= self.config.max_off_policy_steps, lags
        samples = Rollout.joined([g.samples for g in groups])  # a manager's metrics, summed
        done = time.perf_counter()
        self._pretrained = {
            "rollout/off_policy_steps_mean": sum(lags) / len(lags),
            "rollout/off_policy_steps_max": float(max(lags)),
            "rollout/stale_dropped": float(self._dropped),
            "rollout/groups_pending": float(len(self._running) + len(self._ready)),
            "perf/rollout_wait_s": done - waited,
        }
        self._dropped = 0
        return samples, done - min(g.launched_at for g in groups)

    # -- producing groups ----------------------------------------------------------------

    def _capacity(self) -> int:
        """How many more groups may be pending now without any of them going stale."""
        n, r = self.config.max_off_policy_steps, self.config.rollout_batch_size
        usable_steps = min(self.weight_version + n + 1, self._last_step) - self._next_step
        return max(0, usable_steps * r - len(self._running) - len(self._ready))

    def _launch(self) -> None:
        """Start as many groups as the staleness bound allows, with the served weights."""
        if self._error is not None:
            return
        for _ in range(self._capacity()):
            prompt = self.data.next(1)[0]
            group = RolloutGroup(prompt, self.weight_version, time.perf_counter())
            task = asyncio.create_task(self.collect([prompt]))
            self._running[task] = group
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        """Done callback of a group's task: keep its samples, refill, wake the step."""
        self._cancelled.discard(task)
        group = self._running.pop(task, None)
        if group is None or task.cancelled():
            return
        try:
            samples, _ = task.result()
            for sample in samples:
                _tag(sample, group.weight_version)
        except Exception as error:  # the generate/reward hook's, raised from run()
            self._error = error
        else:
            group.samples, group.finished_at = samples, time.perf_counter()
            self._ready.append(group)
            self._launch()
        assert self._wakeup is not None
        self._wakeup.set()

    async def _drop_stale(self) -> None:
        """Drop finished and cancel running groups that no step may train any more."""
        limit = self._next_step - self.config.max_off_policy_steps
        fresh = [g for g in self._ready if g.weight_version >= limit]
        self._dropped += len(self._ready) - len(fresh)
        self._ready = fresh
        stale = [t for t, g in self._running.items() if g.weight_version < limit]
        await self._cancel(stale, stale=True)

    async def _cancel(self, tasks: list[asyncio.Task[Any]], *, stale: bool) -> None:
        groups = [self._running.pop(t) for t in tasks]
        for task in tasks:
            task.cancel()
            self._cancelled.add(task)
        if stale:
            self._dropped += len(groups)
        if groups and self.abort is not None:
            await self.abort([g.prompt for g in groups])

    # -- training off the event loop -----------------------------------------------------

    async def learn(self, samples: list[Any], rollout_s: float) -> dict[str, float]:
        """:meth:`GRPOLoop.learn` with the training itself in a worker thread."""
        start = time.perf_counter()
        trained = await asyncio.to_thread(super()._train, samples)
        self._train_s = time.perf_counter() - start
        self._pretrained = {**(self._pretrained or {}), **trained}
        self._rollout_busy = {}  # rollouts overlap here: only the whole step's is logged
        return await super().learn(samples, rollout_s)

    def _train(self, samples: list[Any]) -> dict[str, float]:
        """Hand :meth:`GRPOLoop.learn` the metrics of the training :meth:`learn` just did."""
        done, self._pretrained = self._pretrained, None
        if done is None or "train/skipped" not in done:
            return super()._train(samples)
        return done

    def _emit(self, step: int, metrics: dict[str, float]) -> None:
        """Count the threaded training in ``perf/``, time the step by wall clock, forward."""
        now = time.perf_counter()
        metrics["perf/train_s"] = metrics.get("perf/train_s", 0.0) + self._train_s
        metrics["perf/step_s"] = now - self._step_end
        self._step_end, self._train_s = now, 0.0
        if self.user_on_metrics is not None:
            self.user_on_metrics(step, metrics)


def _tag(sample: Any, version: int) -> None:
    try:
        sample.weight_version = version
    except AttributeError as error:  # __slots__ or a frozen class
        raise TypeError(
            f"cannot record weight_version on a {type(sample).__name__} sample; the async "
            "loop needs samples with settable attributes"
        ) from error


def _warn_without_tis(trainer: Any, config: LoopConfig) -> None:
    loss = getattr(getattr(trainer, "config", None), "loss", None)
    if config.max_off_policy_steps > 0 and loss is not None and loss.tis_cap is None:
        warnings.warn(
            "AsyncGRPOLoop trains up to max_off_policy_steps steps off-policy but the "
            "trainer's ActorLossConfig.use_tis is off: no truncated importance sampling "
            "corrects for the stale rollout policy (set use_tis, --use-tis)",
            stacklevel=3,
        )


def loop_class(config: LoopConfig) -> type[GRPOLoop]:
    """The loop ``config`` asks for: :class:`AsyncGRPOLoop` with ``asynchronous``, else
    :class:`GRPOLoop`."""
    return AsyncGRPOLoop if config.asynchronous else GRPOLoop
