"""The result type every reward function returns: a float and a breakdown for logging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Reward:
    """A scalar reward with the parts it was computed from."""

    reward: float
    """The value the trainer uses."""
    breakdown: dict[str, Any] = field(default_factory=dict)
    """Named parts of the reward (for metrics and debugging); never used for training."""
