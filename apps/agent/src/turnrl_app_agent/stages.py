"""What the agent app gives grpo-core's ``recipe.stages.run_stages``.

While the engines serve, two gateways (``turnrl.tool_envs.gateway``: rollout and evaluation
sampling) listen on free ports in this process over the stages' router. One episode is one
gateway session: opened, the agent run against its endpoint, finished with the agent's
reward, exported and closed; the export becomes a :class:`Trajectory` (:func:`to_trajectory`).
Rollout: episodes under grpo-core's ``RolloutManager``; evaluation: the held-out tasks at the
evaluation temperature, ``recipe.evaluation.evaluation_record`` of the agent's reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from rich.console import Console

from turnrl.grpo_core.loop import RolloutManager, RolloutManagerConfig, keep_rewards
from turnrl.grpo_core.loop.rollout_manager import ENGINE_ERRORS
from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.evaluation import evaluation_record, rerun_engine_failures
from turnrl.grpo_core.recipe.stages import Rollout, SFTData
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.engine import EngineSpec
from turnrl.rollout_router.router import Router
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.gateway.service import Gateway
from turnrl.tool_envs.protocol import Generation, SamplingParams
from turnrl.tool_envs.trajectory import Trajectory
from turnrl_app_agent.agents import Agent, Endpoint, load_agent, load_callable
from turnrl_app_agent.audit import save_rollout
from turnrl_app_agent.config import AgentAppConfig

console = Console(highlight=False)
MODEL_NAME = "policy"


def to_trajectory(
    session: dict[str, Any], agent_error: str | None, group_id: str | None = None, index: int = 0
) -> Trajectory:
    """One exported gateway session as a trajectory: its single chain's ids, loss mask and
    rollout log-probs, the agent's reward. A failed session (a lost call: its engine error
    first, so the manager re-runs it), a failed agent, no call, several chains (v1: forks are
    not trained) or no reward give a ``failed`` trajectory, its reason in ``metadata["error"]``.
    """
    rows, reason = session.get("rows") or [], session.get("reason") or ""
    error = None
    if session.get("status") == "failed":
        lost = reason.removeprefix("engine call lost: ")
        engine = lost.startswith(tuple(cls.__name__ for cls in ENGINE_ERRORS))
        error = lost if engine else f"LostCall: {reason}"
    elif agent_error:
        error = agent_error
    elif not rows:
        error = "NoModelCall: the agent never called the model"
    elif len(rows) > 1:
        forks = ", ".join(str(r["fork_reason"]) for r in rows[1:])
        error = f"ForkedSession: {len(rows)} chains (forks: {forks}); v1 trains one chain"
    elif session.get("reward") is None:
        error = "NoReward: the session finished without a reward"
    metadata: dict[str, Any] = {"session": session.get("id")}
    if error is not None:
        metadata["error"] = error
        return Trajectory(
            [],
            [],
            [],
            [],
            status="failed",
            metadata=metadata,
            group_id=group_id,
            sample_index=index,
        )
    row, n = rows[0], len(rows[0]["prompt_ids"])
    return Trajectory(
        list(row["prompt_ids"]),
        row["ids"][n:],
        row["loss_mask"][n:],
        row["logprobs"][n:],
        reward=float(session["reward"]),
        versions=row["versions"][n:],
        num_turns=int(row["calls"]),
        group_id=group_id,
        sample_index=index,
        metadata=metadata,
    )


class _Named:
    """The router, each gateway session's calls sent under its episode's session id (so the
    rollout manager can abort them)."""

    def __init__(self, router: Router) -> None:
        self.router, self.names = router, {}  # type: ignore[var-annotated]

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        name = self.names.get(session_id, session_id)
        return await self.router.generate(prompt_ids, sampling, session_id=name)


class GatewayEpisodes:
    """Episodes of one agent through a gateway served at ``url``."""

    def __init__(
        self, agent: Agent, url: str, engine: _Named, timeout: float, keep_rows: bool = False
    ) -> None:
        self.agent, self.url, self.engine, self.timeout = agent, url, engine, timeout
        self.keep_rows = keep_rows
        """Put the export's rows in each trajectory's ``metadata["rows"]`` (saved by the
        rollout, :func:`turnrl_app_agent.audit.save_rollout`)."""

    async def episode(
        self, task: dict[str, Any], group: str, index: int, name: str | None = None
    ) -> Trajectory:
        """One agent run in its own gateway session; ``name`` the engine session id."""
        async with aiohttp.ClientSession(base_url=self.url) as http:
            async with http.post("/episodes", json={"group_size": 1}) as response:
                opened = await response.json()
            s = opened["sessions"][0]
            self.engine.names[s["id"]] = name or s["id"]
            endpoint = Endpoint(s["base_url"], s["key"], s["anthropic_base_url"], MODEL_NAME)
            error, body = None, {}
            try:
                body["reward"] = await asyncio.wait_for(self.agent(task, endpoint), self.timeout)
            except Exception as exc:
                error = f"AgentError: {type(exc).__name__}: {exc}"
            finally:
                async with http.post(f"/sessions/{s['id']}/finish", json=body) as response:
                    if response.status != 200 and error is None:  # e.g. a reward not a number
                        error = (
                            f"AgentError: reward {body.get('reward')!r}: {await response.text()}"
                        )
                async with http.get(f"/episodes/{opened['episode']}/export") as response:
                    session = (await response.json())["sessions"][0]
                await http.delete(f"/episodes/{opened['episode']}")
                self.engine.names.pop(s["id"], None)
        traj = to_trajectory(session, error, group, index)
        if self.keep_rows:
            traj.metadata["rows"] = session.get("rows") or []
        return traj


@contextlib.asynccontextmanager
async def gateway(
    engine: _Named, chat: ChatTokenizer, sampling: SamplingParams, context: int
) -> AsyncIterator[str]:
    """A :class:`Gateway` served on a free local port; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app = Gateway(
        engine, chat, sampling, max_context_tokens=context, model_name=MODEL_NAME, base_url=url
    ).app()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield url
    finally:
        await runner.cleanup()


