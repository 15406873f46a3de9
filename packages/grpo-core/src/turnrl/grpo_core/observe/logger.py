"""What a user watches during a run: the per-step console line, progress bars, run-folder logs.

* :func:`format_step_line` turns one step's metrics (the loop's ``rollout/``, ``train/``,
  ``perf/`` names, plus any ``val-core/`` results) into one short console line.
* :class:`StepLogger` is a ready ``on_metrics`` hook for :class:`~turnrl.grpo_core.loop.GRPOLoop`:
  it prints that line, appends every scalar to ``run_dir/metrics.jsonl`` and writes it to
  TensorBoard under ``run_dir/tensorboard`` (``torch.utils.tensorboard``; needs the
  ``tensorboard`` package, extra ``report``). Sample trajectories go to TensorBoard's text
  tab as code blocks and to ``run_dir/samples.jsonl``. Optional experiment trackers
  (W&B, MLflow, SwanLab; :mod:`~turnrl.grpo_core.observe.trackers`) get every step's scalars.
* :func:`progress` is a rich progress bar that stays silent when stdout is not a terminal
  (CI logs, ``nohup``) or when ``TURNRL_NO_PROGRESS=1``.

``turnrl-grpo report RUN_DIR`` (:mod:`turnrl.grpo_core.observe.report`) later reads ``metrics.jsonl``
(or the TensorBoard events) back and draws the training curves.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.grpo_core.observe.trackers import Tracker, close_trackers

NO_PROGRESS_ENV = "TURNRL_NO_PROGRESS"
"""Set to ``1`` to silence every progress bar."""

RESERVED_KEYS = ("step", "time", "phase")
"""Keys every ``metrics.jsonl`` line carries besides the metrics (so no metric may use them)."""

# (metric, label, format) in console order; a metric absent from the step is skipped.
_LINE_FIELDS = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/acc_mean_all", "acc", "{:.3f}"),
    ("train/loss", "loss", "{:+.4f}"),
    ("train/kl_loss", "kl", "{:.4f}"),
    ("train/entropy", "entropy", "{:.3f}"),
    ("train/clip_frac", "clip", "{:.3f}"),
    ("rollout/response_len_mean", "resp_len", "{:.0f}"),
    ("rollout/num_turns_mean", "turns", "{:.1f}"),
    ("rollout/tokens_per_s", "tok/s", "{:.0f}"),
    ("train/mismatch_abs_diff", "engine/trainer |dlogp|", "{:.4f}"),
)
_PHASE_FIELDS = (("perf/rollout_s", "rollout"), ("perf/train_s", "train"), ("perf/sync_s", "sync"))
_VAL_PREFIX = "val-core/"

_tensorboard_warned = False


def format_step_line(step: int, metrics: dict[str, float], total: int | None = None) -> str:
    """One console line for a training step.

    Shows reward, loss, KL loss, entropy, clip fraction, response length, turns, rollout
    tokens/s, the engine/trainer log-prob mismatch, the groups with equal rewards (and what
    a dynamic filter kept, in how many rounds), the seconds of each phase (rollout /
    train / sync) with the engines' busy fraction, episodes re-run after engine failures
    and any ``val-core/`` result, skipping whatever the step did not report. Example::

        step 3/200 | reward 0.512 | loss +0.0123 | kl 0.0010 | ... | time rollout 12.3s train 4.5s

    Args:
        step: The step just finished (>= 0).
        metrics: The step's metrics (the loop's names, e.g. ``rollout/reward_mean``).
        total: The number of steps of the run, shown as ``step/total`` when given.

    Returns:
        The line, without a trailing newline.

    Raises:
        ValueError: ``step`` is negative, ``total`` is not positive, or a shown metric is
            not a number.
    """
    _check_step(step)
    _check_total(total)
    parts = [f"step {step}/{total}" if total is not None else f"step {step}"]
    for key, label, fmt in _LINE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(_number(key, metrics[key]))}")
    phases = [
        f"{label} {_seconds(_number(key, metrics[key]))}"
        for key, label in _PHASE_FIELDS
        if key in metrics
    ]
    if (busy := metrics.get("rollout/engine_busy_frac")) is not None:
        phases.append(f"(engines busy {_number('rollout/engine_busy_frac', busy):.0%})")
    if phases:
        parts.append("time " + " ".join(phases))
    if (groups := _groups(metrics)) is not None:
        parts.append(groups)
    if retries := metrics.get("rollout/episode_retries"):
        count = _number("rollout/episode_retries", retries)
        parts.append(f"{count:.0f} episode(s) re-run (engine failures)")
    for key in sorted(k for k in metrics if k.startswith(_VAL_PREFIX)):
        parts.append(f"{key[len(_VAL_PREFIX) :]} {_number(key, metrics[key]):.3f}")
    return " | ".join(parts)


def _groups(metrics: dict[str, float]) -> str | None:
    """What the rollout manager did with the step's groups: how many had equal rewards
    (no advantage), and, when a dynamic filter dropped some or drew more rounds, how many
    it kept."""
    if not any(f"rollout/{k}" in metrics for k in _GROUP_KEYS):
        return None
    n = {k: _number(f"rollout/{k}", metrics.get(f"rollout/{k}", 0.0)) for k in _GROUP_KEYS}
    parts = []
    if n["groups_generated"]:
        parts.append(f"groups {n['groups_uniform']:.0f}/{n['groups_generated']:.0f} equal-reward")
    if n["groups_filtered"] or n["sampling_rounds"] > 1:
        parts.append(
            f"kept {n['groups_kept']:.0f} / filtered {n['groups_filtered']:.0f} in "
            f"{max(n['sampling_rounds'], 1):.0f} round(s)"
        )
    if n["filter_exhausted"]:
        parts.append("max rounds reached: short of informative groups")
    return ", ".join(parts) or None


_GROUP_KEYS = (
    *("groups_uniform", "groups_generated", "groups_kept", "groups_filtered"),
    *("sampling_rounds", "filter_exhausted"),
)


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def _check_total(total: int | None) -> None:
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ValueError(f"total must be a positive int or None, got {total!r}")


def _number(key: str, value: Any) -> float:
    """``value`` as a float, or a ValueError naming the metric (booleans are refused)."""
    if not isinstance(value, bool):
        if isinstance(value, int | float):
            return float(value)
        try:  # numpy / torch one-element scalars
            return float(value.item())
        except (AttributeError, TypeError, ValueError, RuntimeError):
            pass
    raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__} {value!r}")


def _seconds(value: float) -> str:
    """Seconds with precision that suits their size (0.21s, 4.5s, 123s)."""
    if not math.isfinite(value) or value >= 100:
        return f"{value:.0f}s"
    return f"{value:.2f}s" if value < 1 else f"{value:.1f}s"


class StepLogger:
    """Logs every step of a run: console line, ``metrics.jsonl``, TensorBoard and trackers.

    Pass it as ``GRPOLoop(..., on_metrics=StepLogger(run_dir))``; it is called as
    ``logger(step, metrics)``. Use it as a context manager (or call :meth:`close`) so the
    files are flushed and closed.

    Args:
        run_dir: The run folder (created if missing). Writes ``metrics.jsonl``,
            ``samples.jsonl`` and ``tensorboard/``; appends when they exist (a resumed run).
        console: Print :func:`format_step_line` for every step.
        tensorboard: Write TensorBoard events to ``run_dir/tensorboard``. Without the
            ``tensorboard`` package this warns once per process and writes none.
        total: The run's number of steps, for the console line (``step 3/200``).
        trackers: Experiment trackers (:func:`~turnrl.grpo_core.observe.trackers.make_trackers`:
            W&B, MLflow, SwanLab) that get every step's scalars as ``tracker.log(step,
            scalars)``, under the same metric names. The logger owns them: :meth:`close`
            closes them.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        console: bool = True,
        tensorboard: bool = True,
        total: int | None = None,
        trackers: Sequence[Tracker] | None = None,
    ) -> None:
        _check_total(total)
        self.trackers: list[Tracker] = list(trackers or ())
        for tracker in self.trackers:
            if not isinstance(tracker, Tracker):
                raise TypeError(f"tracker {tracker!r} needs log(step, scalars) and close()")
        self.run_dir = Path(run_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise NotADirectoryError(f"run_dir {self.run_dir} exists and is not a folder")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console, self.total = console, total
        self._metrics: IO[str] | None = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._samples: IO[str] | None = None
        self.writer: Any = _summary_writer(self.run_dir / "tensorboard") if tensorboard else None

    def __call__(self, step: int, metrics: dict[str, float], phase: str | None = None) -> None:
        """Record one step: print its line, append it to ``metrics.jsonl``, write TensorBoard,
        send the scalars to every tracker.

        ``phase`` (e.g. ``sft``, ``rl``, ``val``) is stored in the ``metrics.jsonl`` line, for
        runs whose stages count their own steps.

        Raises:
            ValueError: the logger is closed, ``step`` is negative, a metric is not a
                number, or a metric is named ``step`` or ``time``.
        """
        out = self._open_metrics()
        line = format_step_line(step, metrics, self.total)
        scalars = {key: _number(key, value) for key, value in metrics.items()}
        clash = [key for key in RESERVED_KEYS if key in scalars]
        if clash:
            raise ValueError(f"metric names {clash} are reserved in metrics.jsonl; rename them")
        record = {
            "step": step,
            "time": time.time(),
            **({"phase": phase} if phase else {}),
            **scalars,
        }
        out.write(json.dumps(record) + "\n")
        out.flush()
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.console:
            print(line, flush=True)
        for tracker in self.trackers:
            tracker.log(step, dict(scalars))

    def log_samples(self, step: int, samples: Sequence[str], tag: str = "rollout/samples") -> None:
        """Record sample trajectories (decoded text) of a step.

        TensorBoard shows them in its text tab under ``tag``, each in a code block so the
        chat template's markup is shown as is; ``samples.jsonl`` keeps them too.

        Raises:
            ValueError: the logger is closed, ``step`` is negative, ``tag`` is empty, or
                ``samples`` is not a list of strings.
        """
        self._open_metrics()
        _check_step(step)
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, got {tag!r}")
        if isinstance(samples, str) or not all(isinstance(s, str) for s in samples):
            raise ValueError("samples must be a list of strings (decoded trajectories)")
        if self._samples is None:
            self._samples = (self.run_dir / "samples.jsonl").open("a", encoding="utf-8")
        record = {"step": step, "tag": tag, "samples": list(samples)}
        self._samples.write(json.dumps(record) + "\n")
        self._samples.flush()
        if self.writer is not None:
            self.writer.add_text(tag, samples_markdown(samples), step)
            self.writer.flush()

    def close(self) -> None:
        """Flush and close the files and the trackers (safe to call twice).

        Every tracker is closed even when one fails; the first failure is raised after.
        """
        for handle in (self._metrics, self._samples):
            if handle is not None:
                handle.close()
        self._metrics = self._samples = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        trackers, self.trackers = self.trackers, []
        close_trackers(trackers)

    def _open_metrics(self) -> IO[str]:
        if self._metrics is None:
            raise ValueError(f"StepLogger for {self.run_dir} is closed")
        return self._metrics

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def samples_markdown(samples: Sequence[str]) -> str:
    """Markdown with each sample in its own fenced code block (fence longer than any inside)."""
    blocks = []
    for index, text in enumerate(samples):
        fence = "`" * max(3, _longest_backtick_run(text) + 1)
        blocks.append(f"**sample {index}**\n\n{fence}\n{text}\n{fence}")
    return "\n\n".join(blocks) if blocks else "_no samples_"


def _longest_backtick_run(text: str) -> int:
    longest = run = 0
    for char in text:
        run = run + 1 if char == "`" else 0
        longest = max(longest, run)
    return longest


def _summary_writer(folder: Path) -> Any:
    """A TensorBoard ``SummaryWriter`` on ``folder``, or None (warned once) without tensorboard."""
    global _tensorboard_warned
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        if not _tensorboard_warned:
            _tensorboard_warned = True
            warnings.warn(
                f"TensorBoard logging is off ({exc}); install turnrl-grpo-core[report]",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return SummaryWriter(str(folder))


class ProgressTask:
    """Handle of one :func:`progress` bar: call :meth:`advance` as work completes."""

    def __init__(self, bar: Progress | None, task_id: Any) -> None:
        self._bar, self._task_id = bar, task_id
        self.completed = 0
        """Units advanced so far (counted even when the bar is silent)."""

    @property
    def shown(self) -> bool:
        """Whether a bar is drawn (False when silent)."""
        return self._bar is not None

    def advance(self, n: int = 1) -> None:
        """Mark ``n`` more units done.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"advance needs n >= 0, got {n}")
        self.completed += n
        if self._bar is not None:
            self._bar.advance(self._task_id, n)


@contextmanager
def progress(
    description: str,
    total: int | None,
    *,
    console: Console | None = None,
    transient: bool = True,
) -> Iterator[ProgressTask]:
    """A rich progress bar for one phase (rollout, training, evaluation).

    Example::

        with progress("rollout", total=len(prompts) * n) as bar:
            for _ in as_completed(episodes):
                bar.advance()

    The bar is silent (the handle still counts) when the console is not a terminal or the
    environment sets ``TURNRL_NO_PROGRESS=1``.

    Args:
        description: The label left of the bar.
        total: Units of work, or None when unknown (a spinner-like bar).
        console: The rich console to draw on (default: stdout).
        transient: Erase the bar when done (the step line stays as the record).

    Raises:
        ValueError: ``total`` is negative.
    """
    if total is not None and total < 0:
        raise ValueError(f"progress total must be >= 0 or None, got {total}")
    console = console if console is not None else Console()
    if os.environ.get(NO_PROGRESS_ENV, "") not in ("", "0") or not console.is_terminal:
        yield ProgressTask(None, None)
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=transient) as bar:
        yield ProgressTask(bar, bar.add_task(description, total=total))
