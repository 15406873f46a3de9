"""Math answer scoring in three modes: `strict`, `normalized` and `math_verify`.

- `strict`: verl's DAPO `strict_box_verify` rule — the raw content of the last `\\boxed{…}`
  must equal the ground truth string exactly (no stripping, no normalisation).
- `normalized`: the last box (or `Answer:` line) and the ground truth are compared after
  `normalize_answer` (whitespace, `\\dfrac`, `\\left`/`\\right`, units, `$`, `.0`, leading
  zeros, plain numbers as exact fractions, …).
- `math_verify`: equal if `normalized` says so; two plain numbers further apart than
  math-verify's float rounding are unequal; anything else is decided symbolically by the `math-verify` package (sympy), the slow path.

`score_math` scores one item in this process and, for the symbolic path, has no time
bound: use `score_batch` (module `batch`) to score many items with per-item timeouts in a
process pool. `fast_verdict` is the cheap part alone; `symbolic_equal` the expensive part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from turnrl.rewards.math_extract import extract_answer, extract_boxed_strict
from turnrl.rewards.math_normalize import normalize_answer, parse_rational

MathMode = Literal["strict", "normalized", "math_verify"]
MATH_MODES: tuple[str, ...] = ("strict", "normalized", "math_verify")
# How a verdict was reached, recorded in `MathScore.path`.
Path = Literal["no_answer", "exact", "normalized", "numeric", "symbolic", "timeout", "error"]


@dataclass(frozen=True)
class MathRewardConfig:
    """How math answers are extracted, compared and scored."""

    mode: MathMode = "math_verify"
    """`strict` (verl DAPO raw equality), `normalized` (string normalisation) or
    `math_verify` (normalisation first, then symbolic equivalence)."""
    correct_score: float = 1.0
    """Score of a correct answer."""
    wrong_score: float = 0.0
    """Score of a wrong or missing answer (DAPO and ReTool use -1.0)."""
    failure_score: float = 0.0
    """Score of an item whose verification timed out or crashed (the reason is recorded)."""
    timeout_s: float = 5.0
    """Wall-clock limit for one item's symbolic check when scored through a process pool;
    the worker is killed at the limit and replaced."""
    tail_chars: int | None = None
    """Look only at the last N characters of the response (verl's strict scoring reads the
    last 100; None reads everything)."""
    float_rounding: int = 6
    """Decimal places math-verify rounds floats to before comparing."""

    def __post_init__(self) -> None:
        if self.mode not in MATH_MODES:
            raise ValueError(f"mode must be one of {MATH_MODES}, got {self.mode!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.tail_chars is not None and self.tail_chars <= 0:
            raise ValueError(f"tail_chars must be positive or None, got {self.tail_chars}")
        if self.float_rounding < 0:
            raise ValueError(f"float_rounding must be >= 0, got {self.float_rounding}")


@dataclass(frozen=True)
class MathScore:
    """The verdict on one response."""

    score: float
    """The reward: `correct_score`, `wrong_score` or `failure_score` of the config."""
    correct: bool
    """Whether the extracted answer matches the ground truth."""
    pred: str | None
    """The extracted answer (None when the response has none)."""
    path: Path
    """How the verdict was reached: no_answer, exact, normalized, numeric, symbolic,
    timeout or error."""
    reason: str = ""
    """Why scoring failed (timeouts and errors), else empty."""

    def breakdown(self) -> dict[str, object]:
        """The verdict as a plain dict for logging next to the reward."""
        return {
            "correct": self.correct,
            "pred": self.pred,
            "path": self.path,
            "reason": self.reason,
        }


def _check_inputs(response: object, ground_truth: object) -> None:
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth must be a str, got {type(ground_truth).__name__}")
    if not ground_truth.strip():
        raise ValueError("ground_truth is empty: every item needs a reference answer")


def _verdict(config: MathRewardConfig, correct: bool, pred: str | None, path: Path) -> MathScore:
    score = config.correct_score if correct else config.wrong_score
    return MathScore(score=score, correct=correct, pred=pred, path=path)


def _surely_unequal(pred: str, truth: str, norm_pred: str, norm_truth: str, digits: int) -> bool:
    """True when two plain numbers differ by more than math-verify's float rounding can hide.

    math-verify compares numbers exactly, or rounded to `digits` decimals when one is a
    float; two values at least `10**-digits` apart are unequal either way. Percentages are
    left to math-verify (it reads `50\\%` as 0.5, which normalisation does not).
    """
    if "%" in pred or "%" in truth:
        return False
    a, b = parse_rational(norm_pred), parse_rational(norm_truth)
    return a is not None and b is not None and abs(a - b) >= Fraction(1, 10**digits)


def fast_verdict(
    response: str, ground_truth: str, config: MathRewardConfig
) -> tuple[MathScore | None, str | None]:
    """Score without symbolic algebra when the mode and answers allow it.

    Args:
        response: The model's response text.
        ground_truth: The reference answer.
        config: Scoring settings.

    Returns:
        `(score, pred)`: the verdict, or None when only `symbolic_equal` can decide; and
        the extracted answer.

    Raises:
        TypeError: when `response` or `ground_truth` is not a string.
        ValueError: when `ground_truth` is blank.
    """
    _check_inputs(response, ground_truth)
    text = response if config.tail_chars is None else response[-config.tail_chars :]
    if config.mode == "strict":
        pred = extract_boxed_strict(text)
        if pred is None:
            return _verdict(config, False, None, "no_answer"), None
        return _verdict(config, pred == ground_truth, pred, "exact"), pred
    pred = extract_answer(text)
    if pred is None:
        return _verdict(config, False, None, "no_answer"), None
    if pred.strip() == ground_truth.strip():
        return _verdict(config, True, pred, "exact"), pred
    norm_pred, norm_truth = normalize_answer(pred), normalize_answer(ground_truth)
    if norm_pred == norm_truth:
        return _verdict(config, True, pred, "normalized"), pred
    if config.mode == "normalized":
        return _verdict(config, False, pred, "normalized"), pred
    if _surely_unequal(pred, ground_truth, norm_pred, norm_truth, config.float_rounding):
        return _verdict(config, False, pred, "numeric"), pred
    return None, pred


def symbolic_equal(pred: str, ground_truth: str, float_rounding: int = 6) -> bool:
    """Whether `pred` and `ground_truth` are mathematically equal according to math-verify.

    Runs without math-verify's own `signal.alarm` timeouts (they work only in a main thread
    and cannot interrupt long C-level arithmetic); bound it by running it in a process pool.

    Args:
        pred: The extracted answer (LaTeX or plain text).
        ground_truth: The reference answer.
        float_rounding: Decimal places floats are rounded to before comparing.

    Returns:
        True when math-verify parses both and finds them equivalent.
    """
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=None)  # type: ignore[arg-type]
    target = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)  # type: ignore[arg-type]
    if not gold or not target:
        return False
    return bool(verify(gold, target, float_rounding=float_rounding, timeout_seconds=None))


def score_math(
    response: str, ground_truth: str, config: MathRewardConfig | None = None
) -> MathScore:
    """Score one response against its ground truth in this process (no timeout).

    Args:
        response: The model's response text.
        ground_truth: The reference answer.
        config: Scoring settings (default: `math_verify` mode, 1 / 0 scores).

    Returns:
        The verdict with the extracted answer and how it was decided.

    Raises:
        TypeError: when `response` or `ground_truth` is not a string.
        ValueError: when `ground_truth` is blank.
    """
    config = config or MathRewardConfig()
    verdict, pred = fast_verdict(response, ground_truth, config)
    if verdict is not None:
        return verdict
    assert pred is not None
    equal = symbolic_equal(pred, ground_truth, config.float_rounding)
    return _verdict(config, equal, pred, "symbolic")


def warm_up() -> None:
    """Run a few symbolic checks so a fresh worker's first real items are not slow.

    math-verify builds its LaTeX parser and sympy fills caches on first use (about a second);
    `ScoringPool` workers call this before they report ready.
    """
    for pred, truth in (
        ("\\frac{1}{2}x", "\\frac{x}{2}"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("(1,2]", "(1,2]"),
        ("\\{1,2\\}", "\\{2,1\\}"),
        ("x^2-1", "(x-1)(x+1)"),
        ("50\\%", "0.5"),
    ):
        symbolic_equal(pred, truth)
