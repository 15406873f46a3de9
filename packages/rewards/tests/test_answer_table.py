"""Every answer pair of tests/answer_pairs.py gets the hand-decided verdict in every mode."""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import pytest

from turnrl.rewards import (
    MathItem,
    MathRewardConfig,
    PoolConfig,
    ScoringPool,
    score_batch,
    score_math,
)


def _load_rows() -> list[tuple[str, str, str, bool, bool, bool]]:
    # Loaded by path: the tests folder is not a package (and runs with importlib mode).
    path = Path(__file__).resolve().parent / "answer_pairs.py"
    spec = importlib.util.spec_from_file_location("turnrl_rewards_answer_pairs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ROWS


ROWS = _load_rows()
MODES = ("strict", "normalized", "math_verify")
CASES = [
    pytest.param(mode, response, truth, expected[i], id=f"{i_row}-{category}-{mode}")
    for i_row, (category, response, truth, *expected) in enumerate(ROWS)
    for i, mode in enumerate(MODES)
]


def test_table_is_large_and_covers_every_category():
    counts = collections.Counter(row[0] for row in ROWS)
    assert len(ROWS) >= 150
    for category in (
        "integer",
        "fraction",
        "radical",
        "interval",
        "set",
        "matrix",
        "unit",
        "percent",
        "scientific",
        "malformed",
    ):
        assert counts[category] >= 4, category
    # Both verdicts occur in every mode, so no mode passes by always answering the same.
    for i in range(3):
        assert {row[3 + i] for row in ROWS} == {True, False}


@pytest.mark.parametrize(("mode", "response", "truth", "expected"), CASES)
def test_verdict(mode, response, truth, expected):
    score = score_math(response, truth, MathRewardConfig(mode=mode))
    assert score.correct is expected, score
    assert score.score == (1.0 if expected else 0.0)


def test_modes_are_ordered_by_leniency():
    # Whatever strict accepts, normalized accepts; whatever normalized accepts, math_verify does.
    for _, _, _, strict, normalized, symbolic in ROWS:
        assert normalized or not strict
        assert symbolic or not normalized


@pytest.mark.slow
async def test_table_through_pool_matches_in_process():
    items = [MathItem(response, truth) for _, response, truth, *_ in ROWS]
    config = MathRewardConfig(mode="math_verify", timeout_s=30)
    async with ScoringPool(PoolConfig(num_workers=2)) as pool:
        scores = await score_batch(items, config, pool=pool)
    assert [s.correct for s in scores] == [row[5] for row in ROWS]
    assert all(s.path not in ("timeout", "error") for s in scores)
