"""DAPO overlong penalty: zero up to max_len - buffer, linear to -factor at max_len."""

from __future__ import annotations

import pytest

from turnrl.rewards import OverlongConfig, overlong_penalty, overlong_penalty_from_mask

CONFIG = OverlongConfig(max_len=1000, buffer_len=200, penalty_factor=1.0)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(0, 0.0), (800, 0.0), (801, -1 / 200), (900, -0.5), (1000, -1.0), (1500, -1.0)],
)
def test_linear_ramp(tokens, expected):
    assert overlong_penalty(tokens, CONFIG).reward == pytest.approx(expected)


def test_tool_tokens_count_only_when_asked():
    assert overlong_penalty(800, CONFIG, num_tool_tokens=500).reward == 0.0
    counting = OverlongConfig(max_len=1000, buffer_len=200, count_tool_tokens=True)
    assert overlong_penalty(800, counting, num_tool_tokens=100).reward == pytest.approx(-0.5)


def test_from_loss_mask():
    mask = [1] * 900 + [0] * 400  # 900 model tokens, 400 tool tokens
    result = overlong_penalty_from_mask(mask, CONFIG)
    assert result.reward == pytest.approx(-0.5)
    assert result.breakdown == {"counted_len": 900, "expected_len": 800, "exceed_len": 100}
    with pytest.raises(ValueError, match="0 or 1"):
        overlong_penalty_from_mask([1, 2], CONFIG)


def test_factor_scales():
    config = OverlongConfig(max_len=1000, buffer_len=200, penalty_factor=0.5)
    assert overlong_penalty(900, config).reward == pytest.approx(-0.25)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_len": 100, "buffer_len": 0}, "buffer_len"),
        ({"max_len": 10, "buffer_len": 20}, "max_len"),
        ({"max_len": 100, "buffer_len": 10, "penalty_factor": -1}, "penalty_factor"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OverlongConfig(**kwargs)


def test_negative_counts_refused():
    with pytest.raises(ValueError, match=">= 0"):
        overlong_penalty(-1, CONFIG)