class AgentStages:
    """The agent app's part of a run (``recipe.stages.App``)."""

    def __init__(
        self,
        config: AgentAppConfig,
        tasks: tuple[list[dict[str, Any]], list[dict[str, Any]]],
        logger: Any,
    ) -> None:
        self.config, (self.train, self.heldout), self.logger = config, tasks, logger
        self.agent = load_agent(config.agent)
        self.max_positions = max(4096, config.rollout.rollout_max_context_len)
        self.sampling = {"temperature": config.rollout.rollout_temperature}
        self.rl_enabled = True

    def sft_data(self) -> SFTData | None:
        """The ``--sft-data`` function's conversations (None without it)."""
        a, sft = self.config.agent, self.config.sft
        if not a.sft_data:
            return None
        data = load_callable(a.sft_data, "--sft-data")(self.train + self.heldout)
        probe = list(data.get("probe", ()))[: sft.probe_size] if sft.probe_target else []
        return SFTData(data["chats"], probe, data.get("tools"))

    def engine_spec(self, model: Path) -> EngineSpec:
        r, extra = self.config.rollout, self.config.engine.extra_args
        spec: EngineSpec = schema.engine_spec(self.config, model, r.rollout_max_context_len, extra)
        return spec

    @contextlib.asynccontextmanager
    async def serving(
        self, policy: Path, urls: list[str], router: Router
    ) -> AsyncIterator[AgentServing]:
        r, chat, engine = self.config.rollout, ChatTokenizer.from_dir(policy), _Named(router)
        train = SamplingParams(
            temperature=r.rollout_temperature, max_tokens=r.rollout_max_response_len
        )
        evaluation = replace(train, temperature=self.config.agent.eval_temperature)
        timeout, keep = self.config.agent.agent_timeout, self.config.agent.save_trajectories
        async with (
            gateway(engine, chat, train, r.rollout_max_context_len) as train_url,
            gateway(engine, chat, evaluation, r.rollout_max_context_len) as eval_url,
        ):
            yield AgentServing(
                self,
                GatewayEpisodes(self.agent, train_url, engine, timeout, keep_rows=keep),
                GatewayEpisodes(self.agent, eval_url, engine, timeout),
                router,
                sampling=train,
            )


class AgentServing:
    """Held-out evaluation and the rollout over the gateways (``recipe.stages.Serving``)."""

    def __init__(
        self,
        stages: AgentStages,
        train: GatewayEpisodes,
        evaluation: GatewayEpisodes,
        router: Router,
        sampling: SamplingParams | None = None,
    ) -> None:
        self.stages, self.train, self.evaluation, self.router = stages, train, evaluation, router
        self.sampling = sampling or SamplingParams()
        """The rollouts' sampling (recorded with the saved trajectories)."""

    async def evaluate(self, step: int) -> dict[str, Any]:
        a = self.stages.config.agent
        tasks: Sequence[dict[str, Any]] = self.stages.heldout or self.stages.train
        items = [
            (task, f"eval-{i}", t) for i, task in enumerate(tasks) for t in range(a.eval_trials)
        ]
        gate = asyncio.Semaphore(a.eval_concurrency)

        async def one(i: int) -> Trajectory:
            async with gate:
                return await self.evaluation.episode(*items[i])

        start = time.perf_counter()
        trajs, reruns = await rerun_engine_failures(
            await asyncio.gather(*map(one, range(len(items)))), one
        )
        by_task = [trajs[i : i + a.eval_trials] for i in range(0, len(trajs), a.eval_trials)]
        record = evaluation_record(
            {"agent": by_task}, lambda t: {"score": t.reward}, time.perf_counter() - start, reruns
        )
        if record["failed"]:
            console.print(
                f"[red]{record['failed']:.0%} of the episodes failed, e.g.: {record['error']}[/red]"
            )
        return record

    def rollout(self) -> Rollout:
        """Every sample one agent run in its own session, under a ``RolloutManager``; with
        ``--save-trajectories`` each rollout's exports go to the run folder, tagged with the
        weight version the engines served when it started."""
        episodes, r = self.train, self.stages.config.rollout
        manager = RolloutManager(
            lambda task, index, group, session: episodes.episode(task, group, index, session),
            keep_rewards,
            self.router,
            RolloutManagerConfig(max_concurrency=r.max_inflight),
        )
        if not episodes.keep_rows:
            return Rollout(self.stages.train, manager.generate, keep_rewards)
        loops: list[Any] = []

        async def generate(prompts: list[Any], n: int) -> Any:
            loop = loops[0] if loops else None
            version = int(getattr(loop, "weight_version", getattr(loop, "step", 0)))
            samples = await manager.generate(prompts, n)
            save_rollout(Path(self.stages.config.run_dir or "."), version, self.sampling, samples)
            return samples

        return Rollout(self.stages.train, generate, keep_rewards, on_loop=loops.append)
