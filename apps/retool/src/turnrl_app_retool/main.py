"""`uv run apps/retool`: SFT, evaluate, GRPO with the code sandbox, evaluate again.

data   -> problems (generated, or DAPO-Math-17k) and SFT chats (generated, or ReTool-SFT)
then grpo-core's ``recipe.stages.run_stages`` with the app's part (:mod:`.stages`):
model  -> a tiny Qwen3 built here, or --hf-checkpoint
SFT    -> loss on assistant tokens only, while the engines start; the engines reload it
eval   -> engines + sandbox: accuracy mean@k and turns on held-out problems / AIME
GRPO   -> rollouts with the sandbox in the loop, ReTool reward (DAPO when asked), weights
          synced to the engines after every step
eval   -> again; grpo-core's ``recipe.report.report_run``: table, verdict, run folder
          (config.json, metrics.jsonl, tensorboard/, summary.json, curves/)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from rich.console import Console

from turnrl.grpo_core.recipe.driver import open_run, run_main
from turnrl.grpo_core.recipe.report import report_run
from turnrl.grpo_core.recipe.stages import run_stages
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.config import RetoolAppConfig
from turnrl_app_retool.data import Datasets
from turnrl_app_retool.stages import RetoolStages


async def run(
    config: RetoolAppConfig, console: Console | None = None, resume: bool = False
) -> dict[str, Any]:
    """One full run; returns the summary (also written to ``<run_dir>/summary.json``).

    With ``resume``, what an earlier run of the same folder finished is not redone: the base
    and SFT models are reused, the evaluation before RL is read from ``progress.json`` and
    GRPO continues from the latest checkpoint.
    """
    from turnrl.tool_envs.retool.env import DEFAULT_INSTRUCTION

    console = console or Console()
    os.environ.update(config.env)
    threads = config.model.torch_threads
    with open_run("retool", config, resume=resume, console=console, torch_threads=threads) as this:
        if resume:
            done = ", ".join(this.progress) or "nothing"
            console.print(f"resuming {this.folder} (finished: {done})")
        with this.phases("data"):
            datasets = Datasets(this.config, DEFAULT_INSTRUCTION)
        result = await run_stages(this, RetoolStages(this.config, datasets, this.logger))
        return report_run(
            this,
            result,
            title=f"ReTool ({config.preset}), {', '.join(datasets.val)}",
            score=f"accuracy mean@{config.eval.n}",
            dynamic_sampling=config.rl.dynamic_sampling,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``uv run apps/retool``; returns the process exit code."""

    def prepare(default_dir: str) -> tuple[str, Coroutine[Any, Any, Any]] | None:
        config, args = resolve(argv)
        if args.print_config:
            print(json.dumps(config.to_dict(), indent=2))
            return None
        config.run_dir = run_dir = config.run_dir or default_dir  # named in the Ctrl-C hint
        return run_dir, run(config, resume=args.resume)

    return run_main("retool", prepare)


if __name__ == "__main__":
    sys.exit(main())
