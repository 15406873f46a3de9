"""A generic async multi-turn rollout: engine + environment + chat template -> Trajectory.

One episode::

    messages = env.reset(task)                       # system prompt, first user message
    loop:
        ids -> engine.generate -> the model's turn   # mask 1, the engine's logprobs
        parse <tool_call> blocks -> assistant message with OpenAI ``tool_calls``
        env.step(assistant) -> observations, done    # tool results, user reply
        observations -> chat-template delta          # mask 0

Statuses: ``completed`` when the environment says done (or after too many consecutive
invalid tool calls, ``end_reason`` says which); ``truncated`` when turns or context run
out; ``aborted`` when the engine answers ``finish_reason="abort"``; ``failed`` when
anything raises (a user simulator that gave up, an environment bug, an engine error) —
the reason goes to ``metadata["error"]`` and the run goes on.

:func:`run_episodes` runs many episodes with at most ``max_inflight`` at once (vime's
``TAU_MAX_INFLIGHT``); each episode gets its own environment from a factory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import Environment, Message, SamplingParams, TokenEngine
from turnrl.tool_envs.tool_calls import parse_tool_calls, to_openai_tool_calls
from turnrl.tool_envs.trajectory import (
    ContextOverflowError,
    Status,
    Trajectory,
    TrajectoryBuilder,
    TrajectoryLimits,
)


@dataclass
class RolloutConfig:
    """How episodes are generated."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling settings; ``max_tokens`` is lowered per turn to the turn budget, and the chat
    tokenizer's end-of-turn ids are used when ``stop_token_ids`` is empty."""
    limits: TrajectoryLimits = field(default_factory=TrajectoryLimits)
    """Context, per-turn, max-turns (``TAU_MAX_TURNS``) and tool-output limits, prefix check."""
    max_consecutive_invalid_turns: int = 3
    """End the episode after this many turns in a row with an invalid tool call."""
    max_inflight: int = 8
    """Most episodes in flight at once in :func:`run_episodes` (``TAU_MAX_INFLIGHT``)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables, e.g. ``{"enable_thinking": False}``."""

    def __post_init__(self) -> None:
        if self.max_consecutive_invalid_turns < 1:
            raise ValueError(
                f"max_consecutive_invalid_turns must be >= 1, got {self.max_consecutive_invalid_turns}"
            )
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")

    @classmethod
    def from_env(cls, **kwargs: Any) -> RolloutConfig:
        """A config whose ``max_turns`` / ``max_inflight`` come from vime's ``TAU_MAX_TURNS`` /
        ``TAU_MAX_INFLIGHT`` when those variables are set (they win over ``kwargs``)."""
        config = cls(**kwargs)
        turns = env_int("TAU_MAX_TURNS")
        if turns is not None:
            config.limits = dataclasses.replace(config.limits, max_turns=turns)
        inflight = env_int("TAU_MAX_INFLIGHT")
        if inflight is not None:
            config = dataclasses.replace(config, max_inflight=inflight)
        return config


