"""``uv run apps/agent``: GRPO on any agent program, through the agent gateway.

Phases: tasks (``--tasks``), then grpo-core's ``recipe.stages.run_stages`` with the app's
part (:mod:`turnrl_app_agent.stages`): policy model -> engines started while SFT warms up on
the ``--sft-data`` conversations -> evaluation of the held-out tasks -> GRPO steps (one
gateway session per sample, the agent run against it) -> evaluation again; then
``recipe.report.report_run``. ``eval`` runs only the evaluation; ``audit`` replays a run's
saved trajectories through the trainer (:mod:`turnrl_app_agent.audit`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.driver import open_run, run_main
from turnrl.grpo_core.recipe.report import report_run
from turnrl.grpo_core.recipe.stages import run_stages
from turnrl.npu_runtime.supervise import install_signal_handlers
from turnrl_app_agent import audit
from turnrl_app_agent.agents import load_agent, load_tasks
from turnrl_app_agent.cli import resolve
from turnrl_app_agent.config import AgentAppConfig
from turnrl_app_agent.stages import AgentStages, console


def check_supported(config: AgentAppConfig) -> None:
    """Refuse, with the reason, what this app cannot run (the agent is loaded here, so a bad
    ``--agent`` fails before any model is built).

    Raises:
        ValueError: no agent or tasks, an agent that cannot be loaded, or a setting the
            run would ignore.
    """
    load_agent(config.agent)
    if not config.agent.tasks:
        raise ValueError("no tasks: give --tasks file.jsonl (one JSON object a line)")
    schema.check_schema(config, schema.refusals(config))


async def run(command: str, config: AgentAppConfig, resume: bool = False) -> dict[str, Any]:
    """Run ``train`` or ``eval``; returns the summary (also written to summary.json)."""
    check_supported(config)
    threads = config.model.torch_threads
    with open_run("agent", config, resume=resume, console=console, torch_threads=threads) as this:
        console.print(
            f"run folder: [bold]{this.folder}[/bold]  preset: {config.preset}  command: "
            f"{command}" + ("  (resumed)" if resume else "")
        )
        with this.phases("data"):
            tasks = load_tasks(config.agent, config.seed)
            console.print(f"tasks: {len(tasks[0])} train / {len(tasks[1])} held-out")
        stages = AgentStages(this.config, tasks, this.logger)
        result = await run_stages(this, stages, train=command == "train")
        return report_run(
            this,
            result,
            title=f"agent held-out evaluation ({config.preset})",
            score="agent reward",
            command=command,
            num_eval_tasks=len(tasks[1] or tasks[0]),
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["audit"]:
        return audit_main(args[1:])
    install_signal_handlers()  # engines start from a worker thread: handlers in the main one

    def prepare(default_dir: str) -> tuple[str, Coroutine[Any, Any, Any]]:
        invocation = resolve(argv)
        run_dir = invocation.config.run_dir or default_dir
        config = dataclasses.replace(invocation.config, run_dir=run_dir)
        return run_dir, run(invocation.command, config, invocation.resume)

    return run_main("agent", prepare)


def audit_main(argv: Sequence[str]) -> int:
    """``apps/agent audit --run-dir DIR [--step N]``; returns the process exit code."""
    args = audit.build_parser().parse_args(list(argv))

    async def work() -> dict[str, Any]:
        return audit.run_audit(args.run_dir, args.step, console)

    return run_main("agent", lambda _: (str(args.run_dir), work()))


if __name__ == "__main__":
    sys.exit(main())
