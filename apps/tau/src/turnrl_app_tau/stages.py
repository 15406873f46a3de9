"""What the tau app gives grpo-core's ``recipe.stages.run_stages``.

- SFT data: every training task's gold conversation (``turnrl.tool_envs.tau.data``), with
  other synthetic stores'; the probe stop on a store SFT never sees (synthetic) or the last
  training conversations (the short-prefix curriculum first: the ``sft`` section's).
- Engines: ``schema.engine_spec``; playing tau2 telecom's user they also parse tool calls.
- While the engines serve: held-out evaluation (task reward, pass^k, shaped reward) and the
  rollout: episodes with the user simulator under grpo-core's ``RolloutManager`` (groups
  scored as they finish, a dead engine's episodes re-run, leftovers aborted), or the
  ``--custom-generate-function-path`` hook.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from turnrl.grpo_core.loop import RolloutManager, RolloutManagerConfig, keep_rewards, load_function
from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.evaluation import evaluation_record, rerun_engine_failures
from turnrl.grpo_core.recipe.stages import Rollout, SFTData
from turnrl.rollout_router.engine import EngineSpec
from turnrl.rollout_router.router import Router
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams
from turnrl.tool_envs.rollout import RolloutConfig
from turnrl.tool_envs.tau import Task
from turnrl.tool_envs.tau.data import (
    TaskData,
    engine_args,
    extra_store_conversations,
    judge,
    store_conversations,
    user_factory,
)
from turnrl.tool_envs.tau.episodes import REWARDS, TauEpisodes, score
from turnrl.tool_envs.trajectory import Trajectory, TrajectoryLimits
from turnrl_app_tau.config import TauAppConfig

console = Console(highlight=False)


def rollout_config(
    config: TauAppConfig, temperature: float | None = None, max_inflight: int | None = None
) -> RolloutConfig:
    """The episode settings from the app config."""
    r = config.rollout
    return RolloutConfig(
        sampling=SamplingParams(
            temperature=r.rollout_temperature if temperature is None else temperature,
            max_tokens=r.rollout_max_response_len,
        ),
        limits=TrajectoryLimits(
            max_context_tokens=r.rollout_max_context_len,
            max_turn_tokens=r.rollout_max_response_len,
            max_turns=r.max_turns,
        ),
        max_inflight=max_inflight or r.max_inflight,
    )


async def evaluate(
    episodes: TauEpisodes, tasks: Sequence[Task], trials: int, config: RolloutConfig
) -> dict[str, Any]:
    """Every task ``trials`` times: ``recipe.evaluation.evaluation_record`` of tau-bench's 0/1
    task reward (database hash and required outputs), with the shaped training reward
    (task reward plus tool-call bonuses, before the group normalisation) and pass^k.

    Raises:
        ValueError: ``trials`` < 1.
        RuntimeError: every episode failed (the first error named).
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    start = time.perf_counter()
    items = [(task, f"eval-{i}", t) for i, task in enumerate(tasks) for t in range(trials)]
    trajs, reruns = await rerun_engine_failures(
        await episodes.run(items, config), lambda i: episodes.episode(*items[i], config)
    )
    by_task = [trajs[i : i + trials] for i in range(0, len(trajs), trials)]

    def scores(traj: Trajectory) -> dict[str, float]:
        shaped, task = score(traj, shaped=True)
        return {"score": task, "shaped_reward": shaped}

    return evaluation_record({"tau": by_task}, scores, time.perf_counter() - start, reruns)


def engine_spec(config: TauAppConfig, model: Path) -> EngineSpec:
    """One inference engine serving ``model`` (``turnrl.grpo_core.recipe.schema``)."""
    extra = engine_args(config.tau, config.engine.extra_args)
    spec: EngineSpec = schema.engine_spec(
        config, model, config.rollout.rollout_max_context_len, extra
    )
    return spec


def sampling(config: TauAppConfig) -> dict[str, float]:
    """The rollouts' sampling, which the trainer's log-probs follow."""
    return {"temperature": config.rollout.rollout_temperature}


