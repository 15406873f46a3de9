"""score_batch: inline fast path, pool for the rest, failures scored 0 with a reason."""

from __future__ import annotations

import time

import pytest

from turnrl.rewards import MathItem, MathRewardConfig, PoolConfig, ScoringPool, score_batch


async def test_fast_items_need_no_pool():
    items = [MathItem(f"\\boxed{{{i}}}", str(i if i % 3 else i + 1)) for i in range(200)]
    start = time.monotonic()
    scores = await score_batch(items)  # would start a pool (seconds) if any item needed one
    assert time.monotonic() - start < 0.5
    assert [s.correct for s in scores] == [i % 3 != 0 for i in range(200)]
    assert {s.path for s in scores} == {"exact", "numeric"}


async def test_a_hanging_item_scores_zero_and_the_batch_goes_on():
    items = [
        MathItem("\\boxed{9^{9^{9^{9}}}}", "1"),
        MathItem("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        MathItem("\\boxed{7}", "7"),
        MathItem("\\boxed{(x+1)^2}", "x^2+2x+1"),
        MathItem("\\boxed{x+2}", "x+1"),
    ]
    config = MathRewardConfig(mode="math_verify", wrong_score=-1.0, timeout_s=3.0)
    # Warmed workers: a fresh one spends its first second building math-verify's parser.
    async with ScoringPool(PoolConfig(num_workers=2)) as pool:
        start = time.monotonic()
        scores = await score_batch(items, config, pool=pool)
        elapsed = time.monotonic() - start
    tower = scores[0]
    assert tower.path in ("timeout", "error") and tower.score == 0.0 and tower.reason
    assert [s.correct for s in scores[1:]] == [True, True, True, False], scores
    assert [s.score for s in scores[1:]] == [1.0, 1.0, 1.0, -1.0]
    assert elapsed < 3.0 + 5  # the tower's timeout plus the other items, not the tower's run


async def test_temporary_pool_is_made_and_closed():
    scores = await score_batch(
        [MathItem("\\boxed{\\frac{1}{2}x}", "\\frac{x}{2}")],
        MathRewardConfig(timeout_s=20),
        pool_config=PoolConfig(num_workers=1, warmup=()),
    )
    assert scores[0].correct and scores[0].path == "symbolic"


async def test_items_must_be_math_items():
    with pytest.raises(TypeError, match=r"items\[1\]"):
        await score_batch([MathItem("\\boxed{1}", "1"), ("\\boxed{1}", "1")])  # type: ignore[list-item]
