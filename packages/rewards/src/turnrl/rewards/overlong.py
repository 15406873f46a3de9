"""DAPO's soft overlong penalty: linear in the tokens past `max_len - buffer_len`.

With `L` the counted response length, `E = max_len - buffer_len` the expected length:
penalty = 0 when `L <= E`, `-(L - E) / buffer_len * penalty_factor` up to `L = max_len`
(where it reaches `-penalty_factor`), and `-penalty_factor` beyond (a truncated response).
It is added to the task reward.

Which tokens count: in a multi-turn trajectory the response holds model tokens and
tool/user tokens the model did not write. By default only model-generated tokens
(`loss_mask == 1`) count, so long tool outputs do not penalise the policy; set
`count_tool_tokens=True` to count every response token, as single-turn DAPO does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.rewards.result import Reward


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO's overlong penalty settings (verl: `reward_model.overlong_buffer.*`)."""

    max_len: int
    """Maximum response length in tokens (verl: `data.max_response_length`)."""
    buffer_len: int
    """Tokens before `max_len` where the penalty ramps from 0 to `-penalty_factor`."""
    penalty_factor: float = 1.0
    """Penalty at `max_len` and beyond (positive; the penalty is its negative)."""
    count_tool_tokens: bool = False
    """Count tool/user tokens in the response too (default: only model-generated tokens)."""

    def __post_init__(self) -> None:
        if self.buffer_len <= 0:
            raise ValueError(f"buffer_len must be > 0, got {self.buffer_len}")
        if self.max_len < self.buffer_len:
            raise ValueError(f"max_len ({self.max_len}) must be >= buffer_len ({self.buffer_len})")
        if self.penalty_factor < 0:
            raise ValueError(f"penalty_factor must be >= 0, got {self.penalty_factor}")


def overlong_penalty(
    num_model_tokens: int, config: OverlongConfig, num_tool_tokens: int = 0
) -> Reward:
    """The (non-positive) overlong penalty of one response.

    Args:
        num_model_tokens: Response tokens the policy generated.
        config: Lengths and factor.
        num_tool_tokens: Response tokens from tools/users (counted only with
            `config.count_tool_tokens`).

    Returns:
        The penalty (0 or negative) and a breakdown with `counted_len`, `expected_len`,
        `exceed_len`.

    Raises:
        ValueError: on a negative token count.
    """
    if num_model_tokens < 0 or num_tool_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {num_model_tokens}, {num_tool_tokens}")
    counted = num_model_tokens + (num_tool_tokens if config.count_tool_tokens else 0)
    expected = config.max_len - config.buffer_len
    exceed = max(0, counted - expected)
    penalty = -min(exceed / config.buffer_len, 1.0) * config.penalty_factor
    breakdown = {"counted_len": counted, "expected_len": expected, "exceed_len": exceed}
    return Reward(penalty if exceed else 0.0, breakdown)


def overlong_penalty_from_mask(loss_mask: Sequence[int], config: OverlongConfig) -> Reward:
    """`overlong_penalty` from a trajectory's response loss mask (1 = model token).

    Raises:
        ValueError: when the mask holds values other than 0 and 1.
    """
    model_tokens = 0
    for value in loss_mask:
        if value not in (0, 1):
            raise ValueError(f"loss_mask values must be 0 or 1, got {value!r}")
        model_tokens += int(value)
    return overlong_penalty(model_tokens, config, len(loss_mask) - model_tokens)
