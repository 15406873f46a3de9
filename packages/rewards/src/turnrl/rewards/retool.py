"""ReTool's reward: +1 for a correct answer, -1 for a wrong one raised by tool use.

verl's ReTool recipe rewards a wrong answer less harshly the more code-interpreter rounds
the model used: `min(-0.6, -1 + 0.1 * tool_rounds)`, so a wrong answer after 4+ rounds
scores -0.6 instead of -1. verl derives the rounds from the turn count as
`(num_turns - 2) / 2` (one user prompt and one final answer, then an assistant turn and a
tool turn per round) and crashes when `num_turns` is missing; here both `num_turns` and
the tool-call count are required arguments, checked up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.rewards.result import Reward


@dataclass(frozen=True)
class RetoolRewardConfig:
    """ReTool's reward values and how tool rounds are counted."""

    correct_score: float = 1.0
    """Reward of a correct answer."""
    wrong_score: float = -1.0
    """Reward of a wrong answer before the tool-use bonus."""
    bonus_per_round: float = 0.1
    """Added to a wrong answer's reward per tool round."""
    wrong_cap: float = -0.6
    """A wrong answer's reward never exceeds this, however many rounds."""
    rounds_from: Literal["num_turns", "tool_calls"] = "num_turns"
    """`num_turns`: rounds = (num_turns - 2) / 2 as in verl (may be fractional);
    `tool_calls`: rounds = the number of tool calls."""

    def __post_init__(self) -> None:
        if self.rounds_from not in ("num_turns", "tool_calls"):
            raise ValueError(
                f"rounds_from must be num_turns or tool_calls, got {self.rounds_from!r}"
            )
        if self.wrong_cap >= self.correct_score:
            raise ValueError("wrong_cap must be below correct_score, or wrong beats correct")


def _check_count(name: str, value: object) -> int:
    if value is None:
        raise ValueError(
            f"{name} is required for the ReTool reward (got None); pass the trajectory's count"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def retool_reward(
    correct: bool,
    *,
    num_turns: int | None,
    num_tool_calls: int | None,
    config: RetoolRewardConfig | None = None,
) -> Reward:
    """The ReTool reward of one trajectory.

    Args:
        correct: Whether the final answer is right (e.g. `MathScore.correct` in strict mode).
        num_turns: User plus assistant turns of the trajectory (tool results count as user
            turns, as in verl's agent loop).
        num_tool_calls: Tool calls the model made.
        config: Reward values (default: verl's recipe).

    Returns:
        The reward and a breakdown with `correct`, `tool_rounds`, `num_turns`,
        `num_tool_calls` and `tool_bonus`.

    Raises:
        ValueError: a count is missing (None) or negative.
        TypeError: a count is not an int.
    """
    config = config or RetoolRewardConfig()
    turns = _check_count("num_turns", num_turns)
    calls = _check_count("num_tool_calls", num_tool_calls)
    rounds = max(0.0, (turns - 2) / 2) if config.rounds_from == "num_turns" else float(calls)
    breakdown: dict[str, object] = {
        "correct": bool(correct),
        "tool_rounds": rounds,
        "num_turns": turns,
        "num_tool_calls": calls,
        "tool_bonus": 0.0,
    }
    if correct:
        return Reward(config.correct_score, breakdown)
    bonus = config.bonus_per_round * rounds
    breakdown["tool_bonus"] = bonus
    return Reward(min(config.wrong_cap, config.wrong_score + bonus), breakdown)
