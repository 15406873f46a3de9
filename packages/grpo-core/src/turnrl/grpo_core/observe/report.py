"""Training curves from a run folder: ``turnrl-grpo report RUN_DIR`` writes one PNG per group.

A run folder holds what :class:`~turnrl.grpo_core.observe.logger.StepLogger` wrote:
``metrics.jsonl`` (one JSON object per step: ``{"step": 3, "time": ..., "rollout/reward_mean":
0.5, ...}``) and TensorBoard event files. :func:`load_scalars` reads ``metrics.jsonl`` when it
has scalars and otherwise every ``events.out.tfevents.*`` file below the folder (so runs
logged by TensorBoard alone, e.g. by verl, work too); :func:`read_metrics` reads the lines of
a ``metrics.jsonl`` as they are, also from a run still writing it. :func:`render_curves` draws
one figure per metric group, the part of the name before the first ``/`` (``rollout``,
``train``, ``perf``, ``val-core``, ...), one panel per metric, with matplotlib's Agg renderer
(no display needed). When a step was logged twice (a resumed run) the later value wins.

Usage::

    turnrl-grpo report runs/tau-qwen3 --tags rollout/reward_mean train
    turnrl-grpo report runs/tau-qwen3 --out curves-tau --tags 'val-core/*'
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Scalars = dict[str, list[tuple[int, float]]]
"""Metric name -> ``(step, value)`` pairs sorted by step."""

METRICS_FILE = "metrics.jsonl"
EVENTS_GLOB = "events.out.tfevents.*"
_NOT_METRICS = ("step", "time")
_EXTRA_HINT = "install turnrl-grpo-core[report]"


def load_scalars(run_dir: Path) -> Scalars:
    """Every scalar of a run: ``metrics.jsonl`` if it has any, else the TensorBoard events.

    Args:
        run_dir: The run folder.

    Returns:
        Metric name -> ``(step, value)`` pairs sorted by step, one per step.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or holds no metrics at all.
        NotADirectoryError: ``run_dir`` is a file.
        ValueError: a ``metrics.jsonl`` line is not a JSON object with an int ``step``
            (the message names the line), or an event file cannot be read.
        ImportError: event files must be read and ``tensorboard`` is not installed.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"no such run folder: {run_dir}")
    if not run_dir.is_dir():
        raise NotADirectoryError(f"run folder {run_dir} is a file, not a folder")
    jsonl = run_dir / METRICS_FILE
    if jsonl.is_file():
        scalars = _load_jsonl(jsonl)
        if scalars:
            return scalars
    event_files = sorted(p for p in run_dir.rglob(EVENTS_GLOB) if p.is_file())
    scalars = _load_events(event_files) if event_files else {}
    if not scalars:
        raise FileNotFoundError(
            f"no metrics found in {run_dir}: no scalars in {METRICS_FILE} or in TensorBoard "
            f"event files ({EVENTS_GLOB}) below it"
        )
    return scalars


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl`` written so far, also while its run is still writing.

    A last line without its newline is one being written (or cut off by a crash) and is left
    out, so the file can be polled during a run.

    Args:
        path: The ``metrics.jsonl`` file, or the run folder holding it.

    Returns:
        One dict per complete line (blank lines skipped); ``[]`` if there is no file yet.

    Raises:
        ValueError: a complete line is not a JSON object with an int ``step`` (the message
            names the line).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    data = path.read_bytes()
    records = []
    for lineno, raw in enumerate(data[: data.rfind(b"\n") + 1].split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason
            raise ValueError(f"{path}, line {lineno}: corrupt JSON ({reason})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {lineno}: expected a JSON object")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}, line {lineno}: 'step' must be an int, got {step!r}")
        records.append(record)
    return records


def _load_jsonl(path: Path) -> Scalars:
    by_tag: dict[str, dict[int, float]] = {}
    for record in read_metrics(path):
        for key, value in record.items():
            # Strings (e.g. a "phase" field), booleans and nulls are not curves.
            if key in _NOT_METRICS or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                by_tag.setdefault(key, {})[record["step"]] = float(value)
    return _sorted(by_tag)


def _load_events(files: list[Path]) -> Scalars:
    try:
        from tensorboard.backend.event_processing.event_accumulator import (
            SCALARS,
            EventAccumulator,
        )
    except ImportError as exc:
        raise ImportError(
            f"reading TensorBoard event files needs tensorboard ({exc}); {_EXTRA_HINT}"
        ) from exc
    events: list[tuple[float, str, int, float]] = []
    for path in files:
        accumulator = EventAccumulator(str(path), size_guidance={SCALARS: 0})
        try:
            accumulator.Reload()
        except Exception as exc:  # tensorboard raises assorted errors on damaged files
            raise ValueError(f"cannot read TensorBoard event file {path}: {exc}") from exc
        for tag in accumulator.Tags()["scalars"]:
            events += [(e.wall_time, tag, e.step, e.value) for e in accumulator.Scalars(tag)]
    by_tag: dict[str, dict[int, float]] = {}
    for _, tag, step, value in sorted(events, key=lambda e: e[0]):  # later writes win
        by_tag.setdefault(tag, {})[int(step)] = float(value)
    return _sorted(by_tag)


