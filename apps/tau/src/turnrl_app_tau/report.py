"""What the user sees: the console, the final table, the verdict."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from turnrl.grpo_core.recipe.evaluation import delta_stderr
from turnrl.grpo_core.recipe.evaluation import verdict as recipe_verdict

console = Console(highlight=False)


def final_table(
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    phases: dict[str, float],
    after_title: str = "after RL",
) -> Table:
    """Before/after RL on the held-out tasks, and seconds per phase."""
    table = Table(title="tau held-out evaluation")
    table.add_column("metric")
    table.add_column("before RL", justify="right")
    table.add_column(after_title, justify="right")
    keys = [
        "reward",
        "reward_stderr",
        "pass^1",
        "shaped_reward",
        "num_turns",
        "tool_calls",
        "invalid_tool_calls",
        "tokens_per_s",
    ]
    for key in keys:
        row = [f"{d[key]:.3f}" if d and key in d else "-" for d in (before, after)]
        table.add_row(key, *row)
    for name, seconds in phases.items():
        table.add_row(f"time: {name} (s)", f"{seconds:.1f}", "")
    return table


def verdict(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    """One honest sentence on the RL delta of the held-out task reward, with its noise
    (paired over tasks when both evaluations list ``per_task_reward``)."""
    if not before or not after:
        return "No before/after evaluation (no held-out tasks)."
    b_se, a_se = before.get("reward_stderr", 0.0), after.get("reward_stderr", 0.0)
    noise, how = delta_stderr(
        before.get("per_task_reward"), after.get("per_task_reward"), b_se, a_se, "tasks"
    )
    sentence = recipe_verdict(
        "task reward", (before["reward"], b_se), (after["reward"], a_se), noise, how
    )
    return (
        f"{sentence} Shaped reward {before.get('shaped_reward', 0.0):.3f} -> "
        f"{after.get('shaped_reward', 0.0):.3f}."
    )
