"""What the user sees and keeps: console lines, progress, TensorBoard, the final table, summary.json."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from turnrl_app_tau.episodes import standard_error

console = Console(highlight=False)


class Phases:
    """Wall-clock seconds per named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        console.rule(f"[bold]{name}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            console.print(f"[dim]{name}: {self.seconds[name]:.1f} s[/dim]")


class Scalars:
    """Scalars of every step: ``metrics.jsonl``, TensorBoard and the ``--logger`` trackers
    (grpo-core's ``StepLogger``).

    Appends when the files exist (a resumed run); TensorBoard is skipped, with a warning,
    when the ``tensorboard`` package is missing.
    """

    def __init__(self, run_dir: Path, trackers: list[Any] | None = None) -> None:
        from turnrl.grpo_core.observe.logger import StepLogger

        self.logger = StepLogger(run_dir, console=False, trackers=trackers)

    def add(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        """Write every metric at ``step``."""
        self.logger(step, {f"{prefix}{key}": value for key, value in metrics.items()})

    def samples(self, step: int, trajectories: list[Any]) -> None:
        """Write a few of the step's episodes as TensorBoard text (``rollout/samples``)."""
        self.logger.log_samples(step, [trajectory_text(t) for t in trajectories])

    def close(self) -> None:
        """Flush and close the files."""
        self.logger.close()


def trajectory_text(traj: Any) -> str:
    """One episode as plain text: every message with its role, then status and reward."""
    lines = []
    for message in getattr(traj, "messages", []):
        body = message.get("content") or ""
        if message.get("tool_calls"):
            body += f" {json.dumps(message['tool_calls'], default=str)}"
        lines.append(f"[{message.get('role', '?')}] {body}".rstrip())
    lines.append(f"status={getattr(traj, 'status', '?')} reward={getattr(traj, 'reward', 0.0)}")
    return "\n".join(lines)


def step_line(step: int, total: int, m: dict[str, float]) -> str:
    """The per-step console line."""
    return (
        f"step {step}/{total}  reward {m.get('rollout/reward_mean', 0):.3f}  "
        f"loss {m.get('train/loss', 0):+.4f}  kl {m.get('train/kl_loss', 0):.4f}  "
        f"clip {m.get('train/clip_frac', 0):.3f}  "
        f"engine/trainer |dlogp| {m.get('train/mismatch_abs_diff', 0):.4f}  "
        f"resp_len {m.get('rollout/response_len_mean', 0):.0f}  "
        f"tok/s {m.get('rollout/tokens_per_s', 0):.0f}  rollout {m.get('perf/rollout_s', 0):.1f}s"
        + (
            f" (engines busy {m['rollout/engine_busy_frac']:.0%})"
            if "rollout/engine_busy_frac" in m
            else ""
        )
        + f"  train {m.get('perf/train_s', 0):.1f}s  sync {m.get('perf/sync_s', 0):.2f}s"
    )


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


def delta_stderr(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, str]:
    """Standard error of the held-out reward's change, and how it was computed.

    Paired over tasks (each task's mean after minus before) when both evaluations list the
    same tasks' rewards (``per_task_reward``); otherwise the two standard errors combined as
    if independent (larger: a task's difficulty is counted twice).
    """
    b, a = before.get("per_task_reward"), after.get("per_task_reward")
    if isinstance(b, list) and isinstance(a, list) and len(a) == len(b) >= 2:
        diffs = [y - x for x, y in zip(b, a, strict=True)]
        return standard_error(diffs), f"paired over {len(diffs)} tasks"
    noise = math.hypot(before.get("reward_stderr", 0.0), after.get("reward_stderr", 0.0))
    return noise, "combined"


def verdict(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    """One honest sentence on the RL delta of the held-out task reward, with its noise."""
    if not before or not after:
        return "No before/after evaluation (no held-out tasks)."
    delta = after["reward"] - before["reward"]
    noise, how = delta_stderr(before, after)
    trend = "raised" if delta > 0 else "did not raise"
    if delta > 0:
        trend += " (beyond 2 standard errors)" if delta > 2 * noise else " (within noise)"
    return (
        f"RL {trend} the held-out task reward: {before['reward']:.3f} "
        f"+- {before.get('reward_stderr', 0.0):.3f} -> {after['reward']:.3f} "
        f"+- {after.get('reward_stderr', 0.0):.3f} ({delta:+.3f}, standard error of the "
        f"change {noise:.3f}, {how}); shaped reward {before.get('shaped_reward', 0.0):.3f} -> "
        f"{after.get('shaped_reward', 0.0):.3f}."
    )


def render_run_curves(run_dir: Path) -> list[Path]:
    """PNG curves of the run (``run_dir/curves``); a warning and none without matplotlib."""
    try:
        from turnrl.grpo_core.observe.report import render_curves

        paths = render_curves(run_dir)
    except ImportError as exc:
        console.print(f"[yellow]no PNG curves: {exc}[/yellow]")
        return []
    except (FileNotFoundError, ValueError) as exc:  # nothing logged yet
        console.print(f"[yellow]no PNG curves: {exc}[/yellow]")
        return []
    console.print(f"curves: {', '.join(str(p) for p in paths)}")
    return paths


def write_summary(path: Path, data: dict[str, Any]) -> Path:
    """summary.json (sorted keys, indented)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path