def _sorted(by_tag: dict[str, dict[int, float]]) -> Scalars:
    return {tag: sorted(points.items()) for tag, points in sorted(by_tag.items())}


def metric_group(tag: str) -> str:
    """The figure a metric goes to: the part before the first ``/`` (``other`` if none)."""
    head, sep, _ = tag.partition("/")
    return head if sep and head else "other"


def select_tags(available: Sequence[str], selectors: Sequence[str] | None) -> list[str]:
    """The metrics named by ``selectors``: exact names, groups (``train`` or ``train/``) or globs.

    Raises:
        ValueError: a selector matches no metric (the message lists the groups there are).
    """
    if selectors is None:
        return list(available)
    chosen: list[str] = []
    for selector in selectors:
        group = selector.rstrip("/")
        hits = [
            tag
            for tag in available
            if tag == selector or metric_group(tag) == group or fnmatch.fnmatchcase(tag, selector)
        ]
        if not hits:
            groups = sorted({metric_group(tag) for tag in available})
            raise ValueError(
                f"--tags {selector!r} matches no metric; groups here: {', '.join(groups)} "
                f"({len(available)} metrics)"
            )
        chosen += [tag for tag in hits if tag not in chosen]
    return chosen


def render_curves(
    run_dir: Path, out_dir: Path | None = None, tags: list[str] | None = None
) -> list[Path]:
    """Draw the run's training curves as PNG files, one per metric group.

    Args:
        run_dir: The run folder (see :func:`load_scalars`).
        out_dir: Where the PNGs go (created); default ``run_dir/curves``.
        tags: Only these metrics: exact names, group names or glob patterns.

    Returns:
        The written files, sorted by group (``perf.png``, ``rollout.png``, ...).

    Raises:
        ImportError: matplotlib is not installed.
        FileNotFoundError, NotADirectoryError, ValueError: as :func:`load_scalars`; also
            ``out_dir`` is a file or a selector in ``tags`` matches nothing.
    """
    figure_cls = _figure_class()
    run_dir = Path(run_dir)
    scalars = load_scalars(run_dir)
    chosen = select_tags(list(scalars), tags)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "curves"
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"output folder {out_dir} is a file")
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[str]] = {}
    for tag in chosen:
        groups.setdefault(metric_group(tag), []).append(tag)
    written = []
    for group in sorted(groups):
        path = out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', group)}.png"
        _draw_group(figure_cls, f"{run_dir.name}: {group}", group, groups[group], scalars, path)
        written.append(path)
    return written


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"drawing curves needs matplotlib ({exc}); {_EXTRA_HINT}") from exc
    return Figure


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_group(
    figure_cls: Any, title: str, group: str, tags: list[str], scalars: Scalars, path: Path
) -> None:
    """One figure: a grid of panels (3 per row), one metric per panel, saved as PNG."""
    ncols = min(3, len(tags))
    nrows = math.ceil(len(tags) / ncols)
    # A bare Figure renders with Agg on savefig: no pyplot state, no display needed.
    fig = figure_cls(figsize=(4.2 * ncols, 3.0 * nrows + 0.4), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, tag in zip(axes, tags, strict=False):
        steps = [step for step, _ in scalars[tag]]
        values = [value for _, value in scalars[tag]]
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3)
        ax.set_title(tag[len(group) + 1 :] if tag.startswith(group + "/") else tag, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        _integer_steps(ax)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(tags) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.savefig(path, format="png")


def build_parser() -> argparse.ArgumentParser:
    """The ``turnrl-grpo`` command line (subcommand ``report``)."""
    parser = argparse.ArgumentParser(prog="turnrl-grpo", description="turnrl GRPO tools")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser(
        "report", help="draw PNG training curves from a run folder (metrics.jsonl or TensorBoard)"
    )
    report.add_argument("run_dir", type=Path, help="the run folder")
    report.add_argument("--out", type=Path, default=None, help="output folder (RUN_DIR/curves)")
    report.add_argument(
        "--tags",
        nargs="+",
        default=None,
        help="only these metrics: names (train/loss), groups (train) or globs (val-core/*)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``turnrl-grpo``; prints each written PNG path. Returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        paths = render_curves(args.run_dir, args.out, args.tags)
    except (FileNotFoundError, NotADirectoryError, ValueError, ImportError) as exc:
        print(f"turnrl-grpo {args.command}: error: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
