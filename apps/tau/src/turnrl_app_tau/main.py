"""``uv run apps/tau``: GRPO on tau-bench customer-service tasks (CPU by default).

Phases: data (synthetic mini-retail, tau-bench from ``--tau-bench-dir`` or tau2-bench from
``--tau2-dir``), then grpo-core's ``recipe.stages.run_stages`` with the app's part
(:mod:`turnrl_app_tau.stages`): policy model -> engines started in the background while SFT
warms up on gold conversations -> evaluation of the held-out tasks -> GRPO steps (episodes
with the user simulator under grpo-core's RolloutManager) -> evaluation again; then
``recipe.report.report_run``: the table, the verdict, summary.json and the curves. ``eval``
runs only the evaluation (pass^k with ``--num-trials`` and ``--max-concurrency``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from turnrl.grpo_core.loop import load_function
from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.driver import open_run, run_main
from turnrl.grpo_core.recipe.report import report_run
from turnrl.grpo_core.recipe.stages import run_stages
from turnrl.npu_runtime.supervise import install_signal_handlers
from turnrl.tool_envs.tau.data import load_tasks_and_domain, tool_schemas
from turnrl_app_tau.cli import resolve
from turnrl_app_tau.config import TauAppConfig
from turnrl_app_tau.stages import TauStages, console


def not_honoured(config: TauAppConfig) -> list[str]:
    """One line per setting the run would ignore (``schema.refusals``: the fields that say
    they are refused)."""
    return schema.refusals(config)


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
                    "turnrl.tool_envs.tau.episodes.batched_tau_rm)"
                ) from None
    schema.check_schema(config, not_honoured(config))


async def run(command: str, config: TauAppConfig, resume: bool = False) -> dict[str, Any]:
    """Run ``train`` or ``eval``; returns the summary (also written to summary.json).

    With ``resume``, phases an earlier run of the same folder finished are not redone: the
    base and SFT models are reused, the evaluation before RL is read from progress.json and
    GRPO continues from the latest checkpoint (``GRPOLoop.resume``).
    """
    check_supported(config)
    threads = config.model.torch_threads
    with open_run("tau", config, resume=resume, console=console, torch_threads=threads) as this:
        console.print(
            f"run folder: [bold]{this.folder}[/bold]  preset: {config.preset}  command: "
            f"{command}" + ("  (resumed)" if resume else "")
        )
        with this.phases("data"):
            data = load_tasks_and_domain(config.tau)
            r = config.rollout
            tools = tool_schemas(data, r.short_tools, r.tools_in_prompt)
            console.print(
                f"{data.source}: {len(data.train)} train / {len(data.heldout)} held-out tasks"
            )
        stages = TauStages(this.config, data, tools, this.logger)
        result = await run_stages(this, stages, train=command == "train")
        return report_run(
            this,
            result,
            title=f"tau held-out evaluation ({data.source}, {config.preset})",
            score="task reward",
            command=command,
            num_eval_tasks=len(data.heldout or data.train),
        )


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
