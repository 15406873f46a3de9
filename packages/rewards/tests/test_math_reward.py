"""score_math: config validation, scores, fast paths and verl's strict compatibility."""

from __future__ import annotations

import time

import pytest

from turnrl.rewards import MathRewardConfig, fast_verdict, normalize_answer, score_math


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="mode"):
        MathRewardConfig(mode="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        MathRewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="tail_chars"):
        MathRewardConfig(tail_chars=0)
    with pytest.raises(ValueError, match="float_rounding"):
        MathRewardConfig(float_rounding=-1)


def test_blank_ground_truth_is_refused():
    with pytest.raises(ValueError, match="ground_truth is empty"):
        score_math("\\boxed{1}", "  ")


def test_non_string_inputs_are_refused():
    with pytest.raises(TypeError, match="response"):
        score_math(None, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ground_truth"):
        score_math("\\boxed{1}", 1)  # type: ignore[arg-type]


def test_dapo_scores():
    config = MathRewardConfig(mode="strict", correct_score=1.0, wrong_score=-1.0)
    assert score_math("\\boxed{34}", "34", config).score == 1.0
    assert score_math("\\boxed{35}", "34", config).score == -1.0
    missing = score_math("I give up", "34", config)
    assert (missing.score, missing.pred, missing.path) == (-1.0, None, "no_answer")


def test_tail_chars_reproduces_verl_window():
    # verl's strict scoring reads only the last 100 characters: an earlier box is not seen.
    response = "\\boxed{34}" + " padding" * 20
    assert score_math(response, "34", MathRewardConfig(mode="strict")).correct
    windowed = score_math(response, "34", MathRewardConfig(mode="strict", tail_chars=100))
    assert not windowed.correct and windowed.path == "no_answer"


def test_fast_paths_decide_typical_items_without_sympy():
    config = MathRewardConfig(mode="math_verify")
    for response, truth, correct, path in [
        ("\\boxed{34}", "34", True, "exact"),
        ("\\boxed{034}", "34", True, "normalized"),
        ("\\boxed{35}", "34", False, "numeric"),
        ("no answer", "34", False, "no_answer"),
    ]:
        verdict, _ = fast_verdict(response, truth, config)
        assert verdict is not None and (verdict.correct, verdict.path) == (correct, path)
    verdict, _ = fast_verdict("\\boxed{\\frac{2}{3}}", "\\frac{1}{3}", config)
    assert verdict is not None and (verdict.correct, verdict.path) == (False, "numeric")
    # Numbers closer than math-verify's float rounding may still be "equal": symbolic.
    verdict, pred = fast_verdict("\\boxed{0.3333333}", "\\frac{1}{3}", config)
    assert verdict is None and pred == "0.3333333"
    # Percentages are math-verify's to read (5000% is 50).
    verdict, _ = fast_verdict("\\boxed{5000\\%}", "50", config)
    assert verdict is None


def test_symbolic_path_is_used_and_recorded():
    score = score_math("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")
    assert score.correct and score.path == "symbolic"
    assert score.breakdown() == {
        "correct": True,
        "pred": "2\\sqrt{2}",
        "path": "symbolic",
        "reason": "",
    }


def test_normalize_examples():
    assert normalize_answer("\\dfrac{2}{4}") == "1/2"
    assert normalize_answer("$1{,}000.0$") == "1000"
    assert normalize_answer("x = \\left( 1, 2 \\right]") == "(1,2]"
    assert normalize_answer("10\\text{ cm}^2") == "10"
    assert normalize_answer("2m") == "2m"  # one letter after a number may be a variable
    assert normalize_answer("1" * 5000) == "1" * 5000  # beyond int() digit limits: kept as text


@pytest.mark.parametrize(
    "answer",
    [
        "1" * 5000 + "x",  # quadratic backtracking in a naive number regex
        "{" * 20000 + "1" + "}" * 20000,  # peeling wrapper braces one layer at a time
        "1" * 3000 + "e" + "1" * 3000 + "x",
        "\\text{" * 3000 + "cm" + "}" * 3000,
        "\\frac{1}{2}" * 3000,
        "1" + " cm" * 5000,
    ],
    ids=["digits", "braces", "sci", "text", "fracs", "units"],
)
def test_cheap_path_stays_cheap_on_adversarial_answers(answer):
    # The cheap path runs in the caller's process (outside any pool timeout): it must be fast.
    start = time.perf_counter()
    for mode in ("normalized", "math_verify"):
        fast_verdict(f"\\boxed{{{answer}}}", "1", MathRewardConfig(mode=mode))
    assert time.perf_counter() - start < 1.0
