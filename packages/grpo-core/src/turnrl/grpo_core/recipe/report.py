"""The end of a run, the same in both apps: ``summary.json``, the table, the verdict, curves.

:func:`report_run` turns what :func:`~turnrl.grpo_core.recipe.stages.run_stages` did (the
evaluation records of ``recipe.evaluation.evaluation_record`` before and after RL, every
step's metrics, what SFT did, the phases' seconds) into the run's summary, prints the
before / after table and one honest sentence on the change, and leaves ``summary.json`` and
the PNG curves in the run folder.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.table import Table

from turnrl.grpo_core.recipe.evaluation import change, verdict

if TYPE_CHECKING:
    from turnrl.grpo_core.recipe.driver import Run
    from turnrl.grpo_core.recipe.stages import StagesResult


def summary_of(run: Run[Any], result: StagesResult, score: str, **extra: Any) -> dict[str, Any]:
    """The run's summary: the held-out ``score`` before and after RL with standard errors,
    the change and its verdict (when both evaluations ran), steps, timings, the records."""
    config, history = run.config, result.history
    seconds = dict(run.phases.seconds)
    seconds["app_cpu_s"] = time.process_time()  # this process: data, SFT, RL training
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # engines and sandbox, stopped
    seconds["children_cpu_s"] = children.ru_utime + children.ru_stime
    rewards = [h["rollout/reward_mean"] for h in history if "rollout/reward_mean" in h]
    summary: dict[str, Any] = {
        "preset": config.preset,
        "run_dir": str(run.folder),
        "algorithm": config.loop.algorithm,
        "engine_urls": result.urls,
        "score_name": score,
        "steps": len(history),
        "train_history": history,
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        "groups_filtered_total": sum(h.get("rollout/groups_filtered", 0.0) for h in history),
        "sampling_rounds_total": sum(h.get("rollout/sampling_rounds", 1.0) for h in history),
        "sft": result.sft,  # steps, why it stopped, its probes
        "before": result.before,
        "after": result.after,
        "phases_s": seconds,
        "wall_seconds": run.seconds(),
        **extra,
    }
    before, after = result.before, result.after
    if after is not None:
        summary.update(score_after=after["score"], score_after_se=after["score_se"])
    if before is not None and after is not None:
        delta_se, how = change(before, after)
        b, a = (before["score"], before["score_se"]), (after["score"], after["score_se"])
        summary.update(
            score_before=b[0],
            score_before_se=b[1],
            score_delta=a[0] - b[0],
            score_delta_se=delta_se,
            verdict=verdict(score, b, a, delta_se, how),
        )
    return summary


def results_table(title: str, summary: Mapping[str, Any]) -> Table:
    """Before / after RL on the held-out set (score ± s.e., pass^k for k = 1, 2, 4, ... and
    the largest k, turns, tool calls, tokens/s, failed episodes), with the change, and
    seconds per phase (CPU seconds of the app and of its children last)."""
    before, after = summary["before"], summary["after"]
    records = [r for r in (before, after) if r is not None]
    table = Table(title=title)
    table.add_column("metric")
    columns = ["before RL", f"after RL ({summary['steps']} steps)"] if before else ["evaluation"]
    for name in [*columns, *(["change"] if before else [])]:
        table.add_column(name, justify="right")

    def row(label: str, values: list[float], errors: list[float] | None = None) -> None:
        digits = 0 if min(abs(v) for v in values) >= 100 else 3  # counts, tokens/s
        cells = [
            f"{v:.{digits}f}" + (f" ± {errors[i]:.3f}" if errors else "")
            for i, v in enumerate(values)
        ]
        if len(values) == 2:
            delta = values[1] - values[0]
            cells.append(
                f"{delta:+.{digits}f}" + (f" ± {summary['score_delta_se']:.3f}" if errors else "")
            )
        table.add_row(label, *cells)

    def shown(key: str) -> bool:  # pass^k for k = 1, 2, 4, 8, ... and the last k only
        k = int(key[5:]) if key.startswith("pass^") else 1
        return k & (k - 1) == 0 or f"pass^{k + 1}" not in records[-1]["metrics"]

    row(summary["score_name"], [r["score"] for r in records], [r["score_se"] for r in records])
    for key in records[-1]["metrics"]:
        if shown(key) and all(key in r["metrics"] for r in records):
            row(key, [r["metrics"][key] for r in records])
    row("failed episodes", [r["failed"] for r in records])
    for name, seconds in summary["phases_s"].items():
        label = name.replace("_cpu_s", " CPU") if name.endswith("_cpu_s") else f"time: {name}"
        table.add_row(f"{label} (s)", f"{seconds:.1f}", *[""] * (len(table.columns) - 2))
    return table


def report_run(
    run: Run[Any], result: StagesResult, *, title: str, score: str, **extra: Any
) -> dict[str, Any]:
    """Summarise the run (:func:`summary_of`, ``extra`` added), print the table and the
    verdict, write ``summary.json`` and the curves; returns the summary."""
    summary = summary_of(run, result, score, **extra)
    run.console.print(results_table(title, summary))
    if "verdict" in summary:
        run.console.print(f"RL algorithm: {summary['algorithm']}")
        run.console.print(f"[bold]{summary['verdict']}[/bold]")
    run.finish(summary)  # summary.json, with the curves it drew
    run.console.print(f"summary: {run.folder / 'summary.json'}")
    return summary