def env_int(name: str) -> int | None:
    """An integer environment variable, None when unset; ``ValueError`` naming it when bad."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _invalid_calls(step_info: dict[str, Any], parse_errors: list[str]) -> int:
    """Invalid calls of a turn: parse errors plus those the environment rejected."""
    reported = step_info.get("num_invalid_tool_calls", 0)
    return len(parse_errors) + (reported if isinstance(reported, int) else 0)


class _Episode:
    """The state of one running episode (kept small so run_episode reads top to bottom)."""

    def __init__(self, config: RolloutConfig, chat: ChatTokenizer) -> None:
        self.config, self.chat = config, chat
        self.builder: TrajectoryBuilder | None = None
        self.timings = {"generate": 0.0, "env": 0.0, "user": 0.0}
        self.num_tool_calls = 0
        self.num_invalid = 0
        self.consecutive_invalid = 0
        self.info: dict[str, Any] = {}

    def sampling(self, budget: int) -> SamplingParams:
        base = self.config.sampling
        return dataclasses.replace(
            base,
            max_tokens=min(base.max_tokens, budget),
            stop=list(base.stop),
            stop_token_ids=list(base.stop_token_ids or self.chat.stop_token_ids),
        )

    def record_turn(self, parse_errors: list[str], num_calls: int, info: dict[str, Any]) -> None:
        invalid = _invalid_calls(info, parse_errors)
        self.num_tool_calls += num_calls + len(parse_errors)
        self.num_invalid += invalid
        self.consecutive_invalid = self.consecutive_invalid + 1 if invalid else 0
        self.info = info


async def run_episode(
    engine: TokenEngine,
    env: Environment,
    chat: ChatTokenizer,
    task: Any,
    config: RolloutConfig | None = None,
    *,
    group_id: str | None = None,
    sample_index: int = 0,
    session_id: str | None = None,
) -> Trajectory:
    """Run one episode of ``task`` in ``env`` with ``engine``; never raises for episode errors.

    Args:
        engine: Token-in/token-out engine (or router).
        env: A fresh environment for this episode.
        chat: The policy model's tokenizer and chat template.
        task: Whatever ``env.reset`` takes.
        config: Sampling, limits and caps.
        group_id: GRPO group of this sample.
        sample_index: Index of the sample within its group.
        session_id: Sticky-session key for the engine router (defaults to group/sample).
    """
    config = config or RolloutConfig()
    episode = _Episode(config, chat)
    start = time.perf_counter()
    session = session_id or f"{group_id or 'episode'}-{sample_index}-{id(episode):x}"
    status: Status = "completed"
    reason, extra = "done", {}
    try:
        status, reason = await _loop(engine, env, chat, task, episode, session)
    except ContextOverflowError as exc:
        status, reason, extra = "truncated", "prompt_too_long", {"error": str(exc)}
    except Exception as exc:  # one broken episode must not end the run
        status, reason = "failed", "exception"
        extra = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    total = episode.timings["total"] = time.perf_counter() - start
    episode.timings["agent"] = max(
        0.0, total - episode.timings["generate"] - episode.timings["env"]
    )
    fields: dict[str, Any] = dict(
        num_tool_calls=episode.num_tool_calls,
        num_invalid_tool_calls=episode.num_invalid,
        timings=episode.timings,
        group_id=group_id,
        sample_index=sample_index,
        metadata={**extra, "env_info": episode.info},
    )
    if episode.builder is None:  # reset or the first render failed: an empty trajectory
        metadata = {**fields.pop("metadata"), "end_reason": reason}
        return Trajectory([], [], [], [], status=status, metadata=metadata, **fields)
    return episode.builder.finish(status, reason, **fields)


async def _loop(
    engine: TokenEngine,
    env: Environment,
    chat: ChatTokenizer,
    task: Any,
    episode: _Episode,
    session: str,
) -> tuple[Status, str]:
    config = episode.config
    t0 = time.perf_counter()
    first = await env.reset(task)
    episode.timings["env"] += time.perf_counter() - t0
    builder = TrajectoryBuilder(chat, first, env.tools, config.limits, config.template_kwargs)
    episode.builder = builder
    while True:
        if builder.num_turns >= config.limits.max_turns:
            return "truncated", "max_turns"
        budget = builder.turn_budget()
        if budget <= 0:
            return "truncated", "context"
        t0 = time.perf_counter()
        generation = await engine.generate(builder.ids, episode.sampling(budget), session)
        episode.timings["generate"] += time.perf_counter() - t0
        text = builder.add_generation(generation)
        parsed = parse_tool_calls(text)
        assistant: Message = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            assistant["tool_calls"] = to_openai_tool_calls(parsed.tool_calls)
        builder.add_message(assistant)
        if generation.finish_reason == "abort":
            return "aborted", "abort"
        if generation.finish_reason == "length":
            return "truncated", "context" if builder.turn_budget() == 0 else "turn_length"
        t0 = time.perf_counter()
        result = await env.step({**assistant, "tool_call_errors": list(parsed.errors)})
        episode.timings["env"] += time.perf_counter() - t0
        episode.timings["user"] += float(result.info.get("user_s", 0.0))
        episode.record_turn(parsed.errors, len(parsed.tool_calls), result.info)
        if result.done:
            builder.messages.extend(dict(m) for m in result.observations)
            return "completed", "done"
        if episode.consecutive_invalid >= config.max_consecutive_invalid_turns:
            return "completed", "max_invalid_tool_calls"
        if not result.observations:
            raise RuntimeError("environment returned no observations and done=False")
        if not builder.add_observations(result.observations):
            return "truncated", "context"


@dataclass
class EpisodeRequest:
    """One episode to run: a task and its place in a GRPO group."""

    task: Any
    """Whatever the environment's ``reset`` takes."""
    group_id: str | None = None
    """GRPO group (normally one per task)."""
    sample_index: int = 0
    """Index within the group."""


def group_requests(
    tasks: Sequence[Any], samples_per_task: int, group_ids: Sequence[str] | None = None
) -> list[EpisodeRequest]:
    """``samples_per_task`` requests per task, grouped (``--n-samples-per-prompt``)."""
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task must be >= 1, got {samples_per_task}")
    if group_ids is not None and len(group_ids) != len(tasks):
        raise ValueError(f"{len(group_ids)} group ids for {len(tasks)} tasks")
    ids = list(group_ids) if group_ids is not None else [f"group-{i}" for i in range(len(tasks))]
    return [
        EpisodeRequest(task, gid, k)
        for task, gid in zip(tasks, ids, strict=True)
        for k in range(samples_per_task)
    ]


async def run_episodes(
    engine: TokenEngine,
    env_factory: Callable[[], Environment],
    chat: ChatTokenizer,
    requests: Sequence[EpisodeRequest],
    config: RolloutConfig | None = None,
) -> list[Trajectory]:
    """Run many episodes, at most ``config.max_inflight`` at once; results in request order.

    A failure to build an environment fails that episode only (status ``failed``).
    """
    config = config or RolloutConfig()
    gate = asyncio.Semaphore(config.max_inflight)

    async def one(request: EpisodeRequest) -> Trajectory:
        async with gate:
            try:
                env = env_factory()
            except Exception as exc:
                return Trajectory(
                    [],
                    [],
                    [],
                    [],
                    status="failed",
                    group_id=request.group_id,
                    sample_index=request.sample_index,
                    metadata={
                        "end_reason": "exception",
                        "error": f"env_factory: {type(exc).__name__}: {exc}",
                    },
                )
            return await run_episode(
                engine,
                env,
                chat,
                request.task,
                config,
                group_id=request.group_id,
                sample_index=request.sample_index,
            )

    return list(await asyncio.gather(*(one(r) for r in requests)))
