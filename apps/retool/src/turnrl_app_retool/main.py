"""`uv run apps/retool`: SFT, evaluate, GRPO with the code sandbox, evaluate again.

data   -> problems (generated, or DAPO-Math-17k) and SFT chats (generated, or ReTool-SFT)
then grpo-core's ``recipe.stages.run_stages`` with the app's part (:mod:`.stages`):
model  -> a tiny Qwen3 built here, or --hf-checkpoint
SFT    -> loss on assistant tokens only, while the engines start; the engines reload it
eval   -> engines + sandbox: accuracy mean@k and turns on held-out problems / AIME
GRPO   -> rollouts with the sandbox in the loop, ReTool reward (DAPO when asked), weights
          synced to the engines after every step
eval   -> again; table + run folder (config.json, metrics.jsonl, tensorboard/, summary.json)
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from turnrl.grpo_core.recipe.driver import open_run, run_main
from turnrl.grpo_core.recipe.evaluation import paired_errors, verdict
from turnrl.grpo_core.recipe.stages import run_stages
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.config import RetoolAppConfig
from turnrl_app_retool.data import Datasets
from turnrl_app_retool.stages import RetoolStages


def accuracy(metrics: dict[str, float]) -> float:
    """Mean of every dataset's ``val-core/.../acc/mean@k``."""
    values = [v for k, v in metrics.items() if k.startswith("val-core/") and "/acc/" in k]
    return sum(values) / len(values)


async def run(
    config: RetoolAppConfig, console: Console | None = None, resume: bool = False
) -> dict[str, Any]:
    """One full run; returns the summary (also written to ``<run_dir>/summary.json``).

    With ``resume``, what an earlier run of the same folder finished is not redone: the base
    and SFT models are reused, the evaluation before RL is read from ``progress.json`` and
    GRPO continues from the latest checkpoint.
    """
    from turnrl.tool_envs.retool import DEFAULT_INSTRUCTION

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
        assert result.before is not None and result.after is not None
        seconds = dict(this.phases.seconds)
        seconds["app_cpu_s"] = time.process_time()  # this process: data, SFT, RL training
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # engines and sandbox, stopped
        seconds["children_cpu_s"] = children.ru_utime + children.ru_stime
        before, after = result.before, result.after
        per_problem = (before["per_problem"], after["per_problem"])
        summary = make_summary(
            this.config,
            before["metrics"],
            after["metrics"],
            result.history,
            seconds,
            this.seconds(),
            per_problem,
        )
        summary.update(
            runner=config.cluster.runner,
            engine_urls=result.urls,
            train_history=result.history,
            sft=result.sft,  # steps, why it stopped, its probes
        )
        this.finish(summary)
    console.print(results_table(summary))
    if "verdict" in summary:
        console.print(f"[bold]{summary['verdict']}[/bold]")
    console.print(f"run folder: {this.folder}")
    return summary


PerProblem = dict[str, list[float]]
"""Dataset -> each held-out problem's accuracy (fraction of its k samples correct)."""


def standard_errors(before: PerProblem, after: PerProblem) -> dict[str, float]:
    """Accuracy's standard errors before / after RL and of the paired delta, over problems
    (``recipe.evaluation.paired_errors``), under the summary's names."""
    e = paired_errors(before, after)
    return {
        "acc_before_se": e["before_se"],
        "acc_after_se": e["after_se"],
        "acc_delta_se": e["delta_se"],
        "num_val_problems": e["num_items"],
    }


def make_summary(
    config: RetoolAppConfig,
    before: dict[str, float],
    after: dict[str, float],
    history: Sequence[dict[str, float]],
    phases: dict[str, float],
    wall: float,
    per_problem: tuple[PerProblem, PerProblem] | None = None,
) -> dict[str, Any]:
    """summary.json: accuracy (± s.e. when ``per_problem`` is given) and turns before/after
    RL, the delta, steps, timings, and how many groups dynamic sampling filtered."""
    acc_before, acc_after = accuracy(before), accuracy(after)
    rewards = [h.get("rollout/reward_mean", 0.0) for h in history]
    errors: dict[str, Any] = dict(standard_errors(*per_problem)) if per_problem else {}
    if errors and history:
        errors["verdict"] = verdict(
            f"accuracy mean@{config.eval.n}",
            (acc_before, errors["acc_before_se"]),
            (acc_after, errors["acc_after_se"]),
            errors["acc_delta_se"],
            f"paired over {errors['num_val_problems']:.0f} problems",
        )
    return {
        **errors,
        "dynamic_sampling": config.rl.dynamic_sampling,
        "filtered_groups_total": sum(h.get("rollout/groups_filtered", 0.0) for h in history),
        "gen_batches_total": sum(h.get("rollout/sampling_rounds", 1.0) for h in history),
        "preset": config.preset,
        "n": config.eval.n,
        "val_datasets": sorted({k.split("/")[1] for k in before if k.startswith("val-core/")}),
        "acc_before": acc_before,
        "acc_after": acc_after,
        "acc_delta": acc_after - acc_before,
        "num_turns_before": before["val-aux/num_turns/mean"],
        "num_turns_after": after["val-aux/num_turns/mean"],
        "tokens_per_s_before": before["val-aux/tokens_per_s"],
        "tokens_per_s_after": after["val-aux/tokens_per_s"],
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        "steps": len(history),
        "phases_s": phases,
        "wall_seconds": wall,
        "metrics_before": before,
        "metrics_after": after,
    }


def results_table(summary: dict[str, Any]) -> Table:
    """The rich table printed at the end."""
    n, phases = summary["n"], summary["phases_s"]
    table = Table(title=f"ReTool ({summary['preset']}), {', '.join(summary['val_datasets'])}")
    for column in ("", f"acc mean@{n}", "mean turns", "tokens/s", "time"):
        table.add_column(column)

    def acc(key: str) -> str:
        sign = "+" if key == "acc_delta" else ""
        se = summary.get(f"{key}_se")
        return f"{summary[key]:{sign}.3f}" + ("" if se is None else f" ± {se:.3f}")

    table.add_row(
        "after SFT",
        acc("acc_before"),
        f"{summary['num_turns_before']:.2f}",
        f"{summary['tokens_per_s_before']:.0f}",
        f"SFT {phases.get('sft', 0):.0f}s + eval {phases.get('eval before RL', 0):.0f}s",
    )
    table.add_row(
        f"after RL ({summary['steps']} steps)",
        acc("acc_after"),
        f"{summary['num_turns_after']:.2f}",
        f"{summary['tokens_per_s_after']:.0f}",
        f"RL {phases.get('rl', 0):.0f}s + eval {phases.get('eval after RL', 0):.0f}s",
    )
    table.add_row(
        "delta",
        acc("acc_delta"),
        f"{summary['num_turns_after'] - summary['num_turns_before']:+.2f}",
        "",
        f"total {summary['wall_seconds']:.0f}s",
    )
    return table


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
