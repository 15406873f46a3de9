"""Held-out evaluation statistics, and how a run reports them.

Both apps evaluate a held-out set before RL, every ``--eval-interval`` steps and after RL,
and report each score with its standard error over items (tasks, problems: the samples of
one item are correlated, so they count once), tau-bench's pass^k, and the change RL made,
paired over the same items where both evaluations list them. :class:`Phases` times the
run's phases on the console; :func:`render_run_curves` and :func:`write_summary` leave the
run's PNG curves and ``summary.json``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n); 0 for one value).

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("mean_and_stderr needs at least one value")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def pass_hat_k(successes: Sequence[int], trials: int, k: int) -> float:
    """tau-bench's pass^k: mean over items of C(c, k) / C(n, k) (c successes of n trials).

    Raises:
        ValueError: k outside [1, trials], or no items.
    """
    if not 1 <= k <= trials:
        raise ValueError(f"k must be in [1, {trials}], got {k}")
    if not successes:
        raise ValueError("no items to compute pass^k over")
    return sum(math.comb(c, k) / math.comb(trials, k) for c in successes) / len(successes)


def delta_stderr(
    before: Sequence[float] | None,
    after: Sequence[float] | None,
    before_se: float,
    after_se: float,
    unit: str = "items",
) -> tuple[float, str]:
    """Standard error of ``mean(after) - mean(before)``, and how it was computed.

    Paired over items (each item's score after minus before) when both evaluations list the
    same number (>= 2) of items' scores; otherwise the two standard errors combined as if
    independent (larger: an item's difficulty is counted twice).
    """
    if before is not None and after is not None and len(before) == len(after) >= 2:
        diffs = [a - b for b, a in zip(before, after, strict=True)]
        return mean_and_stderr(diffs)[1], f"paired over {len(diffs)} {unit}"
    return math.hypot(before_se, after_se), "combined"


def paired_errors(
    before: dict[str, list[float]], after: dict[str, list[float]]
) -> dict[str, float]:
    """Standard errors of a score before and after RL and of the paired change, over items
    of several datasets (dataset -> each item's score, the same items in both).

    The score over several datasets is the mean of their means, so its s.e. is sqrt(sum of
    squared s.e.) / number of datasets. The change is paired: its s.e. comes from the
    per-item differences.

    Returns:
        ``before_se``, ``after_se``, ``delta_se`` and ``num_items``.

    Raises:
        ValueError: the two evaluations do not cover the same datasets and item counts.
    """
    if {k: len(v) for k, v in before.items()} != {k: len(v) for k, v in after.items()}:
        raise ValueError("before/after evaluations must cover the same items")

    def combined(per_dataset: list[list[float]]) -> float:
        squares = sum(mean_and_stderr(values)[1] ** 2 for values in per_dataset)
        return float(squares**0.5 / len(per_dataset))

    diffs = [[a - b for a, b in zip(after[k], before[k], strict=True)] for k in before]
    return {
        "before_se": combined(list(before.values())),
        "after_se": combined(list(after.values())),
        "delta_se": combined(diffs),
        "num_items": float(sum(len(v) for v in before.values())),
    }


def verdict(
    metric: str,
    before: tuple[float, float],
    after: tuple[float, float],
    delta_se: float,
    how: str,
) -> str:
    """One honest sentence on what RL did to a held-out ``metric``: ``before`` and ``after``
    are (mean, standard error); a rise counts only beyond 2 standard errors of the change."""
    delta = after[0] - before[0]
    trend = "raised" if delta > 0 else "did not raise"
    if delta > 0:
        trend += " (beyond 2 standard errors)" if delta > 2 * delta_se else " (within noise)"
    return (
        f"RL {trend} the held-out {metric}: {before[0]:.3f} +- {before[1]:.3f} -> "
        f"{after[0]:.3f} +- {after[1]:.3f} ({delta:+.3f}, standard error of the change "
        f"{delta_se:.3f}, {how})."
    )


class Phases:
    """Wall-clock seconds per named phase, announced on the console as each starts and ends."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (repeated phases add up)."""
        self.console.rule(f"[bold]{name}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.console.print(f"[dim]{name}: {self.seconds[name]:.1f} s[/dim]")


def render_run_curves(run_dir: Path, console: Console) -> list[Path]:
    """PNG curves of the run (``run_dir/curves``); a warning and none when they cannot be
    drawn (matplotlib missing, nothing logged yet, a plotting error): a plot never fails a
    finished run."""
    try:
        from turnrl.grpo_core.observe.report import render_curves

        paths = list(render_curves(run_dir))
    except Exception as exc:
        console.print(f"[yellow]no PNG curves: {type(exc).__name__}: {exc}[/yellow]")
        return []
    if paths:
        console.print(f"curves: {', '.join(str(p) for p in paths)}")
    return paths


def write_summary(path: Path, data: dict[str, Any]) -> Path:
    """``summary.json``: sorted keys, indented, anything else as its string."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path
