"""Rollout manager: GRPO groups with bounded concurrency, over-sampling, the dynamic filter,
abort of leftover episodes and re-runs of episodes whose engine died.

One call of :meth:`RolloutManager.generate` (the :class:`~turnrl.grpo_core.loop.GRPOLoop`
``generate`` hook, ``(prompts, n) -> samples``) runs like slime's ``generate_rollout_async``::

    target  = len(prompts) groups of n samples
    submit groups for the prompts (+ more from prompt_source, up to over_sampling_batch_size)
    as each group finishes: score it (reward(group)), keep it unless the dynamic filter
        drops it (all rewards equal: zero GRPO advantage, no gradient)
    while kept + running groups < target: submit over_sampling_batch_size more prompts
    once target groups are kept: abort every leftover episode through the router
        (by session id, confirmed drain), cancel what has not started, and return

Every episode holds one slot of a semaphore of ``max_concurrency_per_engine`` x engines
(slime's ``--sglang-server-concurrency``), so multi-turn episodes that wait on tools or
a user simulator still count against the engines' capacity.

Engine death: an episode that raises an engine error (:class:`PartialGenerationError` --
the engine died after producing tokens --, :class:`EngineUnavailableError`,
:class:`NoEngineAvailableError`) or returns a sample that says so (status ``failed`` with
the engine error in ``metadata["error"]``, as ``turnrl.tool_envs`` episodes report it, or
status ``aborted`` that this manager did not ask for) is run again from scratch under a
fresh session id, up to ``max_retries`` times; the router's circuit breaker steers the
new attempt to a live engine. Out of retries, the call raises :class:`EpisodeFailedError`
(after aborting everything else), so a step never hangs on dead engines.

Samples are any objects with ``reward`` (set here), ``group_id`` and, optionally,
``status`` and ``metadata``; this package never imports ``turnrl.tool_envs``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.rollout_router.protocol import (
    DrainTimeoutError,
    EngineUnavailableError,
    NoEngineAvailableError,
    PartialGenerationError,
)
from turnrl.rollout_router.router import Router

log = logging.getLogger(__name__)

EpisodeFn = Callable[[Any, int, str, str], Awaitable[Any]]
"""``(prompt, sample_index, group_id, session_id) -> sample``: the app's multi-turn episode.
It must send every engine request of the episode with ``session_id`` (so it can be aborted)."""
GroupRewardFn = Callable[[list[Any]], Awaitable[list[float]]]
"""``(samples of one group) -> one reward per sample`` (batched per group)."""
PromptSource = Callable[[int], list[Any]]
"""``(count) -> the next count prompts`` (e.g. ``GRPOLoop.data.next``) for over-sampling."""

ENGINE_ERRORS: tuple[type[Exception], ...] = (
    PartialGenerationError,
    EngineUnavailableError,
    NoEngineAvailableError,
)
"""Exceptions that mean the engine, not the episode, failed: the episode is re-run."""


class Rollout(list[Any]):
    """One call's samples (a list) with the manager's ``rollout/...`` scalars of that call
    in :attr:`metrics`; :class:`~turnrl.grpo_core.loop.GRPOLoop` logs them with its step."""

    def __init__(self, samples: list[Any], metrics: dict[str, float]) -> None:
        super().__init__(samples)
        self.metrics = metrics

    @classmethod
    def joined(cls, parts: Sequence[list[Any]]) -> Rollout:
        """Several calls' samples as one rollout (the asynchronous loop's step, one call per
        group): counts added, seconds and flags (``..._s``, ``filter_exhausted``) the largest."""
        metrics: dict[str, float] = {}
        for part in parts:
            for key, value in getattr(part, "metrics", {}).items():
                largest = key.endswith("_s") or key.endswith("filter_exhausted")
                metrics[key] = (
                    max(metrics.get(key, value), value)
                    if largest
                    else metrics.get(key, 0.0) + value
                )
        return cls([s for part in parts for s in part], metrics)


class EpisodeFailedError(RuntimeError):
    """An episode kept failing because of its engines, ``max_retries`` re-runs included."""


class RolloutTimeoutError(TimeoutError):
    """The rollout did not collect its groups within ``step_timeout`` seconds."""


def engine_failed(sample: Any) -> bool:
    """Whether a returned sample says its engine failed (the default retry test).

    True for status ``aborted`` (an abort this manager did not ask for, e.g. an engine
    paused for a weight update) and for status ``failed`` whose ``metadata["error"]`` starts
    with the name of an engine error (how ``turnrl.tool_envs`` records one).
    """
    status = getattr(sample, "status", "completed")
    if status == "aborted":
        return True
    if status != "failed":
        return False
    metadata = getattr(sample, "metadata", None)
    error = str(metadata.get("error", "")) if isinstance(metadata, dict) else ""
    return error.startswith(tuple(cls.__name__ for cls in ENGINE_ERRORS))


@dataclass
class RolloutManagerConfig:
    """How the manager runs one step's rollout (slime flag names in brackets)."""

    over_sampling_batch_size: int | None = None
    """Prompts submitted per sampling round; None: as many as the step's prompts
    [--over-sampling-batch-size]. Above the rollout batch size it over-samples from the
    start, which keeps the step short when some groups are slow or get filtered."""
    max_concurrency_per_engine: int = 8
    """Episodes in flight per engine; the bound is this x the router's engines at the start
    of the call [--sglang-server-concurrency / --vllm-server-concurrency]."""
    max_concurrency: int | None = None
    """Total episodes in flight, overriding the per-engine bound [--rollout-max-concurrency]."""
    dynamic_filter: bool = False
    """Drop groups whose rewards are all equal and sample more prompts until enough groups
    vary [--dynamic-sampling-filter-path ...check_reward_nonzero_std]."""
    max_sampling_rounds: int = 10
    """Sampling rounds allowed per step before giving up with an error (DAPO's
    ``max_num_gen_batches``)."""
    train_when_exhausted: bool = False
    """After ``max_sampling_rounds`` rounds short of the target, return the groups that
    vary (fewer than asked; the first filtered groups when none varies) instead of raising,
    with ``rollout/filter_exhausted`` = 1: a long run does not die of one unlucky step."""
    max_retries: int = 2
    """Re-runs of one episode after engine failures before the step fails."""
    retry_backoff: float = 0.2
    """Seconds before a re-run, so the router's health loop can open a dead engine's circuit."""
    drain_timeout: float = 10.0
    """Seconds to wait for aborted leftover requests to end (confirmed drain)."""
    step_timeout: float | None = None
    """Seconds one call may take before it aborts everything and raises; None: no limit."""

    def __post_init__(self) -> None:
        for name in ("over_sampling_batch_size", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {value}")
        for name in ("max_concurrency_per_engine", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.retry_backoff < 0:
            raise ValueError(f"retry_backoff must be >= 0, got {self.retry_backoff}")
        if self.drain_timeout <= 0:
            raise ValueError(f"drain_timeout must be > 0, got {self.drain_timeout}")
        if self.step_timeout is not None and self.step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0 (or None), got {self.step_timeout}")


@dataclass
class _Group:
    index: int
    """Submission order within the call (the order kept groups are returned in)."""
    group_id: str
    prompt: Any
    task: asyncio.Task[list[Any]] | None = None


@dataclass
class _Run:
    """State of one :meth:`RolloutManager.generate` call."""

    n: int
    target: int
    semaphore: asyncio.Semaphore
    groups: list[_Group] = field(default_factory=list)
    kept: list[tuple[_Group, list[Any]]] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    """Session ids of episodes running now."""
    stopping: bool = False
    exhausted: bool = False
    dropped: list[tuple[_Group, list[Any]]] = field(default_factory=list)
    """Groups the filter dropped (returned only when it is exhausted and kept none)."""
    rounds: int = 0
    judged: int = 0
    uniform: int = 0
    """Judged groups whose filter value is the same for every sample (zero advantage)."""
    filtered: int = 0
    retries: int = 0
    aborted: int = 0
    undrained: int = 0
    leftover_groups: int = 0
    """Groups still running when the call ended (aborted or cancelled)."""

    def pending(self) -> list[asyncio.Task[list[Any]]]:
        return [g.task for g in self.groups if g.task is not None and not g.task.done()]


class RolloutManager:
    """Collects one step's GRPO groups from an app's episode function.

    Args:
        episode: The app's episode, see :data:`EpisodeFn`.
        reward: Scores one group, see :data:`GroupRewardFn`; the rewards are set on the samples.
        router: The router the episodes generate through (aborts, engine count).
        config: Concurrency, over-sampling, filter and retry settings.
        prompt_source: Where extra prompts come from when over-sampling or filtering;
            may be set later as the attribute of the same name (e.g. to ``loop.data.next``).
        is_engine_failure: Decides whether a returned sample is re-run (default
            :func:`engine_failed`).
        filter_value: What the dynamic filter compares within a group, per sample (default
            the reward; e.g. correctness, DAPO's ``acc``).

    Example::

        manager = RolloutManager(episode, group_reward, router, RolloutManagerConfig(
            dynamic_filter=True, over_sampling_batch_size=12))
        loop = GRPOLoop(config, trainer, prompts, manager.generate, keep_rewards, ...)
        manager.prompt_source = loop.data.next
    """

    def __init__(
        self,
        episode: EpisodeFn,
        reward: GroupRewardFn,
        router: Router,
        config: RolloutManagerConfig | None = None,
        *,
        prompt_source: PromptSource | None = None,
        is_engine_failure: Callable[[Any], bool] = engine_failed,
        filter_value: Callable[[Any], float] = lambda sample: float(sample.reward),
    ) -> None:
        self.episode, self.reward, self.router = episode, reward, router
        self.filter_value = filter_value
        self.config = config or RolloutManagerConfig()
        self.prompt_source = prompt_source
        """Source of extra prompts (see the class docstring)."""
        self.is_engine_failure = is_engine_failure
        self.metrics: dict[str, float] = {}
        """``rollout/...`` scalars of the latest call."""
        self._num_groups = 0

    async def __call__(self, prompts: list[Any], n: int) -> list[Any]:
        """Same as :meth:`generate`."""
        return await self.generate(prompts, n)

    async def generate(self, prompts: list[Any], n: int) -> list[Any]:
        """Collect ``len(prompts)`` groups of ``n`` scored samples (see the module docstring).

        Returns:
            The kept groups' samples, group after group in submission order, rewards set,
            as a :class:`Rollout` carrying the call's metrics.

        Raises:
            ValueError: no prompts, ``n`` < 1, or ``n`` < 2 with the dynamic filter.
            RuntimeError: more prompts are needed but no ``prompt_source`` is set, or the
                filter kept too few groups within ``max_sampling_rounds`` (unless
                ``train_when_exhausted``).
            EpisodeFailedError: an episode failed on its engines ``max_retries`` + 1 times.
            RolloutTimeoutError: ``step_timeout`` passed.
        """
        cfg = self.config
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        if cfg.dynamic_filter and n < 2:
            raise ValueError(f"the dynamic filter needs n >= 2 samples per prompt, got {n}")
        num_engines = max(1, len(self.router.engines))
        limit = cfg.max_concurrency or cfg.max_concurrency_per_engine * num_engines
        run = _Run(n=n, target=len(prompts), semaphore=asyncio.Semaphore(limit))
        start = time.perf_counter()
        try:
            async with asyncio.timeout(cfg.step_timeout):
                samples = await self._collect(run, list(prompts))
        except TimeoutError as exc:
            raise RolloutTimeoutError(
                f"rollout kept {len(run.kept)} of {run.target} groups in {cfg.step_timeout}s "
                f"({len(run.pending())} groups still running, {run.retries} retries)"
            ) from exc
        finally:
            await self._stop(run)
            self.metrics = self._metrics(run, time.perf_counter() - start)
        return Rollout(samples, dict(self.metrics))

    # ------------------------------------------------------------------ scheduling
    def _more_prompts(self, count: int) -> list[Any]:
        if count == 0:
            return []
        if self.prompt_source is None:
            raise RuntimeError(
                "more prompts are needed (over-sampling or the dynamic filter) but the "
                "RolloutManager has no prompt_source"
            )
        prompts = list(self.prompt_source(count))
        if len(prompts) != count:
            raise RuntimeError(f"prompt_source gave {len(prompts)} prompts, asked for {count}")
        return prompts

    def _submit(self, run: _Run, prompts: list[Any]) -> None:
        run.rounds += 1
        for prompt in prompts:
            group = _Group(len(run.groups), f"g{self._num_groups}", prompt)
            self._num_groups += 1
            group.task = asyncio.get_running_loop().create_task(self._run_group(run, group))
            run.groups.append(group)

    async def _collect(self, run: _Run, prompts: list[Any]) -> list[Any]:
        per_round = self.config.over_sampling_batch_size or len(prompts)
        self._submit(run, prompts + self._more_prompts(max(0, per_round - len(prompts))))
        while len(run.kept) < run.target:
            pending = run.pending()
            if len(run.kept) + len(pending) < run.target:
                if run.rounds < self.config.max_sampling_rounds:
                    self._submit(run, self._more_prompts(per_round))
                    continue
                if not self.config.train_when_exhausted:
                    raise RuntimeError(
                        f"the dynamic filter kept {len(run.kept)} of {run.target} groups after "
                        f"{run.rounds} sampling rounds (max_sampling_rounds="
                        f"{self.config.max_sampling_rounds}); rewards are too uniform"
                    )
                if not pending:
                    run.exhausted = True
                    break
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for group in [g for g in run.groups if g.task in done]:
                assert group.task is not None
                self._judge(run, group, group.task.result())
        chosen = run.kept[: run.target] or run.dropped[: run.target]
        chosen = sorted(chosen, key=lambda kept: kept[0].index)
        return [sample for _, samples in chosen for sample in samples]

    def _judge(self, run: _Run, group: _Group, samples: list[Any]) -> None:
        run.judged += 1
        values = [self.filter_value(s) for s in samples]
        uniform = max(values) - min(values) <= 0.0
        run.uniform += uniform
        if self.config.dynamic_filter and uniform:
            run.filtered += 1
            if self.config.train_when_exhausted and len(run.dropped) < run.target:
                run.dropped.append((group, samples))
            return
        run.kept.append((group, samples))

    # ------------------------------------------------------------------ groups and episodes
    async def _run_group(self, run: _Run, group: _Group) -> list[Any]:
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._run_episode(run, group, i)) for i in range(run.n)]
        except ExceptionGroup as errors:  # the first episode's error, not a wrapper
            raise errors.exceptions[0] from None
        samples = [t.result() for t in tasks]
        if run.stopping:  # a leftover ended by the abort: not scored, not returned
            return samples
        rewards = list(await self.reward(samples))
        if len(rewards) != len(samples):
            raise RuntimeError(
                f"the reward function gave {len(rewards)} rewards for a group of {len(samples)}"
            )
        for sample, value in zip(samples, rewards, strict=True):
            if not math.isfinite(float(value)):
                raise ValueError(f"group {group.group_id}: reward {value!r} is not finite")
            sample.reward = float(value)
        return samples

    async def _run_episode(self, run: _Run, group: _Group, index: int) -> Any:
        last = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                run.retries += 1
                await asyncio.sleep(self.config.retry_backoff)
            session_id = f"{group.group_id}-s{index}-a{attempt}"
            async with run.semaphore:
                run.live.add(session_id)
                try:
                    sample = await self.episode(group.prompt, index, group.group_id, session_id)
                except ENGINE_ERRORS as exc:
                    if run.stopping:
                        raise
                    last = f"{type(exc).__name__}: {exc}"
                    log.warning(
                        "episode %s failed on its engine (%s); re-running", session_id, last
                    )
                    continue
                finally:
                    run.live.discard(session_id)
            self._check_group_id(sample, group.group_id)
            if run.stopping or not self.is_engine_failure(sample):
                return sample
            metadata = getattr(sample, "metadata", None)
            error = metadata.get("error", "") if isinstance(metadata, dict) else ""
            last = f"status {getattr(sample, 'status', '?')} {error}".strip()
        raise EpisodeFailedError(
            f"episode {index} of group {group.group_id} failed on its engine "
            f"{self.config.max_retries + 1} times; last: {last}"
        )

    @staticmethod
    def _check_group_id(sample: Any, group_id: str) -> None:
        current = getattr(sample, "group_id", None)
        if current is None:
            sample.group_id = group_id
        elif current != group_id:
            raise ValueError(f"episode returned group_id {current!r}, expected {group_id!r}")

    # ------------------------------------------------------------------ leftovers
    async def _stop(self, run: _Run) -> None:
        """Abort running episodes through the router (confirmed drain), cancel the rest."""
        run.stopping = True
        run.leftover_groups = len(run.pending())
        sessions = sorted(run.live)
        results = await asyncio.gather(
            *(
                self.router.abort(session_id=s, drain_timeout=self.config.drain_timeout)
                for s in sessions
            ),
            return_exceptions=True,
        )
        for session, result in zip(sessions, results, strict=True):
            if isinstance(result, DrainTimeoutError):
                run.undrained += len(result.pending)
                log.warning("abort of session %s not drained: %s", session, result)
            elif isinstance(result, BaseException):
                run.undrained += 1
                log.warning("abort of session %s failed: %r", session, result)
        run.aborted = len(sessions)
        for g in run.groups:  # errors of groups finished after the step's failure: seen
            if g.task is not None and g.task.done() and not g.task.cancelled():
                g.task.exception()
        leftovers = run.pending()
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    @staticmethod
    def _metrics(run: _Run, seconds: float) -> dict[str, float]:
        kept = min(len(run.kept), run.target)
        return {
            "rollout/groups_submitted": float(len(run.groups)),
            "rollout/groups_generated": float(run.judged),
            "rollout/groups_kept": float(kept),
            "rollout/groups_uniform": float(run.uniform),
            "rollout/groups_filtered": float(run.filtered),
            "rollout/groups_surplus": float(len(run.kept) - kept),
            "rollout/groups_leftover": float(run.leftover_groups),
            "rollout/sampling_rounds": float(run.rounds),
            "rollout/filter_exhausted": float(run.exhausted),
            "rollout/aborted_episodes": float(run.aborted),
            "rollout/undrained_aborts": float(run.undrained),
            "rollout/episode_retries": float(run.retries),
            "rollout/manager_s": seconds,
        }


async def keep_rewards(samples: list[Any]) -> list[float]:
    """A ``GRPOLoop`` reward hook that keeps the rewards the manager already set."""
    return [float(s.reward) for s in samples]
