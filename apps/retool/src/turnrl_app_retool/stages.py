"""What the ReTool app gives grpo-core's ``recipe.stages.run_stages``.

- SFT data: the ReTool-SFT chats (or generated ones) and the probe chats SFT never sees.
- Engines: ``schema.engine_spec`` for prompt + response tokens, seeded by ``--seed``.
- While the engines serve, the code sandbox (``--sandbox-url``, or turnrl's embedded one)
  runs the model's code; :class:`RetoolServing` evaluates every validation set (accuracy
  mean@k, pass^k, turns) and rolls out GRPO, or DAPO when the config asks: each step's groups
  (``rollout_batch_size`` prompts, or with dynamic sampling rounds of ``gen_batch_size``
  more until enough groups vary, ``turnrl.tool_envs.retool.dapo``) run as episodes with the sandbox
  under grpo-core's ``RolloutManager``, scored as they finish (ReTool's reward, plus DAPO's
  overlong penalty when ``rl.overlong_buffer_len > 0``); a dead engine's episodes re-run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from turnrl.grpo_core.loop import RolloutManager, RolloutManagerConfig, keep_rewards
from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.evaluation import rerun_engine_failures
from turnrl.grpo_core.recipe.stages import Rollout, SFTData
from turnrl.rollout_router.engine import EngineSpec
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.retool.dapo import StepStats, filter_value, group_reward, overlong_config
from turnrl.tool_envs.retool.env import CODE_INTERPRETER
from turnrl.tool_envs.retool.episodes import generations_text, run_task, run_tasks
from turnrl_app_retool.config import RetoolAppConfig
from turnrl_app_retool.data import Datasets
from turnrl_app_retool.episodes import episode_settings, validation_record


def sampling(config: RetoolAppConfig) -> dict[str, float]:
    """The rollouts' sampling, which the trainer's log-probs follow."""
    return {"temperature": config.rl.temperature, "top_p": config.rl.top_p}


def engine_spec(config: RetoolAppConfig, model: Path) -> EngineSpec:
    """An engine of the run serving ``model`` (its port chosen where it starts)."""
    length = config.rl.max_prompt_length + config.rl.max_response_length
    spec: EngineSpec = schema.engine_spec(config, model, length, ["--seed", str(config.seed)])
    return spec


class RetoolStages:
    """The ReTool app's part of a run (``recipe.stages.App``)."""

    max_positions = 4096

    def __init__(self, config: RetoolAppConfig, datasets: Datasets, logger: Any) -> None:
        self.config, self.datasets, self.logger = config, datasets, logger
        self.sampling = sampling(config)
        self.rl_enabled = config.rl.enabled

    def sft_data(self) -> SFTData:
        tools = [CODE_INTERPRETER] if self.config.data.tool_schema_in_prompt else None
        return SFTData(self.datasets.sft_chats, self.datasets.probe_chats, tools)

    def engine_spec(self, model: Path) -> EngineSpec:
        return engine_spec(self.config, model)

    @contextlib.asynccontextmanager
    async def serving(self, policy: Path, urls: list[str], router: Any) -> AsyncIterator[Any]:
        with self.config.sandbox.client() as client:
            chat = ChatTokenizer.from_dir(policy)
            e = self.config.eval
            settings = episode_settings(self.config, chat, client, e.temperature, e.top_p)
            yield RetoolServing(self.config, self.datasets, settings, router, self.logger)


class RetoolServing:
    """Validation and the rollout over the engines (``recipe.stages.Serving``)."""

    def __init__(
        self,
        config: RetoolAppConfig,
        datasets: Datasets,
        settings: Any,
        router: Any,
        logger: Any,
    ) -> None:
        self.config, self.datasets, self.settings = config, datasets, settings
        self.router, self.logger = router, logger

    async def evaluate(self, step: int) -> dict[str, Any]:
        """Every validation set, ``eval.n`` samples a problem (``episodes.validation_record``);
        a few generations of each logged as text."""
        start, episodes, reruns, n = time.perf_counter(), {}, 0, self.config.eval.n
        for source, tasks in self.datasets.val.items():
            prefix = f"val-{source}"

            async def rerun(i: int, tasks: Any = tasks, prefix: str = prefix) -> Any:
                group = f"{prefix}-{i // n}"
                return await run_task(self.router, self.settings, tasks[i // n], group, i % n)

            trajs, again = await rerun_engine_failures(
                await run_tasks(self.router, self.settings, tasks, n, group_prefix=prefix), rerun
            )
            episodes[source], reruns = trajs, reruns + again
            text = generations_text(trajs, self.settings.chat)
            self.logger.log_samples(step, [text], f"val/{source}/generations")
        return validation_record(episodes, time.perf_counter() - start, reruns)

    def rollout(self) -> Rollout:
        """Episodes with the sandbox under a ``RolloutManager`` (DAPO's filter and extra
        rounds when asked); each step's metrics say what the filter did."""
        rl, router = self.config.rl, self.router
        sampling = replace(
            self.settings.rollout.sampling, temperature=rl.temperature, top_p=rl.top_p
        )
        settings = replace(self.settings, rollout=replace(self.settings.rollout, sampling=sampling))
        stats = StepStats()

        async def episode(task: Any, index: int, group: str, session: str) -> Any:
            return await run_task(router, settings, task, group, index, session)

        overlong = overlong_config(
            rl.max_response_length, rl.overlong_buffer_len, rl.overlong_penalty_factor
        )
        manager = RolloutManager(
            episode,
            group_reward(overlong, stats),
            router,
            RolloutManagerConfig(
                max_concurrency=rl.max_inflight,
                dynamic_filter=rl.dynamic_sampling,
                over_sampling_batch_size=rl.gen_batch_size if rl.dynamic_sampling else None,
                max_sampling_rounds=rl.max_num_gen_batches,
                train_when_exhausted=True,
            ),
            filter_value=filter_value(rl.filter_metric),
        )

        def on_step(step: int, metrics: dict[str, float]) -> None:
            metrics.update(stats.take())

        def draw_from(loop: Any) -> None:  # DAPO's extra rounds draw from the loop's data
            manager.prompt_source = loop.data.next

        extra_rounds = draw_from if rl.dynamic_sampling else None
        return Rollout(self.datasets.train, manager.generate, keep_rewards, on_step, extra_rounds)