class TauStages:
    """The tau app's part of a run (``recipe.stages.App``)."""

    def __init__(
        self, config: TauAppConfig, data: TaskData, tools: list[dict[str, Any]], logger: Any
    ) -> None:
        self.config, self.data, self.tools, self.logger = config, data, tools, logger
        self.max_positions = max(4096, config.rollout.rollout_max_context_len)
        self.sampling = sampling(config)
        self.rl_enabled = True

    def sft_data(self) -> SFTData | None:
        """Gold conversations of the training tasks (and of other synthetic stores)."""
        t, sft, data = self.config.tau, self.config.sft, self.data
        if not data.train:
            return None
        chats = [data.conversation(task) for task in data.train] if t.sft_train_tasks else []
        if t.sft_extra_stores:  # synthetic only (TauSettings)
            chats += extra_store_conversations(t, t.sft_extra_stores)
        probe: list[list[dict[str, Any]]] = []
        if sft.probe_target:
            if t.domain == "synthetic":  # a store SFT never sees
                probe = store_conversations(t, t.sft_extra_stores + 1)[: sft.probe_size]
            else:  # the last training conversations, left out of SFT
                chats, probe = chats[: -sft.probe_size], chats[-sft.probe_size :]
        return SFTData(chats, probe, self.tools)

    def engine_spec(self, model: Path) -> EngineSpec:
        return engine_spec(self.config, model)

    @contextlib.asynccontextmanager
    async def serving(
        self, policy: Path, urls: list[str], router: Router
    ) -> AsyncIterator[TauServing]:
        episodes = TauEpisodes(
            router,
            ChatTokenizer.from_dir(policy),
            self.data.domain,
            self.tools,
            rollout_config(self.config),
            user_factory(self.config.tau, urls),
            judge=judge(self.config.tau, urls),
        )
        yield TauServing(self.config, self.data, episodes, router, self.logger)


class TauServing:
    """Held-out evaluation and the rollout over the engines (``recipe.stages.Serving``)."""

    def __init__(
        self,
        config: TauAppConfig,
        data: TaskData,
        episodes: TauEpisodes,
        router: Router,
        logger: Any,
    ) -> None:
        self.config, self.data, self.episodes = config, data, episodes
        self.router, self.logger = router, logger

    async def evaluate(self, step: int) -> dict[str, Any]:
        t = self.config.tau
        settings = rollout_config(self.config, t.eval_temperature, t.eval_concurrency)
        tasks = self.data.heldout or self.data.train
        record = await evaluate(self.episodes, tasks, t.eval_trials, settings)
        if record["failed"]:
            console.print(
                f"[red]{record['failed']:.0%} of the episodes failed, e.g.: {record['error']}[/red]"
            )
        return record

    def rollout(self) -> Rollout:
        """Episodes under a ``RolloutManager`` (or the custom hook); two of each step's
        episodes are logged as text."""
        r, episodes = self.config.rollout, self.episodes
        reward = load_function(r.custom_rm_path) if r.custom_rm_path else REWARDS[r.tau_reward]
        if r.custom_generate_function_path:  # the hook rolls out; the loop scores its samples
            generate = load_function(r.custom_generate_function_path)
        else:  # groups scored as they finish, dead engines' episodes re-run, leftovers aborted
            manager = RolloutManager(
                lambda task, index, group, session: episodes.episode(
                    task, group, index, None, session
                ),
                reward,
                self.router,
                RolloutManagerConfig(max_concurrency=r.max_inflight),
            )
            generate, reward = manager.generate, keep_rewards
        shown: list[Any] = []

        async def generate_and_keep(prompts: list[Any], n: int) -> list[Any]:
            samples = await generate(prompts, n)
            shown[:] = [s for s in samples[:2] if isinstance(s, Trajectory)]  # a hook's may not be
            return samples

        def on_step(step: int, metrics: dict[str, float]) -> None:
            if shown:
                self.logger.log_samples(step, [t.text() for t in shown])

        return Rollout(self.data.train, generate_and_keep, reward, on_step)
