"""turnrl-rewards: tau-bench, math and ReTool rewards, overlong penalty, batched scoring.

Pure Python (no torch, no other turnrl package). Main entry points:

- `tau_reward(TauRewardInput(...))` — tau-bench's 0/1 rule, optional shaping;
  `normalize_by_group_max` for shaped groups.
- `score_math(response, ground_truth, MathRewardConfig(mode=...))` — one item in-process;
  `await score_batch([MathItem(...)], config, pool=ScoringPool())` — many, with timeouts.
- `retool_reward(correct, num_turns=..., num_tool_calls=...)` — ReTool's tool-use bonus.
- `overlong_penalty(num_model_tokens, OverlongConfig(...))` — DAPO's soft length penalty.
"""

from turnrl.rewards.batch import MathItem, score_batch
from turnrl.rewards.math_extract import (
    extract_answer,
    extract_answer_line,
    extract_boxed,
    extract_boxed_strict,
)
from turnrl.rewards.math_normalize import normalize_answer, parse_rational
from turnrl.rewards.math_reward import (
    MATH_MODES,
    MathRewardConfig,
    MathScore,
    fast_verdict,
    score_math,
    symbolic_equal,
)
from turnrl.rewards.overlong import OverlongConfig, overlong_penalty, overlong_penalty_from_mask
from turnrl.rewards.pool import (
    PoolConfig,
    ScoringPool,
    WorkerCrashed,
    WorkerError,
    WorkerTimeout,
)
from turnrl.rewards.result import Reward
from turnrl.rewards.retool import RetoolRewardConfig, retool_reward
from turnrl.rewards.tau import (
    TauRewardInput,
    TauShapingConfig,
    normalize_by_group_max,
    output_found,
    tau_reward,
)

__version__ = "0.1.0"

__all__ = [
    "MATH_MODES",
    "MathItem",
    "MathRewardConfig",
    "MathScore",
    "OverlongConfig",
    "PoolConfig",
    "RetoolRewardConfig",
    "Reward",
    "ScoringPool",
    "TauRewardInput",
    "TauShapingConfig",
    "WorkerCrashed",
    "WorkerError",
    "WorkerTimeout",
    "extract_answer",
    "extract_answer_line",
    "extract_boxed",
    "extract_boxed_strict",
    "fast_verdict",
    "normalize_answer",
    "normalize_by_group_max",
    "output_found",
    "overlong_penalty",
    "overlong_penalty_from_mask",
    "parse_rational",
    "retool_reward",
    "score_batch",
    "score_math",
    "symbolic_equal",
    "tau_reward",
]
