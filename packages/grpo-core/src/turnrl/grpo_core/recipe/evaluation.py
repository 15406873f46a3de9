"""Held-out evaluation statistics, and how a run reports them.

Both apps evaluate a held-out set before RL, every ``--eval-interval`` steps and after RL,
and report each score with its standard error over items (tasks, problems: the samples of
one item are correlated, so they count once), tau-bench's pass^k, and the change RL made,
paired over the same items where both evaluations list them; an episode its engine failed
(dead or hung, not the policy's doing) is run again (:func:`rerun_engine_failures`), as
RL's rollout does, before it may count as failed; where the run can start a dead engine
again (:data:`engine_recovery`), it does so first. :class:`Phases` times the
run's phases on the console; :func:`render_run_curves` and :func:`write_summary` leave the
run's PNG curves and ``summary.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rich.console import Console

log = logging.getLogger(__name__)


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


class Episode(Protocol):
    """What an evaluation reads of one episode (``turnrl.tool_envs.trajectory.Trajectory``)."""

    @property
    def status(self) -> str: ...
    @property
    def num_turns(self) -> int: ...
    @property
    def num_tool_calls(self) -> int: ...
    @property
    def num_invalid_tool_calls(self) -> int: ...
    @property
    def num_generated_tokens(self) -> int: ...
    @property
    def metadata(self) -> dict[str, Any]: ...


E = TypeVar("E", bound=Episode)

engine_recovery: ContextVar[Callable[[], Awaitable[bool]] | None] = ContextVar(
    "engine_recovery", default=None
)
"""Set by the run while its engines serve (``recipe.stages``): starts the engines that do
not answer their health check again, with the weights they served; True when some engine
serves. :func:`rerun_engine_failures` awaits it before each round of re-runs, so an
evaluation survives the death of its only engine (the engines' restarts while another one
serves are the weight sync's business)."""


async def rerun_engine_failures(
    episodes: Sequence[E],
    rerun: Callable[[int], Awaitable[E]],
    max_retries: int = 2,
    backoff: float = 1.0,
) -> tuple[list[E], int]:
    """``episodes`` with each one its engine failed (``loop.rollout_manager.engine_failed``:
    an engine error, not the policy's outcome) replaced by ``rerun(index)``, up to
    ``max_retries`` times, ``backoff`` seconds after each round (the router's circuit
    breaker meanwhile takes a dead engine out of rotation); returns them, in order, and the
    number of re-runs. What still fails is left for :func:`evaluation_record` to count.

    Before each round, :data:`engine_recovery` (when the run set it) starts dead engines
    again; when it finds no engine serving, the rounds end there."""
    from turnrl.grpo_core.loop.rollout_manager import engine_failed  # the loop imports torch

    done, reruns = list(episodes), 0
    for _ in range(max_retries):
        failed = [i for i, episode in enumerate(done) if engine_failed(episode)]
        if not failed:
            break
        if not await _engines_serve(len(failed)):
            break
        log.warning(
            "%d held-out episode(s) failed on their engine; running them again", len(failed)
        )
        await asyncio.sleep(backoff)
        for i, episode in zip(failed, await asyncio.gather(*map(rerun, failed)), strict=True):
            done[i] = episode
        reruns += len(failed)
    return done, reruns


async def _engines_serve(failed: int) -> bool:
    """Await :data:`engine_recovery` when set; False (and why, logged) when no engine
    serves or the recovery itself failed."""
    recover = engine_recovery.get()
    try:
        if recover is None or await recover():
            return True
        log.warning("no engine serves: %d held-out episode(s) stay failed", failed)
    except Exception as exc:  # e.g. a restarted engine that reports another version
        log.warning(
            "starting the engines again failed (%s): %d episode(s) stay failed", exc, failed
        )
    return False


def evaluation_record(
    datasets: Mapping[str, Sequence[Sequence[E]]],
    score: Callable[[E], Mapping[str, float]],
    seconds: float,
    reruns: int = 0,
) -> dict[str, Any]:
    """An evaluation's record (JSON): every dataset's items, each run ``trials`` times.

    ``datasets`` maps a name to its items, each a list of its trials' :class:`Episode`;
    ``score(episode)`` gives the headline ``score`` (0/1 success, for pass^k) and any other
    numbers to average (e.g. ``shaped_reward``). An episode that ``failed`` outside the policy
    (engine, user simulator, sandbox, judge) is left out of every number and counted in
    ``failed`` (a fraction; ``error`` names the first); an item whose trials all failed is
    None in ``per_item``; pass^k counts the items none of whose trials failed.

    Returns:
        ``score`` (the mean over datasets of each one's mean over episodes) and ``score_se``
        (over items: an item's trials are correlated), ``datasets`` (each one's ``score`` and
        ``score_se``), ``per_item`` (dataset -> each item's mean, for paired changes),
        ``trials``, ``failed``, ``error``, ``seconds`` and ``metrics`` (pass^k, turns, tool
        calls, invalid calls, generated tokens and tokens/s, ``engine_reruns`` (``reruns``:
        episodes run again because their engine failed), the other numbers of ``score``).

    Raises:
        ValueError: no episodes.
        RuntimeError: every episode failed (the first error named).
    """
    episodes = [e for items in datasets.values() for trials in items for e in trials]
    failed = [e for e in episodes if e.status == "failed"]
    if not episodes:
        raise ValueError("no episodes to evaluate")
    error = str(failed[0].metadata.get("error", "unknown error")) if failed else None
    if len(failed) == len(episodes):
        raise RuntimeError(f"every held-out episode failed, e.g. {error}")
    trials = max(len(t) for items in datasets.values() for t in items)
    kept: list[tuple[E, Mapping[str, float]]] = []
    per_item: dict[str, list[float | None]] = {}
    summary: dict[str, dict[str, float]] = {}
    whole: list[float] = []  # each item's successes, when none of its trials failed
    for name, items in datasets.items():
        values, means = [], []
        for item in items:
            done = [(e, score(e)) for e in item if e.status != "failed"]
            kept += done
            scores = [s["score"] for _, s in done]
            values += scores
            means.append(sum(scores) / len(scores) if scores else None)
            if len(scores) == trials:
                whole.append(sum(scores))
        per_item[name] = means
        if values:
            _, se = mean_and_stderr([m for m in means if m is not None])
            summary[name] = {"score": sum(values) / len(values), "score_se": se}

    def mean(values: Sequence[float]) -> float:
        return float(sum(values) / len(values))

    extra = [key for key in kept[0][1] if key != "score"]
    generated = float(sum(e.num_generated_tokens for e in episodes))
    metrics = {key: mean([s[key] for _, s in kept]) for key in extra}
    metrics.update(
        num_turns=mean([e.num_turns for e, _ in kept]),
        tool_calls=mean([e.num_tool_calls for e, _ in kept]),
        invalid_tool_calls=mean([e.num_invalid_tool_calls for e, _ in kept]),
        generated_tokens=generated,
        tokens_per_s=generated / max(seconds, 1e-9),
        engine_reruns=float(reruns),
    )
    if whole and all(float(s).is_integer() for s in whole):  # 0/1 scores: tau-bench's pass^k
        counts = [int(s) for s in whole]
        metrics.update({f"pass^{k}": pass_hat_k(counts, trials, k) for k in range(1, trials + 1)})
    scored = list(summary.values())
    return {
        "score": mean([d["score"] for d in scored]),
        "score_se": math.sqrt(sum(d["score_se"] ** 2 for d in scored)) / len(scored),
        "datasets": summary,
        "per_item": per_item,
        "trials": trials,
        "failed": len(failed) / len(episodes),
        "error": error,
        "seconds": seconds,
        "metrics": metrics,
    }


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The curves' points of an evaluation record: each dataset's score as verl names it
    (``val-core/<dataset>/acc/mean@<trials>``), the rest under ``val-aux/``."""
    k = record["trials"]
    points = {f"val-core/{name}/acc/mean@{k}": d["score"] for name, d in record["datasets"].items()}
    points.update({f"val-aux/{key}": value for key, value in record["metrics"].items()})
    points["val-aux/failed"] = record["failed"]
    return points


def change(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[float, str]:
    """Standard error of ``after["score"] - before["score"]``, and how it was computed.

    Paired over items (each item's score after minus before, the items both evaluations
    scored) when both list the same datasets and item counts; the score over several datasets
    is the mean of their means, so its s.e. is sqrt(sum of squared s.e.) / number of datasets.
    Otherwise the two standard errors combined as if independent (larger: an item's
    difficulty is counted twice).
    """
    b, a = before.get("per_item") or {}, after.get("per_item") or {}
    if b and {k: len(v) for k, v in b.items()} == {k: len(v) for k, v in a.items()}:
        diffs = [
            [y - x for x, y in zip(b[k], a[k], strict=True) if x is not None and y is not None]
            for k in b
        ]
        if all(len(d) >= 2 for d in diffs):
            squares = sum(mean_and_stderr(d)[1] ** 2 for d in diffs)
            count = sum(len(d) for d in diffs)
            return math.sqrt(squares) / len(diffs), f"paired over {count} items"
    return math.hypot(before["score_se"], after["score_se"]), "combined"


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
