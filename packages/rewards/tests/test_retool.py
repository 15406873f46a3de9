"""ReTool reward: +1 / -1 with verl's tool-use bonus, required counts."""

from __future__ import annotations

import pytest

from turnrl.rewards import RetoolRewardConfig, retool_reward


@pytest.mark.parametrize(
    ("correct", "num_turns", "expected"),
    [
        (True, 2, 1.0),
        (True, 30, 1.0),
        (False, 2, -1.0),  # no tool round
        (False, 4, -0.9),  # one round: -1 + 0.1
        (False, 8, -0.7),  # three rounds
        (False, 10, -0.6),  # four rounds reach the cap
        (False, 40, -0.6),  # capped
        (False, 5, -0.85),  # verl's (num_turns - 2) / 2 may be fractional
        (False, 1, -1.0),  # fewer than 2 turns: no rounds (verl would go below -1)
    ],
)
def test_verl_formula(correct, num_turns, expected):
    result = retool_reward(correct, num_turns=num_turns, num_tool_calls=0)
    assert result.reward == pytest.approx(expected)
    assert result.breakdown["num_turns"] == num_turns


def test_rounds_from_tool_calls():
    config = RetoolRewardConfig(rounds_from="tool_calls")
    result = retool_reward(False, num_turns=2, num_tool_calls=3, config=config)
    assert result.reward == pytest.approx(-0.7)
    assert result.breakdown["tool_rounds"] == 3.0


@pytest.mark.parametrize(
    ("num_turns", "num_tool_calls", "error", "match"),
    [
        (None, 0, ValueError, "num_turns is required"),
        (4, None, ValueError, "num_tool_calls is required"),
        (-1, 0, ValueError, ">= 0"),
        (4.0, 0, TypeError, "int"),
        (True, 0, TypeError, "int"),
    ],
)
def test_missing_or_bad_counts_fail_clearly(num_turns, num_tool_calls, error, match):
    with pytest.raises(error, match=match):
        retool_reward(False, num_turns=num_turns, num_tool_calls=num_tool_calls)


def test_config_validation():
    with pytest.raises(ValueError, match="rounds_from"):
        RetoolRewardConfig(rounds_from="turns")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wrong_cap"):
        RetoolRewardConfig(wrong_cap=1.0)
