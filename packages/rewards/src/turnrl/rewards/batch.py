"""Batched, async math scoring: the cheap path inline, the symbolic path in a process pool.

`await score_batch(items, config, pool=pool)` returns one `MathScore` per item, in order.
Items that extraction and normalisation can decide (most AIME/DAPO answers are integers)
are scored in this process without touching the pool; the rest go to `ScoringPool` workers,
each with `config.timeout_s`. An item that times out or crashes its worker scores
`config.failure_score` (0 by default) with the reason in `MathScore.reason`, and the rest of
the batch goes on. The event loop is never blocked: workers are awaited through the loop,
and the inline path yields to the loop every few dozen items.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.rewards.math_reward import MathRewardConfig, MathScore, fast_verdict, symbolic_equal
from turnrl.rewards.pool import PoolConfig, ScoringPool, WorkerCrashed, WorkerError, WorkerTimeout

_YIELD_EVERY = 32  # inline items between two yields to the event loop


@dataclass(frozen=True)
class MathItem:
    """One response to score."""

    response: str
    """The model's response text (the answer is extracted from it)."""
    ground_truth: str
    """The reference answer."""


async def _symbolic(
    pool: ScoringPool, pred: str, item: MathItem, config: MathRewardConfig
) -> MathScore:
    args = (pred, item.ground_truth, config.float_rounding)
    try:
        equal = await pool.run(symbolic_equal, *args, timeout_s=config.timeout_s)
    except WorkerTimeout as error:
        return MathScore(config.failure_score, False, pred, "timeout", str(error))
    except (WorkerCrashed, WorkerError) as error:
        return MathScore(config.failure_score, False, pred, "error", str(error)[-500:])
    score = config.correct_score if equal else config.wrong_score
    return MathScore(score, bool(equal), pred, "symbolic")


async def score_batch(
    items: Sequence[MathItem],
    config: MathRewardConfig | None = None,
    *,
    pool: ScoringPool | None = None,
    pool_config: PoolConfig | None = None,
) -> list[MathScore]:
    """Score a batch of responses with per-item timeouts.

    Args:
        items: The responses and their ground truths.
        config: Scoring settings (default: `math_verify` mode, 1 / 0 scores, 5 s timeout).
        pool: A started or unstarted pool to reuse across batches (it is left open). When
            None and some item needs the symbolic path, a pool is made for this call and
            closed at the end (starting workers costs about a second; reuse one in training).
        pool_config: Settings of the temporary pool when `pool` is None.

    Returns:
        One score per item, in the order of `items`.

    Raises:
        TypeError: when an item is not a `MathItem` or holds non-string text.
    """
    config = config or MathRewardConfig()
    results: list[MathScore | None] = [None] * len(items)
    pending: list[tuple[int, str]] = []
    for index, item in enumerate(items):
        if not isinstance(item, MathItem):
            raise TypeError(f"items[{index}] must be a MathItem, got {type(item).__name__}")
        verdict, pred = fast_verdict(item.response, item.ground_truth, config)
        if verdict is None:
            assert pred is not None
            pending.append((index, pred))
        else:
            results[index] = verdict
        if index % _YIELD_EVERY == _YIELD_EVERY - 1:
            await asyncio.sleep(0)
    if pending:
        own_pool = pool is None
        active = pool if pool is not None else ScoringPool(pool_config)
        try:
            scored = await asyncio.gather(
                *(_symbolic(active, pred, items[i], config) for i, pred in pending)
            )
        finally:
            if own_pool:
                await active.close()
        for (index, _), score in zip(pending, scored, strict=True):
            results[index] = score
    return [score for score in results if score is not None]
